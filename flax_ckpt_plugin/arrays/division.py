"""Who writes which bytes of a save: every byte once, spread over processes.

A shard that several processes hold (a replicated array in data
parallelism; the replicas of HSDP) needs writing once. Leaving it to the
process of replica 0 puts a replicated state on process 0 alone: at 64
hosts a save takes as long as one host's link needs for the whole state
while the other links idle. The plan here spreads those bytes among the
processes that hold them (a shard's holders):

* a shard under `SPLIT_BYTES`, or one that cannot be split evenly, is
  written whole by the holder that has the fewest bytes so far among its
  holders;
* a larger one is cut along its first axis into contiguous row ranges,
  one per holder (at most), dealt out in turn from where the last cut of
  the same holders stopped.

Every process computes the same plan alone, from the shardings (their
devices and their order are the same on every process for a global
array): no communication. And each process looks only at the shards it
holds: what a set of holders writes depends on the shards they hold
alone, which every one of them sees in the same order. So a process's
plan costs O(its shards) per array, not O(the job's devices): at 4,096
processes of 8 devices and 100,000 leaves, 0.6 s of CPU (see
docs/control_plane.md, *The write plan at 100,000 leaves*). How a
sharding cuts arrays of one rank is worked out once per (sharding, rank)
from JAX's own indices of one array (`_grid`); an array whose dimensions
its cuts do not divide falls back to that array's indices.

The cuts of one array are the same in each of its shards, so the pieces
of an array still tile it as a grid (what `manifest.check_grid` and every
reader accept): a piece is one more shard entry of the manifest, with its
own index range, and the format does not change. Computed once per list
of (sharding, shape, dtype) and cached, so a save of the same tree pays a
dictionary lookup.
"""

from __future__ import annotations

import bisect
import collections
import functools
import heapq
import math
import threading
from typing import Any, NamedTuple

import numpy as np

from flax_ckpt_plugin.format.treepaths import Index
from flax_ckpt_plugin.format.treepaths import shard_plan

# Shards at least this large are cut among their holders; smaller ones are
# written whole (a piece costs a slice on the device and a manifest entry).
SPLIT_BYTES = 1 << 20


class Piece(NamedTuple):
  """A part of an array that this process writes.

  Attributes:
    index: the part's region of the global array.
    device: this process's device holding the shard it comes from.
    rows: [start, stop) along the first axis of that shard; None: all of it.
  """
  index: Index
  device: Any
  rows: tuple[int, int] | None


def cut(rows: int, parts: int, j: int) -> tuple[int, int]:
  """The `j`th of `cuts(rows, parts)`."""
  return rows * j // parts, rows * (j + 1) // parts


def cuts(rows: int, parts: int) -> list[tuple[int, int]]:
  """`rows` cut into `parts` contiguous ranges whose sizes differ by <= 1."""
  return [cut(rows, parts, j) for j in range(parts)]


def _volume(index: Index) -> int:
  return math.prod(stop - start for start, stop in index)


class Holders:
  """The processes that hold a shard (ascending), as one object per set:
  a process's plan keys its balancing by it, and a tuple of thousands of
  processes would be hashed at every shard. `rank`: where the planning
  process is among them."""
  __slots__ = ("procs", "rank")

  def __init__(self, procs: tuple[int, ...], process: int):
    self.procs = procs
    self.rank = bisect.bisect_left(procs, process)


_HOLDERS: dict[tuple[tuple[int, ...], int], Holders] = {}


_HOLDERS_LOCK = threading.Lock()


def _holders(procs: tuple[int, ...], process: int) -> Holders:
  """The one `Holders` of `procs` (seen by `process`): every shard with
  these holders shares their balancing, whichever array it is of."""
  with _HOLDERS_LOCK:
    found = _HOLDERS.get((procs, process))
    if found is None:
      found = _HOLDERS[(procs, process)] = Holders(procs, process)
    return found


class _GridShard(NamedTuple):
  """A shard of a sharding's grid that one process holds.

  Attributes:
    coords: the shard's coordinates in the grid.
    holders: the processes holding it.
    device: this process's first device holding it, in the sharding's
      device order.
  """
  coords: tuple[int, ...]
  holders: Holders
  device: Any


