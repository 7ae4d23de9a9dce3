"""Who writes which bytes of a save: every byte once, spread over processes.

A shard that several processes hold (a replicated array in data
parallelism; the replicas of HSDP) needs writing once. Leaving it to the
process of replica 0 puts a replicated state on process 0 alone: at 64
hosts a save takes as long as one host's link needs for the whole state
while the other links idle. The plan here spreads those bytes:

* a shard under `SPLIT_BYTES`, or one that cannot be split evenly, is
  written whole by the holder with the fewest bytes so far;
* a larger one is cut along its first axis into contiguous row ranges,
  one per holder (at most), given to the least loaded holders first.

Every process computes the same plan alone, from the shardings (their
devices and their order are the same on every process for a global
array): no communication. The cuts of one array are the same in each of
its shards, so the pieces of an array still tile it as a grid (what
`manifest.check_grid` and every reader accept): a piece is one more shard
entry of the manifest, with its own index range, and the format does not
change. Computed once per list of (sharding, shape, dtype) and cached, so
a save of the same tree pays a dictionary lookup.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, NamedTuple, Sequence

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


def cuts(rows: int, parts: int) -> list[tuple[int, int]]:
  """`rows` cut into `parts` contiguous ranges whose sizes differ by <= 1."""
  bounds = [rows * j // parts for j in range(parts + 1)]
  return list(zip(bounds[:-1], bounds[1:]))


def _volume(index: Index) -> int:
  return math.prod(stop - start for start, stop in index)


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
  load = [0] * process_count
  out = []
  for sharding, shape, dtype in arrays:
    itemsize = np.dtype(dtype).itemsize
    holders: dict[Index, list[Any]] = collections.defaultdict(list)
    for device, (index, _) in shard_plan(sharding, shape).items():
      holders[index].append(device)
    procs = {index: sorted({d.process_index for d in devices})
             for index, devices in holders.items()}
    parts = min(len(p) for p in procs.values())
    if shape and parts > 1:
      parts = min(parts, min(index[0][1] - index[0][0] for index in holders))
      if min(_volume(index) for index in holders) * itemsize < split_bytes:
        parts = 1
    else:
      parts = 1
    mine = []
    for index in sorted(holders):
      by_load = sorted(procs[index], key=lambda p: (load[p], p))
      start = index[0][0] if shape else 0
      shard_rows = index[0][1] - start if shape else 0
      ranges = cuts(shard_rows, parts) if parts > 1 else [None]
      row_bytes = (_volume(index) // shard_rows * itemsize if shard_rows
                   else _volume(index) * itemsize)
      for proc, cut in zip(by_load, ranges):
        if cut is None:
          load[proc] += _volume(index) * itemsize
          region = index
        else:
          load[proc] += (cut[1] - cut[0]) * row_bytes
          region = ((start + cut[0], start + cut[1]),) + tuple(index[1:])
        if proc == process:
          device = next(d for d in holders[index]
                        if d.process_index == process)
          mine.append(Piece(region, device, cut))
    out.append(tuple(mine))
  return tuple(out)


def bytes_per_process(arrays: Sequence[tuple[Any, tuple[int, ...], Any]],
                      process_count: int,
                      split_bytes: int = SPLIT_BYTES) -> list[int]:
  """The bytes each process writes under `plan` (for tests and figures)."""
  key = tuple((s, tuple(shape), np.dtype(d)) for s, shape, d in arrays)
  return [sum(_volume(p.index) * np.dtype(d).itemsize
              for pieces, (_, _, d) in zip(plan(key, proc, process_count,
                                                split_bytes), key)
              for p in pieces)
          for proc in range(process_count)]
