"""Restoring a local step from what the processes hold together, their own
shards and their partner copies (`exchange`), onto any target.

With FSDP or tensor parallelism across hosts, no process holds a replica of
a lost process's shards: its partners hold copies, in their local tiers,
of shards that their devices never held. After a loss (`elastic`: on the
survivors' devices, often on a smaller mesh) or a relaunch whose lost host
took its disk along (`tier_restore`'s "peer"), every process gets what its
target needs from them:

1. who has each region: for each shard of the step, the lowest process
   that holds it, own or partner copy (`shares.share_out`, which every
   process learns whole); none of it held: `CheckpointNotFoundError`;
2. each process reads the regions it has from its local tier (checksums
   verified) into *slots*: for each leaf, an array over the target's
   devices whose block on a device of that process holds them (a few
   regions per device, padded to the largest);
3. one jitted program per mesh puts the regions together, leaf by leaf, in
   the target's sharding: XLA moves the bytes (collectives over the
   target's devices; no socket of ours).

A leaf that a process restores on the host (numpy, PRNG keys, other
shardings) is put together replicated and placed from there. Memory: the
slots hold each region once over the devices of the process that has it,
and XLA's collectives may hold a leaf's whole value on each device while
they run (a recovery, not the train loop's steady state).

Every phase is agreed on by every process (`meetings.agree`), so that a
failure is known everywhere before anyone enters the collective.
"""

from __future__ import annotations

import functools
import time
from typing import Any, TYPE_CHECKING

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import jax.numpy as jnp
import numpy as np

from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.format.treepaths import extents
from flax_ckpt_plugin.format.treepaths import leaf_paths
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.restore import matching
from flax_ckpt_plugin.restore import placement
from flax_ckpt_plugin.tolerance import peer
from flax_ckpt_plugin.tolerance import shares as shares_lib

if TYPE_CHECKING:
  from flax_ckpt_plugin.manager.tier import TierManager

_AXIS = "slots"


def _region(index: Any) -> tuple[tuple[int, int], ...]:
  return tuple((int(a), int(b)) for a, b in index)


def restore(meeting: meetings.Meeting, step: int, holders: list[int],
            local: TierManager, target: Any, *,
            devices: list[Any] | None = None) -> tuple[Any, Any, Any]:
  """Restores local step `step` like `target` from what the processes
  hold, own shards and partner copies. Called on every process of the
  meeting, together; see the module doc.

  Args:
    holders: the processes whose local tier holds the step.
    local: this process's local tier's manager (`LocalTier.manager`).
    target: what to restore into, on the devices of the meeting's
      processes.
    devices: those devices, in order, for leaves placed from the host
      (default: every device).

  Returns:
    The tree, the step's `extra`, and this process's data state
    (`datastate.Encoded`, or None).

  Raises:
    CheckpointNotFoundError: the processes do not hold every shard of the
      step (the holders of one were all lost), or a phase failed.
    StructureMismatchError: the step does not fit the target.
  """
  where = f"local step {step} from processes {holders}"
  t0 = time.monotonic()
  found = shares_lib.share_out(meeting.under("shares"), local, step,
                               holders=holders, everyone=True)
  if found is None:
    raise CheckpointNotFoundError(
        f"{where}: the processes do not hold every shard of it (their own"
        " and their partner copies)")
  me = meeting.coordinator.process_index
  t1 = time.monotonic()
  prepared = peer.agree_all(meeting.under("slots"), lambda: _prepare(
      found, target, me, devices or jax.devices(), where), where)
  t2 = time.monotonic()
  tree = jax.block_until_ready(_run(*prepared))
  log.info("rebuilt %s in %.2fs: who has what %.2fs, slots and programs"
           " %.2fs, the programs %.2fs", where, time.monotonic() - t0,
           t1 - t0, t2 - t1, time.monotonic() - t2)
  return tree, found.manifest.extra, found.data


def _prepare(found: shares_lib.Shares, target: Any, me: int,
             devices: list[Any], where: str) -> tuple:
  """Checks the target, fills this process's slots and compiles the
  programs, so that anything that can fail here fails before any process
  enters a collective. Returns the arguments of `_run`."""
  saved = found.manifest
  records = saved.leaf_by_path
  targets, treedef = leaf_paths(target)
  matching.match_structure(records, [(p, t) for p, _, t in targets], where)
  mine = {leaf.path: {_region(s.index): s.data for s in leaf.shards}
          for leaf in found.leaves}
  host_mesh = Mesh(np.array(devices), (_AXIS,))
  plans, programs = [], {}
  for path, _, t in targets:
    leaf = records[path]
    t = placement.on_context_mesh(path, t)
    if leaf.is_scalar or not leaf.nbytes:
      plans.append(("here", leaf, t))
      continue
    sharding = getattr(t, "sharding", None)
    on_host = not (isinstance(t, (jax.Array, jax.ShapeDtypeStruct))
                   and isinstance(sharding, NamedSharding)
                   and leaf.key_impl is None)
    mesh = host_mesh if on_host else sharding.mesh
    out = NamedSharding(mesh, PartitionSpec()) if on_host else sharding
    slots, layout = _slots(path, leaf, found.owner.get(path, {}),
                           mine.get(path, {}), list(mesh.devices.flat), me)
    group = programs.setdefault(id(mesh), (mesh, []))
    group[1].append((len(plans), slots, layout, out))
    plans.append(("host" if on_host else "array", leaf, t))
  compiled = []
  for mesh, leaves in programs.values():
    fn = jax.jit(functools.partial(_put_together,
                                   layouts=tuple(l for _, _, l, _ in leaves)),
                 out_shardings=tuple(o for *_, o in leaves))
    inputs = tuple(s for _, s, _, _ in leaves)
    compiled.append(([i for i, *_ in leaves], fn.lower(inputs).compile(),
                     inputs))
  return treedef, plans, compiled


