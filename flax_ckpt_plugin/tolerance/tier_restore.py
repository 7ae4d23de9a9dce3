"""Restoring the newest step from the fastest tier that has it whole.

A checkpoint in the persistent tier (a shared file system or a bucket)
holds every byte once and is written by all processes together; each
process's local tier (`local_tier.LocalTier`) holds its own copy of its shards,
replicas included, on a per-host path.

At start, `restore_newest` has every process list what it holds; all then
try, in the same order, the newest step first: from every process's local
tier when all hold it, from peers (`peer`) when some lack it but the others
hold replicas of what they need, from the persistent tier. A try that is
damaged or missing anywhere falls through to the next, as in `fallback`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple, TYPE_CHECKING

from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.restore import fallback
from flax_ckpt_plugin.restore.options import RestoreOptions
from flax_ckpt_plugin.tolerance import peer
from flax_ckpt_plugin.tolerance import rebuild
from flax_ckpt_plugin.errors import RestoreFailedError
from flax_ckpt_plugin.logs import log

if TYPE_CHECKING:
  from flax_ckpt_plugin.manager.tier import TierManager
  from flax_ckpt_plugin.tolerance.local_tier import LocalTier

LOCAL, PEER, PERSISTENT = "local", "peer", "persistent"
TIERS = (LOCAL, PEER, PERSISTENT)


class Plan(NamedTuple):
  """What every process learned before restoring: who holds which steps."""
  local: dict[int, list[int]]  # Per process, its local steps.
  persistent: list[int]  # The primary's list of the persistent tier.

  def holders(self, step: int) -> list[int]:
    """The processes whose local tier holds `step`."""
    return sorted(p for p, steps in self.local.items() if step in steps)


def _inventory(meeting: meetings.Meeting, local: LocalTier | None,
               persistent: TierManager) -> Plan:
  """Every process publishes its local steps and reads everyone's; the
  persistent tier's primary lists its steps for all."""
  coord = meeting.coordinator
  key = meeting.key
  mine = local.manager.all_steps() if local is not None else []
  if coord.process_count == 1:
    return Plan({0: mine}, persistent.all_steps())

  def publish() -> None:
    coord.kv_set(keys.of_process(keys.child(key, "local"), coord.process_index),
                 json.dumps(mine))

  outcome = meetings.agree(meeting.under("listed"), publish)
  if outcome.error is not None:
    raise outcome.error
  if outcome.failures:  # All stop, rather than wait for a list never set.
    raise RestoreFailedError(
        "listing the steps of each tier failed on other processes:"
        f" {meetings.describe_failures(outcome.failures)}")
  local_steps = {p: json.loads(v) for p, v in keys.by_index(
      coord.kv_dir(keys.child(key, "local"))).items()}
  listed = meetings.decided_by_one(
      meeting.under("persistent"), persistent.all_steps,
      decides=persistent.is_primary, error=RestoreFailedError,
      what=f"listing the steps of {persistent.directory}")
  return Plan(local_steps, listed)


def candidates(plan: Plan, process_count: int, *, peers: bool
               ) -> list[tuple[int, str]]:
  """(step, tier) to try, best first: newer steps first, and for one step
  the local tier, then peers (if `peers` and some process holds it), then
  the persistent tier."""
  held = [set(plan.local.get(p, ())) for p in range(process_count)]
  steps = set(plan.persistent).union(*held)
  out = []
  for step in sorted(steps, reverse=True):
    holders = sum(step in h for h in held)
    if holders == process_count:
      out.append((step, LOCAL))
    elif holders and peers:
      out.append((step, PEER))
    if step in plan.persistent:
      out.append((step, PERSISTENT))
  return out


