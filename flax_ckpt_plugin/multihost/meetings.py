"""One process decides, every process reads it: the processes' one way to
share a decision.

Where the processes must act alike on what one of them sees (the steps
the primary lists, the steps retention deletes, the newest step of a
directory, the step a group of survivors has in common), one process
decides and shares the answer under a key; every other process waits for
that key and takes the answer, whatever it would have seen itself. A
`Meeting` names where they meet: the coordinator, a key new for this
meeting (see `Coordinator.next_round`), and how long each waits.

`decided_by_one` shares the decision, or the error that kept it from
being made: every process then raises, the decider its own error and the
others a `RuntimeError` that names it, so that none waits out its
deadline for an answer that will not come. `share_text` and `fetch_text`
carry a text of any size through the key-value store, in chunks.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from flax_ckpt_plugin.multihost import coordinator as coordinator_lib

_CHUNK = 1 << 20  # Characters per key-value entry of a shared text.


@dataclasses.dataclass(frozen=True)
class Meeting:
  """Where processes meet once.

  Attributes:
    coordinator: the processes that meet (the job, or a group of it).
    key: the meeting's key, the same on every process and used once.
    timeout_ms: how long each process waits for the others.
  """
  coordinator: coordinator_lib.Coordinator
  key: str
  timeout_ms: int

  def under(self, name: str) -> Meeting:
    """A meeting of the same processes under `key/name`."""
    return Meeting(self.coordinator, f"{self.key}/{name}", self.timeout_ms)


def decided_by_one(meeting: Meeting, decide: Callable[[], Any], *,
                   decides: bool, what: str, consequence: str = "") -> Any:
  """`decide()` on the process where `decides` is true (one of them), its
  answer on every process.

  Called by every process of the meeting. The answer is JSON (a list,
  numbers, strings, None); it is shared under the meeting's key, of any
  size. One process alone decides without sharing.

  Args:
    meeting: where the processes meet.
    decide: what the deciding process runs.
    decides: whether this process is the one that decides.
    what: the decision, for the error of the others ("listing the steps
      of /ckpt").
    consequence: what that error leaves behind, said after it ("the step
      is finalized").

  Raises:
    Exception: (on the decider) the error `decide` raised; it is shared
      first.
    RuntimeError: (on the others) the decider's error, named with `what`.
    TimeoutError: the answer did not come within the meeting's deadline
      (the deciding process died or fell behind).
  """
  coord = meeting.coordinator
  multi = coord.process_count > 1
  if decides:
    try:
      answer = decide()
    except Exception as e:
      if multi:
        share_text(coord, meeting.key, json.dumps(
            {"error": f"{type(e).__name__}: {e}",
             "process": coord.process_index}))
      raise
    if multi:
      share_text(coord, meeting.key, json.dumps({"answer": answer}))
    return answer
  said = json.loads(fetch_text(coord, meeting.key, meeting.timeout_ms))
  if "error" in said:
    raise RuntimeError(
        f"{what} failed on process {said['process']}, which decides it:"
        f" {said['error']}" + (f"; {consequence}" if consequence else ""))
  return said["answer"]


def share_text(coord: coordinator_lib.Coordinator, key: str,
               text: str) -> None:
  """Sets `text` under `key` for `fetch_text`, in chunks."""
  chunks = [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)] or [""]
  for n, chunk in enumerate(chunks):
    coord.kv_set(f"{key}/{n}", chunk)
  coord.kv_set(f"{key}/count", str(len(chunks)))


def fetch_text(coord: coordinator_lib.Coordinator, key: str,
               timeout_ms: int) -> str:
  """The text another process shared under `key` (waits for it)."""
  count = int(coord.kv_get(f"{key}/count", timeout_ms=timeout_ms))
  return "".join(coord.kv_get(f"{key}/{n}", timeout_ms=timeout_ms)
                 for n in range(count))