def _slots(path: str, leaf: manifest_lib.LeafRecord,
           owner: dict[tuple, int], mine: dict[tuple, Any],
           devices: list[Any], me: int) -> tuple[jax.Array, tuple]:
  """This process's part of the slots of one leaf over `devices`, and the
  layout every process works out alike: (shape, grid starts per axis,
  per region its (start, slot, extents))."""
  regions = sorted(owner)
  by_process: dict[int, list[int]] = {}
  for at, d in enumerate(devices):
    by_process.setdefault(d.process_index, []).append(at)
  count = [0] * len(devices)
  where = []
  for region in regions:
    places = by_process.get(owner[region])
    if not places:
      raise CheckpointNotFoundError(
          f"leaf {path!r}: process {owner[region]}, which has region"
          f" {[list(r) for r in region]}, has no device among the target's")
    at = min(places, key=lambda a: (count[a], a))
    where.append((region, at, count[at]))
    count[at] += 1
  per = max(count)
  biggest = tuple(max(hi - lo for lo, hi in (r[axis] for r in regions))
                  for axis in range(len(leaf.shape)))
  blocks = {}
  for region, at, j in where:
    if devices[at].process_index != me:
      continue
    block = blocks.setdefault(at, np.zeros((per,) + biggest, leaf.dtype))
    value = np.asarray(mine[region]).reshape(extents(region))
    block[(j,) + tuple(slice(0, e) for e in value.shape)] = value
  sharding = NamedSharding(Mesh(np.array(devices), (_AXIS,)),
                           PartitionSpec(_AXIS))
  local = [(at, d) for at, d in enumerate(devices) if d.process_index == me]
  slots = jax.make_array_from_single_device_arrays(
      (len(devices) * per,) + biggest, sharding,
      [jax.device_put(blocks.get(at, np.zeros((per,) + biggest,
                                              leaf.dtype)), d)
       for at, d in local])
  starts = tuple(tuple(sorted({r[axis][0] for r in regions}))
                 for axis in range(len(leaf.shape)))
  layout = (tuple(leaf.shape), starts, tuple(
      (tuple(lo for lo, _ in region), at * per + j, extents(region))
      for region, at, j in where))
  return slots, layout


def _put_together(inputs: tuple[jax.Array, ...], layouts: tuple
                  ) -> tuple[jax.Array, ...]:
  """Every leaf from its slots: where the grid's cells are all alike, its
  slots taken in grid order and their axes interleaved (a gather and a
  transpose); else its regions cut out of their slots and joined along
  the grid, axis by axis."""
  out = []
  for slots, (shape, starts, regions) in zip(inputs, layouts):
    ndim = len(shape)
    grid = tuple(len(s) for s in starts)
    exts = {ext for _, _, ext in regions}
    if len(exts) == 1 and slots.shape[1:] == next(iter(exts)):
      ext = next(iter(exts))
      order = {start: slot for start, slot, _ in regions}
      cells = np.array([order[tuple(starts[a][i[a]] for a in range(ndim))]
                        for i in np.ndindex(*grid)], np.int32)
      x = jnp.take(slots, cells, axis=0).reshape(grid + ext)
      x = x.transpose([a for axis in range(ndim) for a in (axis, ndim + axis)])
      out.append(x.reshape(shape))
      continue
    piece = {start: slots[slot][tuple(slice(0, e) for e in ext)]
             for start, slot, ext in regions}

    def joined(axis: int, fixed: tuple[int, ...]) -> jax.Array:
      if axis == ndim:
        return piece[fixed]
      return jnp.concatenate([joined(axis + 1, fixed + (s,))
                              for s in starts[axis]], axis=axis)

    out.append(joined(0, ()))
  return tuple(out)


def _run(treedef: Any, plans: list[tuple], compiled: list[tuple]) -> Any:
  """The collective part: every process, the same programs."""
  results: dict[int, jax.Array] = {}
  for at, program, inputs in compiled:
    results.update(zip(at, program(inputs)))
  leaves = []
  for i, (kind, leaf, t) in enumerate(plans):
    if kind == "here":
      value = (np.zeros(leaf.shape, leaf.dtype) if not leaf.is_scalar
               else None)
      leaves.append(placement.restore_leaf(leaf, t, None) if value is None
                    else placement.from_host(leaf, t, value))
    elif kind == "host":
      leaves.append(placement.from_host(
          leaf, t, np.asarray(results[i].addressable_data(0))))
    else:
      leaves.append(results[i])
  return jax.tree_util.tree_unflatten(treedef, leaves)