def restore_newest(meeting: meetings.Meeting, *, local: LocalTier | None,
                   persistent: TierManager,
                   restore: dict[str, Callable[[int, list[int]], Any]]
                   ) -> tuple[int, str, Any] | None:
  """Restores the newest step from the fastest tier that has it whole.

  Called on every process; see the module doc.

  Args:
    coord: the job's coordinator.
    key: a prefix of keys no earlier call used (same on every process).
    local: this process's local tier, or None.
    persistent: the persistent tier's manager.
    restore: per tier, restores a step on this process, given the
      processes whose local tier holds it; returns what it restored (the
      tree and the step's `extra`); a tier without an entry is not tried.
    timeout_ms: how long to wait for the others at each try.

  Returns:
    (step, tier, what `restore` returned), or None when no tier has a step.

  Raises:
    CheckpointCorruptedError: every step failed in every tier; names them.
    StructureMismatchError, RestoreFailedError: see `fallback`.
  """
  coord = meeting.coordinator
  plan = _inventory(meeting, local, persistent)
  tries = [c for c in candidates(plan, coord.process_count,
                                 peers=PEER in restore)
           if c[1] in restore]
  where = str(persistent.directory)
  if local is not None:
    where += f" and local tier {local.directory.parent.parent}"
  found, skipped = fallback.try_in_turn(
      meeting.under("tries"),
      tries,
      lambda c: restore[c[1]](c[0], plan.holders(c[0])),
      where=where,
      describe=lambda c: f"step {c[0]} from the {c[1]} tier")
  if found is None:
    return None
  (step, tier), tree = found
  for s, t in skipped:
    log.warning("skipped step %d of the %s tier", s, t)
  damaged = sorted({s for s, t in skipped if t == PERSISTENT})
  if damaged:
    persistent.set_aside(damaged)
  return step, tier, tree


def restore_into(state: Any, local: LocalTier,
                 persistent: TierManager, *,
                 data_iterator: datastate.DataIterator | None = None,
                 options: RestoreOptions = RestoreOptions(),
                 partners: bool = False) -> tuple[int, str, Any] | None:
  """`restore_newest` for a callback: (step, tier, (tree, extra)), or None.

  Called on every process, like `state`; see `restore_newest`. With a
  `data_iterator`, each process also restores its data state, and peers
  are not tried: a process that lacks the local step lacks its data state
  too (it was lost with its disk). Nor with `options.cast` (dtypes
  converted as `CheckpointManager.restore` does), which the peers'
  exchange of saved bytes does not make.
  """
  coord, timeout_ms = persistent.coordinator, persistent.barrier_timeout_ms
  key = keys.fresh(coord, keys.child(persistent.name, "tiers"))

  def from_manager(manager):
    return lambda step, _: (
        manager.restore_with(state, step, options, data_iterator),
        manager.metadata(step).extra)

  def from_peers(step, holders):
    if partners:  # From what they hold together, partner copies too.
      return rebuild.restore(
          meetings.Meeting(coord, keys.child(key, f"rebuild{step}"),
                           timeout_ms), step,
          holders, local.manager, state)[:2]
    return peer.restore(
        meetings.Meeting(coord, keys.child(key, f"peer{step}"), timeout_ms),
        step,
        holders, local, state)

  tiers = {
      LOCAL: from_manager(local.manager),
      PEER: from_peers,
      # Every process restores the persistent step together: storage
      # serves each byte once (`shared_read`).
      PERSISTENT: lambda step, _: (
          persistent.restore_together_with(state, step, options,
                                           data_iterator),
          persistent.metadata(step).extra)}
  if data_iterator is not None or options.cast:
    del tiers[PEER]
  return restore_newest(
      meetings.Meeting(coord, key, timeout_ms),
      local=local,
      persistent=persistent,
      restore=tiers)


def restore_for_callback(state: Any, local: LocalTier | None,
                         persistent: TierManager, *,
                         data_iterator: datastate.DataIterator | None,
                         options: RestoreOptions = RestoreOptions(),
                         partners: bool = False
                         ) -> tuple[int, str, Any] | None:
  """`CheckpointCallback.restore_or_initialize`'s restore: (step, tier,
  (tree, extra)) from the fastest tier that has the newest good step, or
  None; newer local steps are dropped. `options`: see
  `CheckpointManager.restore`; `partners`: see `restore_into`."""
  if local is None:
    found = persistent.restore_newest_valid_with(state, options,
                                                 data_iterator)
    return None if found is None else (found[0], PERSISTENT, (
        found[1], persistent.metadata(found[0]).extra))
  found = restore_into(state, local, persistent, data_iterator=data_iterator,
                       options=options, partners=partners)
  local.discard_newer(None if found is None else found[0])
  return found
