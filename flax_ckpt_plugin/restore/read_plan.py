"""Who reads what in a restore made together (`shared_read`): the plan.

Computed by every process alone, from the target's shardings and the
manifest, so that every process takes the same plan without a word:

* `split`: a leaf whose regions several processes need is cut into one row
  range per process (as a save cuts it), and each range into one slot per
  device of the process; a small region goes whole to the least loaded
  process (see `Split`);
* `batches`: the shared leaves in runs of about `BATCH_BYTES`, one program
  each, so that one batch is shared while the next is read;
* `pack`: a batch's small leaves replicated on every device travel in one
  slot per device and one collective (see `Pack`).

No I/O and no collective here.
"""

from __future__ import annotations

import functools
import heapq
import math
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from flax_ckpt_plugin.restore import replicas as replicas_lib
from flax_ckpt_plugin.arrays import division
from flax_ckpt_plugin.arrays.copies import bits_dtype
from flax_ckpt_plugin.format.treepaths import Index
from flax_ckpt_plugin.format.treepaths import normalize_index


# Smaller regions are read by every process that needs them: reading them
# costs storage little.
MIN_SHARED_BYTES = 4 << 10
# Shared leaves go in batches of about this many bytes, one program each:
# a batch is shared while the next is read. A collective costs about 20 ms
# here whatever its size, so batches are not smaller.
BATCH_BYTES = 16 << 20


class Split(NamedTuple):
  """How one replicated leaf is read and spread: each device holding a
  region contributes a slot of `rows` rows of it (its share of its
  process's range, padded with zeros), and the program gathers the slots
  along the replica axes and takes the region's rows back in order
  (`index`: each row's position in the slots laid end to end)."""
  stacked: NamedSharding  # Of the slots the devices contribute...
  shape: tuple[int, ...]  # ...whose global shape is this.
  # Per device that contributes rows (for a cut region, every device
  # holding it): (its region, the rows of it it reads, maybe none).
  parts: dict[Any, tuple[Index, Index]]
  rows: int  # Rows per slot.
  index: np.ndarray


def split(target: Any, load: dict[int, int] | None = None,
          memo: dict[Any, Any] | None = None) -> Split | None:
  """The plan of a target leaf whose regions several processes need (an
  array of 8 to 64-bit numbers or booleans, in regions of equal rows of
  `MIN_SHARED_BYTES` or more), else None.

  A region of `division.SPLIT_BYTES` or more is cut into one row range
  per process that needs it, as a save cuts it (so each reads what one
  piece of the save holds, and no checksum block twice), and each range
  into one slot per device of the process holding the region. A smaller
  region (which the save wrote whole) is read whole by the process that
  has read the fewest bytes of such regions so far (the larger ones are
  cut evenly over their holders, and not counted), into the slots of its
  least loaded devices at one replica position (`load`: bytes per
  process, and per device under ("device", id), shared by the leaves of
  one restore in order, so the same on every process).

  `memo`, shared by the leaves of one restore too, keeps what the plans of
  leaves of one sharding, shape and dtype share (`_Static`), so that the
  devices of the mesh are looked at once per kind of leaf, not per leaf.
  """
  load = {} if load is None else load
  if not isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
    return None
  sharding, shape, dtype = getattr(target, "sharding", None), tuple(
      target.shape), target.dtype
  if (not isinstance(sharding, NamedSharding) or not shape
      or jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)
      or (dtype != np.bool_ and bits_dtype(dtype) is None)):
    return None
  key = (sharding, shape, np.dtype(dtype))
  if memo is None or key not in memo:
    static = _static(*key)
    if memo is not None:
      memo[key] = static
  else:
    static = memo[key]
  return None if static is None else _planned(static, load)


def _planned(static: _Static, load: dict[Any, int]) -> Split | None:
  """The plan of a leaf of `static`'s kind, and its reads added to `load`.
  """
  if static.nbytes >= division.SPLIT_BYTES:
    decision = None  # Cut over the processes: the same for every leaf.
  else:  # Whole, by the least loaded process, at its least loaded place.
    if not static.holders:
      return None
    heap = static.heap
    if not heap:  # (A process's load only grows: stale entries are fixed
      heap += sorted((load.get(p, 0), p) for p in static.holders)
    while heap[0][0] != load.get(heap[0][1], 0):  # when they come up.)
      heapq.heapreplace(heap, (load.get(heap[0][1], 0), heap[0][1]))
    whole = heap[0][1]
    chosen = min(static.common[whole], key=lambda q: (sum(
        load.get(("device", static.at[(r, q)].id), 0)
        for r in static.regions), q))
    decision = (whole, chosen)
  made = static.plans.get(decision)
  if made is None:
    made = static.plans[decision] = _gathered(static, decision)
  plan, reads = made
  if plan is not None:  # The plan is taken: count its reads.
    for key, n in reads:
      load[key] = load.get(key, 0) + n
  return plan


