"""Who among the processes has which shard of a local step: the
survivors' save (`rescue`: who writes it) and the restore from partner
copies (`rebuild`: who sends it).

Each process's local tier holds its own copies of the shards its devices
held, and the partner copies it received (`exchange`). Each shard goes to
the lowest process that holds it, and all of it goes ahead only if
together they hold every shard of every leaf. Finding that out must not
cost every process the lists of every other (O(processes x leaves) each,
and as much again per process for the coordination service): processes
that hold the same shards (the replicas of data parallelism) say so by a
digest of their list; only the lowest of each kind shares its list; the
first holder reads those lists, checks that they cover every leaf, and
gives each the list of what it has to write or send (and, for `rebuild`,
everyone the whole map). A process that has nothing reads a verdict of a
few bytes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple, TYPE_CHECKING

from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.restore.data_files import ByteReader
from flax_ckpt_plugin.restore.reader import LeafReader
from flax_ckpt_plugin.save.leaves import LeafSnapshot
from flax_ckpt_plugin.save.leaves import ShardData

if TYPE_CHECKING:
  from flax_ckpt_plugin.manager.tier import TierManager


def agreed(meeting: meetings.Meeting, fn: Any, what: str) -> Any:
  """`fn()` on every survivor; None on all of them if it failed on any."""
  outcome = meetings.agree(meeting, fn)
  if outcome.failures:
    log.warning("sharing out a local step stops: %s failed: %s", what,
                meetings.describe_failures(outcome.failures))
    return None
  return outcome.result


class Shares(NamedTuple):
  """What `share_out` gives a process."""
  manifest: manifest_lib.Manifest  # The step's (the first holder's).
  leaves: list[LeafSnapshot]  # This process's share of every leaf.
  data: datastate.Encoded | None  # This process's data state.
  # With `everyone`: per leaf path, the process that has each region.
  owner: dict[str, dict[tuple, int]] | None


def assigned(meeting: meetings.Meeting, manager: TierManager, step: int
             ) -> tuple[list[LeafSnapshot], Any, Any] | None:
  """This survivor's share of `step` (for each shard, the lowest survivor
  that holds it writes it), the step's `extra`, and this survivor's data
  state (`datastate.Encoded`, or None). None (on every survivor) if they
  do not hold every shard, or one failed to read. See `share_out`."""
  found = share_out(meeting, manager, step)
  return None if found is None else (found.leaves, found.manifest.extra,
                                     found.data)


def share_out(meeting: meetings.Meeting, manager: TierManager,
              step: int, *, holders: list[int] | None = None,
              everyone: bool = False) -> Shares | None:
  """Who has which shard of local step `step`, and this process's share.

  For each shard (its own or a partner copy, see `exchange`), the lowest
  holder of it has it. Called on every member of the meeting's group, in
  five agreed phases (see the module doc): the digests of what each
  holds, the writers (the lowest of each digest), their lists, the
  first holder's plan, and the reads. Reads the local step from disk, or
  from the snapshot still held (`TierManager.read_step`): the loop may
  have closed the managers.

  Args:
    meeting: where the group meets.
    manager: this process's local tier's (`LocalTier.manager`).
    step: the local step.
    holders: the processes whose local tier holds the step (None: every
      member); the others (a relaunched process whose disk was lost) take
      part, hold nothing, and learn the step's manifest from the first
      holder.
    everyone: every process also learns who has each region (`owner`).

  Returns:
    This process's share, read from its local tier; None (on every
    process) if together they do not hold every shard, or one failed to
    read.
  """
  sharing = _Sharing(meeting, manager, step, holders, everyone)
  if (found := agreed(meeting.under("held"), sharing.digest,
                      f"reading local step {step}")) is None:
    return None
  own, held = found
  if agreed(meeting.under("writers"), sharing.choose_writers,
            "choosing the writers") is None:
    return None
  if (listed := agreed(meeting.under("lists"),
                       lambda: sharing.share_list(own, held),
                       "sharing the lists of shards")) is None:
    return None
  listers, manifest = listed
  if agreed(meeting.under("plan"), lambda: sharing.plan(listers, manifest),
            "assigning the shards") is None:
    return None
  missing = sharing.verdict()
  if missing:
    log.warning("the processes do not hold all of local step %d (%s)", step,
                missing)
    return None
  mine = sharing.mine(listers)
  owner = sharing.owner() if everyone else None
  found = agreed(meeting.under("read"),
                 lambda: sharing.read(own, manifest, mine),
                 f"reading the shards of local step {step}")
  return None if found is None else Shares(manifest, found[0], found[1],
                                           owner)


class _Sharing:
  """One process's part in `share_out`: each phase's work, its inputs and
  outputs passed in and returned (what the phases agree on is the
  group's, through the coordination service's keys below)."""

  def __init__(self, meeting: meetings.Meeting, manager: TierManager,
               step: int, holders: list[int] | None, everyone: bool):
    self.group, self.manager, self.step = meeting.coordinator, manager, step
    self.everyone, self.timeout_ms = everyone, meeting.timeout_ms
    self.me = self.group.process_index
    holders = (list(self.group.members) if holders is None
               else sorted(holders))
    self.first, self.holding = holders[0], self.me in holders
    self.step_dir = manager.directory / str(step)
    key = meeting.key
    # Each process's digest of what it holds, list of it, and share; the
    # first holder's manifest, writers, verdict and map of owners.
    (self.digests, self.lists, self.shares, self.manifest_key,
     self.writers_key, self.missing_key, self.owner_key) = (
         keys.child(key, name) for name in (
             "digest", "list", "mine", "manifest", "writers", "missing",
             "owner"))

  def _fetch(self, key: str) -> Any:
    return json.loads(meetings.fetch_text(self.group, key, self.timeout_ms))

  def digest(self) -> tuple[manifest_lib.Manifest | None,
                            dict[str, list[Any]]]:
    """Publishes the digest of the shards this process holds.

    Returns:
      This process's manifest of the step (None where it holds none), and
      the shards it holds, per leaf path.
    """
    if self.me == self.first and self.everyone:
      meetings.share_text(self.group, self.manifest_key, self.manager.backend
                          .read_small(self.step_dir / manifest_lib.MANIFEST,
                                      within=self.step_dir,
                                      limit=manifest_lib.MAX_MANIFEST_BYTES)
                          .decode("utf-8"))
    if not self.holding:
      return None, {}
    m = manifest_lib.read(self.step_dir, self.step, self.manager.backend)
    held = {leaf.path: [s.index_list for s in leaf.shards]
            for leaf in m.leaves if leaf.is_array}
    self.group.kv_set(keys.of_process(self.digests, self.me), hashlib.sha256(
        json.dumps(held, sort_keys=True).encode()).hexdigest())
    return m, held

  def choose_writers(self) -> bool:
    """The first holder names the lowest process of each digest."""
    if self.me == self.first:
      lowest: dict[str, int] = {}
      for p, v in sorted(keys.by_index(
          self.group.kv_dir(self.digests)).items()):
        lowest.setdefault(v, p)
      self.group.kv_set(self.writers_key,
                        json.dumps(sorted(lowest.values())))
    return True

  def share_list(self, own: manifest_lib.Manifest | None,
                 held: dict[str, list[Any]]
                 ) -> tuple[list[int], manifest_lib.Manifest]:
    """A writer shares the list of what it holds.

    Returns:
      The writers, and the step's manifest (the first holder's, for a
      process that holds none).
    """
    writers = json.loads(self.group.kv_get(self.writers_key,
                                           timeout_ms=self.timeout_ms))
    if self.me in writers:
      meetings.share_text(self.group, keys.of_process(self.lists, self.me),
                          json.dumps(held))
    if own is not None:
      return writers, own
    return writers, manifest_lib.parse(meetings.fetch_text(
        self.group, self.manifest_key, self.timeout_ms).encode("utf-8"),
        f"local step {self.step} of process {self.first}")

  def plan(self, listers: list[int], manifest: manifest_lib.Manifest
           ) -> bool:
    """The first holder works out who has what, and whether all is held:
    each writer's share, the map of owners (`everyone`), the verdict."""
    if self.me != self.first:
      return True
    owner: dict[str, dict[tuple, int]] = {}
    for p in reversed(listers):  # The lowest holder wins.
      for path, indices in self._fetch(
          keys.of_process(self.lists, p)).items():
        for index in indices:
          owner.setdefault(path, {})[tuple(map(tuple, index))] = p
    missing = ""
    for leaf in manifest.leaves:
      if leaf.is_array:
        try:
          manifest_lib.check_grid(
              [list(map(list, i)) for i in owner.get(leaf.path, {})],
              list(leaf.shape), leaf.path)
        except ValueError as e:
          missing = str(e)
          break
    if not missing:
      for p in listers:
        meetings.share_text(
            self.group, keys.of_process(self.shares, p), json.dumps(
                {path: [i for i, q in where.items() if q == p]
                 for path, where in owner.items()}))
      if self.everyone:
        meetings.share_text(self.group, self.owner_key, json.dumps(
            {path: [[i, q] for i, q in where.items()]
             for path, where in owner.items()}))
    self.group.kv_set(self.missing_key, json.dumps(missing))
    return True

  def verdict(self) -> str:
    """What the first holder found missing ("": nothing)."""
    return json.loads(self.group.kv_get(self.missing_key,
                                        timeout_ms=self.timeout_ms))

  def mine(self, listers: list[int]) -> dict[str, set[tuple]]:
    """The regions this process has, per leaf path."""
    if self.me not in listers:
      return {}
    return {path: {tuple(map(tuple, i)) for i in indices}
            for path, indices in self._fetch(
                keys.of_process(self.shares, self.me)).items()}

  def owner(self) -> dict[str, dict[tuple, int]]:
    """Per leaf path, the process that has each region."""
    return {path: {tuple(map(tuple, i)): q for i, q in where}
            for path, where in self._fetch(self.owner_key).items()}

  def read(self, own: manifest_lib.Manifest | None,
           manifest: manifest_lib.Manifest, mine: dict[str, set[tuple]]
           ) -> tuple[list[LeafSnapshot], datastate.Encoded | None]:
    """This process's share of every leaf, and its data state."""
    if own is None:
      return [_leaf_share(leaf, set(), None, manifest)
              for leaf in manifest.leaves], None

    def leaves_through(storage) -> list[LeafSnapshot]:
      reader = ByteReader(self.step_dir, own.files, storage)
      try:
        return [_leaf_share(leaf, mine.get(leaf.path, set()), reader, own)
                for leaf in own.leaves]
      finally:
        reader.close()

    # The newest step this process saved comes from the snapshot it still
    # holds (`TierManager.read_step`), not from its disk.
    leaves = self.manager.read_step(self.step, leaves_through)
    data = datastate.of_step(self.step_dir, own, self.manager.coordinator,
                             self.manager.backend)
    return leaves, None if data is None else datastate.encode(data)


def _leaf_share(leaf: manifest_lib.LeafRecord, mine: set[tuple],
                reader: ByteReader | None, m: manifest_lib.Manifest
                ) -> LeafSnapshot:
  shards = []
  if leaf.is_array and mine:
    lr = LeafReader(reader=reader, leaf=leaf, where=f"local step {m.step}",
                    verify=True, block=m.checksum_block_bytes)
    shards = [ShardData(s.index, lr.read(s.index)) for s in leaf.shards
              if s.index in mine]
  return LeafSnapshot(
      leaf.path, list(leaf.keys), leaf.kind,
      None if leaf.dtype is None else str(leaf.dtype), leaf.shape, shards,
      value=leaf.value, key_impl=leaf.key_impl)
