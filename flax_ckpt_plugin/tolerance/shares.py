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
  """Who has which shard of local step `step`: for each shard (its own or
  a partner copy, see `exchange`), the lowest holder of it has it. Returns
  this process's share, read from its local tier; None (on every process)
  if together they do not hold every shard, or one failed to read.

  Args:
    holders: the processes whose local tier holds the step (None: every
      member); the others (a relaunched process whose disk was lost) take
      part, hold nothing, and learn the step's manifest from the first
      holder.
    everyone: every process also learns who has each region (`owner`).

  `manager` is this process's local tier's (`LocalTier.manager`).
  Reads the local step from disk: the loop may have closed the managers.
  """
  group = meeting.coordinator
  key = meeting.key
  # Each process's digest of what it holds, list of it, and share to write.
  digests, lists, mine_of = (keys.child(key, name)
                             for name in ("digest", "list", "mine"))
  timeout_ms = meeting.timeout_ms
  me = group.process_index
  holders = list(group.members) if holders is None else sorted(holders)
  first, holding = holders[0], me in holders
  step_dir = manager.directory / str(step)
  held: dict[str, list[Any]] = {}

  def digest() -> tuple[manifest_lib.Manifest | None]:
    if me == first and everyone:
      meetings.share_text(group, f"{key}/manifest", manager.backend
                          .read_small(step_dir / manifest_lib.MANIFEST,
                                      within=step_dir,
                                      limit=manifest_lib.MAX_MANIFEST_BYTES)
                          .decode("utf-8"))
    if not holding:
      return (None,)
    m = manifest_lib.read(step_dir, step, manager.backend)
    held.update({leaf.path: [s.index_list for s in leaf.shards]
                 for leaf in m.leaves if leaf.is_array})
    group.kv_set(keys.of_process(digests, me), hashlib.sha256(
        json.dumps(held, sort_keys=True).encode()).hexdigest())
    return (m,)

  if (found := agreed(meeting.under("held"), digest,
                      f"reading local step {step}")) is None:
    return None
  m = found[0]

  def writers() -> bool:  # The first holder: the lowest of each kind.
    if me == first:
      lowest: dict[str, int] = {}
      for p, v in sorted(keys.by_index(
          group.kv_dir(digests)).items()):
        lowest.setdefault(v, p)
      group.kv_set(f"{key}/writers", json.dumps(sorted(lowest.values())))
    return True

  def share() -> tuple[list[int], manifest_lib.Manifest]:
    found = json.loads(group.kv_get(f"{key}/writers", timeout_ms=timeout_ms))
    if me in found:
      meetings.share_text(group, keys.of_process(lists, me),
                          json.dumps(held))
    if m is not None:
      return found, m
    return found, manifest_lib.parse(meetings.fetch_text(
        group, f"{key}/manifest", timeout_ms).encode("utf-8"),
        f"local step {step} of process {first}")

  if agreed(meeting.under("writers"), writers, "choosing the writers") is None:
    return None
  if (listed := agreed(meeting.under("lists"), share,
                       "sharing the lists of shards")) is None:
    return None
  listers, manifest = listed

  def plan() -> bool:  # The first holder: who has what, if all is held.
    if me != first:
      return True
    owner: dict[str, dict[tuple, int]] = {}
    for p in reversed(listers):  # The lowest holder wins.
      for path, indices in json.loads(meetings.fetch_text(
          group, keys.of_process(lists, p), timeout_ms)).items():
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
        meetings.share_text(group, keys.of_process(mine_of, p), json.dumps(
            {path: [i for i, q in where.items() if q == p]
             for path, where in owner.items()}))
      if everyone:
        meetings.share_text(group, f"{key}/owner", json.dumps(
            {path: [[i, q] for i, q in where.items()]
             for path, where in owner.items()}))
    group.kv_set(f"{key}/missing", json.dumps(missing))
    return True

  if agreed(meeting.under("plan"), plan, "assigning the shards") is None:
    return None
  missing = json.loads(group.kv_get(f"{key}/missing",
                                    timeout_ms=timeout_ms))
  if missing:
    log.warning("the processes do not hold all of local step %d (%s)", step,
                missing)
    return None
  mine: dict[str, set[tuple]] = {}
  if me in listers:
    mine = {path: {tuple(map(tuple, i)) for i in indices}
            for path, indices in json.loads(meetings.fetch_text(
                group, keys.of_process(mine_of, me), timeout_ms)).items()}
  owner = None
  if everyone:
    owner = {path: {tuple(map(tuple, i)): q for i, q in where}
             for path, where in json.loads(meetings.fetch_text(
                 group, f"{key}/owner", timeout_ms)).items()}

  def read() -> tuple[list[LeafSnapshot], datastate.Encoded | None]:
    if m is None:
      return [_leaf_share(leaf, set(), None, manifest)
              for leaf in manifest.leaves], None
    def leaves_through(storage) -> list[LeafSnapshot]:
      reader = ByteReader(step_dir, m.files, storage)
      try:
        return [_leaf_share(leaf, mine.get(leaf.path, set()), reader, m)
                for leaf in m.leaves]
      finally:
        reader.close()

    # The newest step this process saved comes from the snapshot it still
    # holds (`CheckpointManager.read_step`), not from its disk.
    leaves = manager.read_step(step, leaves_through)
    data = datastate.of_step(step_dir, m, manager.coordinator,
                             manager.backend)
    return leaves, None if data is None else datastate.encode(data)

  found = agreed(
      meeting.under("read"), read, f"reading the shards of local step {step}")
  return None if found is None else Shares(manifest, found[0], found[1],
                                           owner)


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
