"""Who among the survivors writes which shard of a local step (`rescue`).

Each survivor's local tier holds its own copies of the shards its devices
held. For the survivors' save, each shard is written by the lowest survivor
that holds it, and the save goes ahead only if together they hold every
shard of every leaf. Finding that out must not cost every survivor the
lists of every other (O(survivors x leaves) each, and as much again per
survivor for the coordination service): survivors that hold the same
shards (the replicas of data parallelism) say so by a digest of their list;
only the lowest of each kind shares its list; the first survivor reads
those lists, checks that they cover every leaf, and gives each writer the
list of what it writes. A survivor that writes nothing reads a verdict of
a few bytes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TYPE_CHECKING

from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.restore.data_files import ByteReader
from flax_ckpt_plugin.restore.reader import LeafReader
from flax_ckpt_plugin.save.leaves import LeafSnapshot
from flax_ckpt_plugin.save.leaves import ShardData

if TYPE_CHECKING:
  from flax_ckpt_plugin.tolerance import local_tier


def agreed(meeting: meetings.Meeting, fn: Any, what: str) -> Any:
  """`fn()` on every survivor; None on all of them if it failed on any."""
  outcome = meetings.agree(meeting, fn)
  if outcome.failures:
    log.warning("the survivors' save stops: %s failed: %s", what,
                meetings.describe_failures(outcome.failures))
    return None
  return outcome.result


def assigned(meeting: meetings.Meeting, local: local_tier.LocalTier, step: int
             ) -> tuple[list[LeafSnapshot], Any, Any] | None:
  """This survivor's share of `step` (for each shard, the lowest survivor
  that holds it writes it), the step's `extra`, and this survivor's data
  state (`datastate.Encoded`, or None). None (on every survivor) if they
  do not hold every shard, or one failed to read.

  Reads the local step from disk: the loop may have closed the managers.
  """
  group = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  me, first = group.process_index, group.members[0]
  step_dir = local.directory / str(step)
  held: dict[str, list[Any]] = {}

  def digest() -> manifest_lib.Manifest:
    m = manifest_lib.read(step_dir, step, local.manager.backend)
    held.update({leaf.path: [s.index_list for s in leaf.shards]
                 for leaf in m.leaves if leaf.is_array})
    group.kv_set(f"{key}/digest/{me}", hashlib.sha256(
        json.dumps(held, sort_keys=True).encode()).hexdigest())
    return m

  m = agreed(meeting.under("held"), digest, f"reading local step {step}")
  if m is None:
    return None

  def writers() -> bool:  # The first survivor: the lowest of each kind.
    if me == first:
      lowest: dict[str, int] = {}
      for k, v in sorted(group.kv_dir(f"{key}/digest").items(),
                         key=lambda kv: int(kv[0].rsplit("/", 1)[1])):
        lowest.setdefault(v, int(k.rsplit("/", 1)[1]))
      group.kv_set(f"{key}/writers", json.dumps(sorted(lowest.values())))
    return True

  def share() -> list[int]:
    found = json.loads(group.kv_get(f"{key}/writers", timeout_ms=timeout_ms))
    if me in found:
      meetings.share_text(group, f"{key}/list/{me}", json.dumps(held))
    return found

  if agreed(meeting.under("writers"), writers, "choosing the writers") is None:
    return None
  if (listers := agreed(meeting.under("lists"), share,
                        "sharing the lists of shards")) is None:
    return None

  def plan() -> bool:  # The first survivor: who writes what, if all is held.
    if me != first:
      return True
    owner: dict[str, dict[tuple, int]] = {}
    for p in reversed(listers):  # The lowest holder wins.
      for path, indices in json.loads(meetings.fetch_text(
          group, f"{key}/list/{p}", timeout_ms)).items():
        for index in indices:
          owner.setdefault(path, {})[tuple(map(tuple, index))] = p
    missing = ""
    for leaf in m.leaves:
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
        meetings.share_text(group, f"{key}/mine/{p}", json.dumps(
            {path: [i for i, q in where.items() if q == p]
             for path, where in owner.items()}))
    group.kv_set(f"{key}/missing", json.dumps(missing))
    return True

  if agreed(meeting.under("plan"), plan, "assigning the shards") is None:
    return None
  missing = json.loads(group.kv_get(f"{key}/missing",
                                    timeout_ms=timeout_ms))
  if missing:
    log.warning("the survivors do not hold all of step %d (%s); the local"
                " tiers serve the restart", step, missing)
    return None
  mine: dict[str, set[tuple]] = {}
  if me in listers:
    mine = {path: {tuple(map(tuple, i)) for i in indices}
            for path, indices in json.loads(meetings.fetch_text(
                group, f"{key}/mine/{me}", timeout_ms)).items()}

  def read() -> tuple[list[LeafSnapshot], datastate.Encoded | None]:
    reader = ByteReader(step_dir, m.files, local.manager.backend)
    try:
      leaves = [_leaf_share(leaf, mine.get(leaf.path, set()), reader, m)
                for leaf in m.leaves]
    finally:
      reader.close()
    data = datastate.of_step(step_dir, m, local.manager.coordinator,
                             local.manager.backend)
    return leaves, None if data is None else datastate.encode(data)

  found = agreed(
      meeting.under("read"), read, f"reading the shards of local step {step}")
  return None if found is None else (found[0], m.extra, found[1])


def _leaf_share(leaf: manifest_lib.LeafRecord, mine: set[tuple],
                reader: ByteReader, m: manifest_lib.Manifest
                ) -> LeafSnapshot:
  shards = []
  if leaf.is_array:
    lr = LeafReader(reader=reader, leaf=leaf, where=f"local step {m.step}",
                    verify=True, block=m.checksum_block_bytes)
    shards = [ShardData(s.index, lr.read(s.index)) for s in leaf.shards
              if s.index in mine]
  return LeafSnapshot(
      leaf.path, list(leaf.keys), leaf.kind,
      None if leaf.dtype is None else str(leaf.dtype), leaf.shape, shards,
      value=leaf.value, key_impl=leaf.key_impl)