class _Static(NamedTuple):
  """What the plans of every leaf of one sharding, shape and dtype share:
  worked out once per restore's distinct (sharding, shape, dtype), so that
  planning costs each leaf a look-up (and a small leaf the choice of its
  reader, over the processes), not a pass over the mesh's devices."""
  shape: tuple[int, ...]
  dtype: np.dtype
  by_region: dict[Index, list[Any]]  # Region: the devices that hold it.
  regions: list[Index]  # Sorted.
  position: dict[Any, int]  # Device: its place along the replica axes.
  length: int  # Rows per region.
  nbytes: int  # Bytes per region.
  stacked: NamedSharding
  replicas: int
  holders: set[int]  # Processes that hold every region.
  heap: list[tuple[int, int]]  # (load, process) of the holders.
  common: dict[int, set[int]]  # Such a process: places it holds them all.
  at: dict[tuple[Index, int], Any]  # (region, place): a device there.
  plans: dict[Any, tuple[Split | None, list[tuple[Any, int]]]]


def _static(sharding: NamedSharding, shape: tuple[int, ...], dtype: np.dtype
            ) -> _Static | None:
  """None: no region needed by two processes (each reads its own), regions
  under `MIN_SHARED_BYTES`, or of unequal rows."""
  by_region: dict[Index, list[Any]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    by_region.setdefault(normalize_index(index, shape), []).append(device)
  if all(len({d.process_index for d in ds}) < 2
         for ds in by_region.values()):
    return None
  spare, stacked, replicas = replicas_lib.replica_axes(sharding, len(shape))
  return _analyzed(by_region, sharding.mesh, tuple(spare), shape, dtype,
                   stacked, replicas)


def _analyzed(by_region: dict[Index, list[Any]], mesh: Any,
              spare: tuple[str, ...], shape: tuple[int, ...], dtype: np.dtype,
              stacked: Any, replicas: int) -> _Static | None:
  position = _positions(mesh, spare)
  regions = sorted(by_region)
  lengths = {hi - lo for (lo, hi), *_ in regions}
  nbytes = math.prod(hi - lo for lo, hi in regions[0]) * dtype.itemsize
  if len(lengths) != 1 or nbytes < MIN_SHARED_BYTES:
    return None
  holders: set[int] = set()
  common: dict[int, set[int]] = {}
  at: dict[tuple[Index, int], Any] = {}
  if nbytes < division.SPLIT_BYTES:
    # Per process, per region: the places of its devices holding it.
    places: dict[int, dict[Index, set[int]]] = {}
    for r in regions:
      for d in by_region[r]:
        places.setdefault(d.process_index, {}).setdefault(r, set()).add(
            position[d])
        at[(r, position[d])] = d
    # Those that hold every region, at some place where they hold them all
    # (or the slot layouts would differ).
    common = {p: set.intersection(*held.values())
              for p, held in places.items() if len(held) == len(regions)}
    common = {p: c for p, c in common.items() if c}
    holders = set(common)
  return _Static(shape, dtype, by_region, regions, position, lengths.pop(),
                 nbytes, stacked, replicas, holders, [], common, at, {})


@functools.lru_cache(maxsize=64)
def _positions(mesh: Any, spare: tuple[str, ...]) -> dict[Any, int]:
  """Device: its index along the replica (`spare`) axes of `mesh`."""
  spare_axes = [mesh.axis_names.index(a) for a in spare]
  position = {}
  for coords, device in np.ndenumerate(mesh.devices):
    position[device] = int(np.ravel_multi_index(
        [coords[a] for a in spare_axes],
        [mesh.devices.shape[a] for a in spare_axes])) if spare_axes else 0
  return position


def _gathered(static: _Static, decision: tuple[int, int] | None
              ) -> tuple[Split | None, list[tuple[Any, int]]]:
  """The plan (see `Split`) and the reads it adds to the load (per process,
  and per device under ("device", id)), or (None, []): regions cut in
  different places. `decision`: None to cut every region over the
  processes holding it, or (the process that reads every region whole,
  the replica place of the devices it reads into)."""
  position, regions = static.position, static.regions
  length, nbytes = static.length, static.nbytes
  shape, dtype = static.shape, static.dtype
  carried = (dtype.itemsize // carrier(dtype).itemsize,)
  if decision is not None:
    # Every region whole into its device at the chosen place, the other
    # devices' slots empty: looked at region by region, not device by
    # device (`parts` names only the devices that read).
    whole, place = decision
    index = place * length + np.arange(length, dtype=np.int32)
    index.setflags(write=False)
    readers = [static.at[(r, place)] for r in regions]
    return Split(static.stacked, (static.replicas, shape[0]) + shape[1:]
                 + carried, {d: (r, r) for d, r in zip(readers, regions)},
                 length, index), [(whole, nbytes * len(regions))] + [
                     (("device", d.id), nbytes) for d in readers]
  # Device: the rows of its region it contributes (none if the region has
  # fewer rows than processes holding it).
  slots: dict[Any, tuple[int, int]] = {d: (0, 0) for d in position}
  layouts = set()
  for region in regions:
    by_proc: dict[int, list[Any]] = {}  # In place order.
    for d in sorted(static.by_region[region], key=position.get):
      by_proc.setdefault(d.process_index, []).append(d)
    procs = sorted(by_proc)
    layout = [None] * static.replicas
    for proc, (a, b) in zip(procs, division.cuts(
        length, min(len(procs), length))):
      mine = by_proc[proc]
      for d, (c, e) in zip(mine, division.cuts(b - a, len(mine))):
        slots[d] = (a + c, a + e)
        layout[position[d]] = (a + c, a + e)
    layouts.add(tuple(layout))
  if len(layouts) != 1:
    return None, []
  layout = layouts.pop()
  rows = max(1, max((hi - lo for lo, hi in filter(None, layout)), default=1))
  index = np.empty(length, np.int32)
  for slot, cut in enumerate(layout):
    if cut is not None:
      index[cut[0]:cut[1]] = slot * rows + np.arange(cut[1] - cut[0])
  index.setflags(write=False)  # Shared by every leaf of this plan.
  parts = {}
  for region in regions:
    for d in static.by_region[region]:
      lo, hi = slots[d]
      parts[d] = (region, ((region[0][0] + lo, region[0][0] + hi),)
                  + region[1:])
  # No reads counted: each holder reads an equal share (to a row).
  return Split(static.stacked, (static.replicas, shape[0] // length * rows)
               + shape[1:] + carried, parts, rows, index), []


def carrier(dtype: Any) -> np.dtype:
  """What a shared leaf's slots hold: its own dtype (a gather only copies,
  and the program's output is then the gathered array itself; slots of
  bytes would cost every device a second copy, converting), bytes for
  booleans."""
  dtype = np.dtype(dtype)
  return np.dtype(np.uint8) if dtype == np.bool_ else dtype


def worth_it(target: Any) -> bool:
  """Whether some region of `target` is needed by several processes.

  Depends on the target alone (its shardings are the same on every
  process), so every process decides the same.
  """
  load: dict[Any, int] = {}
  memo: dict[Any, Any] = {}
  return jax.process_count() > 1 and any(
      split(t, load, memo) is not None for t in jax.tree.leaves(target))


def batches(leaves: list) -> list[list[int]]:
  """The shared leaves (their positions) in runs of about `BATCH_BYTES`,
  in order: one program each, so that sharing one runs while the next is
  read. The same on every process."""
  batches, size = [[]], 0
  for i, (leaf, _, plan) in enumerate(leaves):
    if plan is None:
      continue
    if size >= BATCH_BYTES:
      batches.append([])
      size = 0
    batches[-1].append(i)
    size += leaf.nbytes
  return batches if batches[0] else []


class Pack(NamedTuple):
  """The small replicated leaves of a batch, packed so that one collective
  shares them all. Each device of the mesh contributes one slot of
  `length` bytes: the leaves it read, end to end (`pieces`: per leaf
  position, (slot, offset, bytes, device, first row, end row) of each
  piece, in row order). The program gathers the slots on every device;
  each process then cuts the leaves out on the host and puts them on its
  devices (`shared_read`). A program that cut them out itself took XLA about
  13 ms per leaf to compile (8 devices), longer than the reads."""
  sharding: NamedSharding  # [slots, length], a slot per device of the mesh.
  everywhere: NamedSharding  # The same, on every device.
  devices: list[Any]  # Slot k is devices[k]'s.
  length: int
  pieces: dict[int, list[tuple[int, int, int, Any, int, int]]]


def pack(leaves: list, batch: list[int]) -> Pack | None:
  """The pack of a batch's leaves under `division.SPLIT_BYTES` that are
  replicated on every device of one mesh (the mesh of the first such
  leaf), or None when fewer than two such leaves are on that mesh. Their
  slots pack into one array; a larger leaf, or one sharded over some axis
  or on another mesh, keeps its own."""
  def replicated(i):
    leaf, t, _ = leaves[i]
    return (leaf.nbytes < division.SPLIT_BYTES
            and all(e is None for e in t.sharding.spec))
  chosen = [i for i in batch if replicated(i)]
  if len(chosen) < 2:
    return None
  mesh = leaves[chosen[0]][1].sharding.mesh
  chosen = [i for i in chosen if leaves[i][1].sharding.mesh == mesh]
  if len(chosen) < 2:
    return None
  devices = list(mesh.devices.flat)
  slot = {d: k for k, d in enumerate(devices)}
  fill = [0] * len(devices)
  pieces = {}
  for i in chosen:
    leaf, _, plan = leaves[i]
    row = leaf.nbytes // leaf.shape[0]
    mine = []
    for d, (_, rows) in sorted(plan.parts.items(),
                               key=lambda kv: kv[1][1][0]):
      lo, hi = rows[0]
      if hi > lo:
        k = slot[d]
        mine.append((k, fill[k], (hi - lo) * row, d, lo, hi))
        fill[k] += (hi - lo) * row
    pieces[i] = mine
  return Pack(NamedSharding(mesh, PartitionSpec(mesh.axis_names, None)),
               NamedSharding(mesh, PartitionSpec()), devices,
               max(1, max(fill)), pieces)