class _Grid(NamedTuple):
  """How a sharding cuts every array of one rank, seen from one process.

  Attributes:
    tiles: the number of shards along each dimension.
    mine: the shards this process holds, by their coordinates (in order).
    least_holders: the fewest processes holding any one shard.
  """
  tiles: tuple[int, ...]
  mine: tuple[_GridShard, ...]
  least_holders: int


@functools.lru_cache(maxsize=256)
def _grid(sharding: Any, ndim: int, process: int) -> _Grid | None:
  """`sharding`'s grid for arrays of rank `ndim`, or None where JAX's
  indices are not a regular grid. Read from the indices JAX gives an array
  each of whose dimensions is the sharding's device count (which any count
  of shards along a dimension divides): one pass over the devices, once
  per sharding and rank, in numpy (32,768 devices: about 0.1 s)."""
  size = len(sharding.device_set)
  try:
    indices = sharding.devices_indices_map((size,) * ndim)
  except (AssertionError, IndexError, TypeError, ValueError):
    return None  # A sharding that takes some shapes only (pmap's, say).
  devices = list(indices)
  procs = np.fromiter((d.process_index for d in devices), np.int64,
                      len(devices))
  # Per device and dimension: start, stop and step of its slice.
  bounds = np.fromiter(
      (v for index in indices.values() for sl in index
       for v in sl.indices(size)), np.int64, len(devices) * ndim * 3
  ).reshape(len(devices), ndim, 3)
  starts, stops = bounds[:, :, 0], bounds[:, :, 1]
  tiles = tuple(len(np.unique(starts[:, dim])) for dim in range(ndim))
  if any(size % t for t in tiles) or (bounds[:, :, 2] != 1).any():
    return None
  steps = size // np.array(tiles, np.int64)
  if (starts % steps).any() or (stops - starts != steps).any():
    return None
  coords = starts // steps
  keys = (np.ravel_multi_index(tuple(coords.T), tiles) if ndim
          else np.zeros(len(devices), np.int64))
  # The distinct (shard, process) pairs, by shard then process.
  base = int(procs.max()) + 1
  pairs = np.unique(keys * base + procs)
  counts = np.bincount(pairs // base, minlength=math.prod(tiles))
  if not counts.all():
    return None
  first = np.concatenate([[0], np.cumsum(counts)])
  holder_procs = pairs % base
  mine: dict[int, int] = {}  # Shard: this process's first device's place.
  for at in np.nonzero(procs == process)[0].tolist():
    mine.setdefault(int(keys[at]), at)
  return _Grid(tiles, tuple(
      _GridShard(
          tuple(coords[at].tolist()),
          _holders(tuple(holder_procs[first[key]:first[key + 1]].tolist()),
                   process), devices[at])
      for key, at in sorted(mine.items())), int(counts.min()))


class _SharedShard(NamedTuple):
  """A shard of an array that this process holds with other processes.

  Attributes:
    index: the shard's region of the global array.
    holders: the processes holding it.
    device: this process's device holding it.
    nbytes: the shard's bytes.
  """
  index: Index
  holders: Holders
  device: Any
  nbytes: int


class _Held(NamedTuple):
  """The shards of one array that this process holds, worked out once per
  (sharding, shape, dtype).

  Attributes:
    own: those it alone holds, as the pieces it writes.
    shared: those other processes hold too.
    parts: into how many row ranges each of the array's shards is cut (1:
      none).
    ranges: the row ranges' pieces made so far, by (the shard's number in
      `shared`, the range's).
  """
  own: tuple[Piece, ...]
  shared: tuple[_SharedShard, ...]
  parts: int
  ranges: dict[tuple[int, int], Piece]


@functools.lru_cache(maxsize=4096)
def _held(sharding: Any, shape: tuple[int, ...], itemsize: int,
          process: int, split_bytes: int) -> _Held:
  grid = _grid(sharding, len(shape), process)
  if grid is not None and all(
      size >= t and size % t == 0 for size, t in zip(shape, grid.tiles)):
    sizes = [size // t for size, t in zip(shape, grid.tiles)]
    shards = [(tuple((c * n, (c + 1) * n) for c, n in zip(s.coords, sizes)),
               s.holders, s.device) for s in grid.mine]
    least, volume = grid.least_holders, math.prod(sizes)
    rows = sizes[0] if shape else 0
  else:  # From this array's own indices: every device, once per shape.
    by_index: dict[Index, list[Any]] = collections.defaultdict(list)
    for device, (index, _) in shard_plan(sharding, shape).items():
      by_index[index].append(device)
    procs = {index: tuple(sorted({d.process_index for d in devices}))
             for index, devices in by_index.items()}
    shards = [(index, _holders(procs[index], process),
               next(d for d in by_index[index] if d.process_index == process))
              for index in sorted(by_index) if process in procs[index]]
    least = min(len(p) for p in procs.values())
    volume = min(_volume(index) for index in by_index)
    rows = min(index[0][1] - index[0][0] for index in by_index) if shape else 0
  parts = 1
  if shape and least > 1 and volume * itemsize >= split_bytes:
    parts = max(1, min(least, rows))
  return _Held(
      tuple(Piece(index, device, None) for index, holders, device in shards
            if len(holders.procs) == 1),
      tuple(_SharedShard(index, holders, device, _volume(index) * itemsize)
            for index, holders, device in shards if len(holders.procs) > 1),
      parts, {})


def _first_loads(procs: tuple[int, ...]) -> list[tuple[int, int, int]]:
  """A heap of (bytes, order of ties, process) for the holders `procs`:
  ties go round from a place that the set itself picks, the same on every
  holder, so that holder sets sharing a process do not all give it their
  first shard (3 processes in pairs {0, 1}, {0, 2}, {1, 2} write one shard
  each of an array, where ties to the lowest would give 2, 1 and 0). Over
  many arrays each set shares its bytes evenly whatever the order."""
  first = sum(procs) % len(procs)
  return sorted((0, (k - first) % len(procs), p) for k, p in enumerate(procs))


@functools.lru_cache(maxsize=64)
def plan(arrays: tuple[tuple[Any, tuple[int, ...], np.dtype], ...],
         process: int, process_count: int,
         split_bytes: int = SPLIT_BYTES) -> tuple[tuple[Piece, ...], ...]:
  """The pieces `process` writes of each array.

  Args:
    arrays: per global array of the state, in flattening order: its
      sharding, shape and dtype.
    process: the process whose pieces are returned.
    process_count: the job's process count.
    split_bytes: shards at least this large are cut among their holders.

  Returns:
    Per array, the pieces this process writes (none for most arrays of a
    process that holds nothing of them).
  """
  del process_count  # (Each set of holders is balanced on its own.)
  # Per set of holders: a heap of (bytes written whole, order of ties,
  # process), and where the next shard's cuts start dealing among them.
  loads: dict[Holders, list[tuple[int, int, int]]] = {}
  turn: dict[Holders, int] = collections.defaultdict(int)
  out = []
  for sharding, shape, dtype in arrays:
    held = _held(sharding, tuple(shape), np.dtype(dtype).itemsize, process,
                 split_bytes)
    if not held.shared:
      out.append(held.own)
      continue
    mine = list(held.own)
    parts = held.parts
    for k, shard in enumerate(held.shared):
      holders = shard.holders
      if parts > 1:  # Cut: dealt out in turn among its holders.
        count = len(holders.procs)
        first = turn[holders]
        turn[holders] = (first + parts) % count
        j = (holders.rank - first) % count
        if j < parts:
          piece = held.ranges.get((k, j))
          if piece is None:
            start, stop = shard.index[0]
            rows = cut(stop - start, parts, j)
            piece = held.ranges[(k, j)] = Piece(
                ((start + rows[0], start + rows[1]),) + shard.index[1:],
                shard.device, rows)
          mine.append(piece)
        continue
      heap = loads.get(holders)
      if heap is None:
        heap = loads[holders] = _first_loads(holders.procs)
      load, order, writer = heapq.heappop(heap)
      heapq.heappush(heap, (load + shard.nbytes, order, writer))
      if writer == process:
        mine.append(Piece(shard.index, shard.device, None))
    out.append(tuple(mine))
  return tuple(out)
