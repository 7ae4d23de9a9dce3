"""Coordinators for other groups of processes than the whole job.

`SoloCoordinator` is one process by itself: what a process keeps for
itself alone (the local tier) meets nobody. `Survivors` is the processes
left after a peer was lost: their barriers name them (`process_ids=`), and
their calls ignore the watcher that ended every wait of the job's
coordinator (see `rescue`). `common_newest`: the newest step that every
member of a group has.
"""

from __future__ import annotations

import json
from typing import Sequence

from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings


class SoloCoordinator:
  """One process by itself, whatever the job: barriers pass at once and the
  key-value store is its own."""

  process_index = 0
  process_count = 1

  def __init__(self):
    self.rounds = keys.Rounds()
    self._kv: dict[str, str] = {}

  def barrier(self, key: str, *, timeout_ms: int,
              process_ids: Sequence[int] | None = None) -> None:
    del key, timeout_ms, process_ids

  def kv_set(self, key: str, value: str) -> None:
    self._kv[key] = value

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    if key not in self._kv:
      raise TimeoutError(f"key {key!r} was never set")
    return self._kv[key]

  def kv_dir(self, prefix: str) -> dict[str, str]:
    return {k: v for k, v in self._kv.items() if k.startswith(prefix + "/")}

  def kv_delete(self, key: str) -> None:
    for k in [k for k in self._kv if k == key or k.startswith(key + "/")]:
      del self._kv[k]

  def live_processes(self, process_ids=None, timeout_secs=None
                     ) -> dict[int, int]:
    del process_ids, timeout_secs
    return {0: 0}

  def reached_preemption_sync_point(self, step: int) -> bool:
    return False

  def preemption_notifier_installed(self) -> bool:
    return False


class Survivors:
  """The job's coordinator, for `members` only (the survivors of a loss).

  Process indices stay the job's; every barrier names `members`. Calls
  ignore the job coordinator's abort (`JaxCoordinator.unguarded`).
  """

  def __init__(self, coord: coordinator_lib.Coordinator,
               members: Sequence[int]):
    if isinstance(coord, Survivors):  # Survivors of survivors: the job's.
      coord = coord._coord  # pylint: disable=protected-access
    unguarded = getattr(coord, "unguarded", None)
    self._coord = unguarded() if unguarded is not None else coord
    self.members = sorted(members)

  @property
  def process_index(self) -> int:
    return self._coord.process_index

  @property
  def process_count(self) -> int:
    return self._coord.process_count

  def barrier(self, key: str, *, timeout_ms: int,
              process_ids: Sequence[int] | None = None) -> None:
    del process_ids
    if self.members == [self.process_index]:
      return  # A group of one meets nobody (and reuses no key of the job's).
    self._coord.barrier(key, timeout_ms=timeout_ms, process_ids=self.members)

  def kv_set(self, key: str, value: str) -> None:
    self._coord.kv_set(key, value)

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    return self._coord.kv_get(key, timeout_ms=timeout_ms)

  def kv_dir(self, prefix: str) -> dict[str, str]:
    return self._coord.kv_dir(prefix)

  def kv_delete(self, key: str) -> None:
    self._coord.kv_delete(key)

  @property
  def rounds(self) -> keys.Rounds:
    return self._coord.rounds

  def live_processes(self, *args, **kwargs) -> dict[int, int]:
    return self._coord.live_processes(*args, **kwargs)

  def abort_when(self, check, *, replacing=None) -> None:
    """See `JaxCoordinator.abort_when`: a watcher of the survivors (see
    `elastic`) ends their waits, not the job's first watcher."""
    set_abort = getattr(self._coord, "abort_when", None)
    if set_abort is not None:
      set_abort(check, replacing=replacing)

  def reached_preemption_sync_point(self, step: int) -> bool:
    return self._coord.reached_preemption_sync_point(step)

  def preemption_notifier_installed(self) -> bool:
    return self._coord.preemption_notifier_installed()


def common_newest(meeting: meetings.Meeting, steps: Sequence[int],
                  latest: int | None) -> tuple[int | None, int | None]:
  """Every member of `group` gives its `steps` (a tier's, say) and its
  `latest` (another's newest step, or None); all get the newest step that
  every member has, and the newest `latest` of any (None where there is
  none). The first member reads every member's and records the answer:
  one small read for each other member, whatever their number (each
  reading every member's list is O(members) each, O(members^2) for the
  coordination service)."""
  group = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  me = group.process_index
  group.kv_set(keys.of_process(keys.child(key, "steps"), me),
               json.dumps([list(steps), latest]))
  group.barrier(keys.child(key, "listed"), timeout_ms=timeout_ms)

  def decide() -> list[int | None]:
    listed = [json.loads(v)
              for v in group.kv_dir(keys.child(key, "steps")).values()]
    common = set.intersection(*(set(s) for s, _ in listed))
    return [max(common, default=None),
            max((s for _, s in listed if s is not None), default=None)]

  step, newest = meetings.decided_by_one(
      meeting.under("common"), decide,
      decides=me == group.members[0],
      what=f"the newest step that processes {list(group.members)} hold")
  return step, newest
