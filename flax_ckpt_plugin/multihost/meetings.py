"""How processes meet: every one does its part and all learn how it went
(`agree`), or one process decides and every process reads it
(`decided_by_one`).

Where the processes must act alike on what one of them sees (the steps
the primary lists, the steps retention deletes, the newest step of a
directory, the step a group of survivors has in common), one process
decides and shares the answer under a key; every other process waits for
that key and takes the answer, whatever it would have seen itself. A
`Meeting` names where they meet: the coordinator, a key new for this
meeting (see `keys.fresh`), and how long each waits.

`agree` runs a piece of work on every process, after which all learn
together who failed. `decided_by_one` shares a decision, or the error
that kept it from being made: every process then raises, the decider its
own error and the others a `RuntimeError` that names it, so that none
waits out its deadline for an answer that will not come. `share_text`
and `fetch_text` carry a text of any size through the key-value store, in
chunks.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Generic, NamedTuple, TypeVar

from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import keys

_CHUNK = 1 << 20  # Characters per key-value entry of a shared text.
T = TypeVar("T")


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
    return Meeting(self.coordinator, keys.child(self.key, name),
                   self.timeout_ms)


class Outcome(NamedTuple, Generic[T]):
  """What `agree` learned: this process's result or error, and everyone's."""

  result: T | None  # `fn()`'s value here (None if it raised).
  error: Exception | None  # What `fn` raised here, or None.
  # Every process whose `fn` raised (this one included): its index, and the
  # error's type name and message, as recorded before the barrier.
  failures: dict[int, tuple[str, str]]

  def failed_elsewhere(self, me: int) -> dict[int, tuple[str, str]]:
    return {p: f for p, f in self.failures.items() if p != me}


def describe_failures(failures: dict[int, tuple[str, str]]) -> str:
  """'process 1: OSError: ...; process 3: ...' for error messages."""
  return "; ".join(
      f"process {p}: {t}: {m}" for p, (t, m) in sorted(failures.items()))


def agree(meeting: Meeting, fn: Callable[[], T], *,
          on_timeout: Callable[[], None] | None = None) -> Outcome[T]:
  """Runs `fn` on every process, then all learn together who failed.

  A process whose `fn` raised records that under the meeting's key before
  the barrier there, so after it every process knows every failure at
  once. Called by every process of the meeting, whose key must not have
  been used for an earlier agreement (see `keys.fresh`).
  Never raises `fn`'s error itself: the caller decides, from the
  `Outcome`, what each process raises.

  Raises:
    TimeoutError: another process did not arrive within the meeting's
      deadline (it died or stopped calling the library); `on_timeout` runs
      first.
  """
  coord, key, timeout_ms = meeting.coordinator, meeting.key, meeting.timeout_ms
  result, error = None, None
  try:
    result = fn()
  except Exception as e:  # pylint: disable=broad-except
    error = e
  me, multi = coord.process_index, coord.process_count > 1
  failures: dict[int, tuple[str, str]] = {}
  if error is not None:
    failures[me] = (type(error).__name__, str(error))
    if multi:
      coord.kv_set(keys.of_process(keys.child(key, "failed"), me),
                   f"{type(error).__name__}\n{error}")
  if multi:
    try:
      coord.barrier(keys.child(key, "done"), timeout_ms=timeout_ms)
    except Exception:
      if on_timeout is not None:
        on_timeout()
      raise
    for p, v in keys.by_index(coord.kv_dir(keys.child(key, "failed"))).items():
      type_name, _, message = v.partition("\n")
      failures[p] = (type_name, message)
  return Outcome(result, error, failures)


def decided_by_one(meeting: Meeting, decide: Callable[[], Any], *,
                   decides: bool, what: str, consequence: str = "",
                   error: type[Exception] = RuntimeError) -> Any:
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
    error: the type of the others' error.

  Raises:
    Exception: (on the decider) the error `decide` raised; it is shared
      first.
    RuntimeError: (on the others; or `error`) the decider's error, named
      with `what`.
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
    raise error(
        f"{what} failed on process {said['process']}, which decides it:"
        f" {said['error']}" + (f"; {consequence}" if consequence else ""))
  return said["answer"]


def share_text(coord: coordinator_lib.Coordinator, key: str,
               text: str) -> None:
  """Sets `text` under `key` for `fetch_text`: a short text in `key`
  itself (one write, one read), a long one in chunks under `key/N`, which
  `key`, set last, counts."""
  if len(text) <= _CHUNK:
    coord.kv_set(key, "=" + text)
    return
  chunks = [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)]
  for n, chunk in enumerate(chunks):
    coord.kv_set(keys.child(key, n), chunk)
  coord.kv_set(key, f"#{len(chunks)}")


def fetch_text(coord: coordinator_lib.Coordinator, key: str,
               timeout_ms: int) -> str:
  """The text another process shared under `key` (waits for it)."""
  said = coord.kv_get(key, timeout_ms=timeout_ms)
  if said.startswith("="):
    return said[1:]
  return "".join(coord.kv_get(keys.child(key, n), timeout_ms=timeout_ms)
                 for n in range(int(said[1:])))
