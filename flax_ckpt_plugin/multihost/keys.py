"""The keys of the coordination service: every key a job uses is made here.

Processes meet at a barrier, or read what another set, only under the same
key; a key one process spells differently from the others is no error
anywhere, but a wait that lasts until its deadline on every host. So no
module formats a key by hand: a meeting's key is `fresh` (a reused name
made new for this meeting), a process's own entry under a key is
`of_process`, a part of a meeting is its `child`, and what a listing of
`kv_dir` returns is read back by `index` and `by_index`. The keys of one
generation of an elastic group are a `Generation`.

The counter behind `fresh` is a `Rounds`, which every coordinator holds as
its `rounds`: one per process, shared by every coordinator of it, so that a
coordinator made anew never reuses a key an earlier one used.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Mapping, Protocol


class Rounds:
  """How often this process asked for each name (0, 1, 2, ...).

  Every process asks in the same order, so the numbers agree across
  processes: a name used again (a directory opened a second time) gets a
  fresh key this way (`fresh`). Safe from several threads.
  """

  def __init__(self):
    self._rounds: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()

  def take(self, name: str) -> int:
    """How often `name` was taken before; counts this time."""
    with self._lock:
      n = self._rounds[name]
      self._rounds[name] += 1
      return n


class _HasRounds(Protocol):
  rounds: Rounds


def fresh(coord: _HasRounds, key: str) -> str:
  """`key/N`, N the times this process asked for `key` before.

  Called by every process in the same order, so all of them get the same
  key, new each time: for a meeting under a name that is used again.

  Args:
    coord: the coordinator (its `rounds` counts).
    key: the reused name.

  Returns:
    The key of this round of `key`.
  """
  return child(key, coord.rounds.take(key))


def child(key: str, *names: Any) -> str:
  """`key/name/...`: a part of what meets under `key` (each of `names`
  written as `str` writes it)."""
  return "/".join((key, *map(str, names)))


def of_process(key: str, process: int) -> str:
  """`key/process`: what process `process` sets under `key`, which
  `by_index` reads back."""
  return child(key, process)


def index(key: str) -> int:
  """The number at the end of `key` (`of_process`'s process, a chunk's
  or a generation's number), as `int`.

  Raises:
    ValueError: `key`'s last part is no number.
  """
  return int(key.rsplit("/", 1)[1])


def by_index(entries: Mapping[str, str]) -> dict[int, str]:
  """A listing of `kv_dir` whose keys end in numbers (`of_process`), by
  that number: {process: value}."""
  return {index(k): v for k, v in entries.items()}


@dataclasses.dataclass(frozen=True)
class Generation:
  """The keys of generation `gen` of the elastic group of key `base`.

  Each generation is recorded once in a job, so no key of an earlier one
  is met again.

  Attributes:
    base: the group's key (`generations.group_key`).
    gen: the generation, which counts the group's changes.
  """
  base: str
  gen: int

  @property
  def key(self) -> str:
    """Under which this generation's members meet (`base/gen`)."""
    return child(self.base, self.gen)

  @property
  def lost(self) -> str:
    """Set once this generation's watcher reported a lost process."""
    return child(self.key, "lost")

  @property
  def recover(self) -> str:
    """Where the survivors of a loss meet to recover in place."""
    return child(self.key, "recover")

  @property
  def votes(self) -> str:
    """Where the members vote on the step to take processes back at."""
    return child(self.key, "votes")

  @property
  def watch(self) -> str:
    """The records of this generation's watch (`liveness.watch`)."""
    return child(self.key, "watch")
