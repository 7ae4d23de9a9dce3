"""This process's slots of a batch shared in a restore made together.

The inputs of a batch's program (`share_program`): for each leaf split
over the processes (`read_plan.Split`), one block per local device holding
this process's rows of the region, read from the step and checked; for the
packed small leaves (`read_plan.Pack`), one flat row per local device.
Zeros stand in where a read failed, so that every process still runs
every program (see `shared_read`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from flax_ckpt_plugin.format.treepaths import Index
from flax_ckpt_plugin.format.treepaths import normalize_index
from flax_ckpt_plugin.restore import read_plan
from flax_ckpt_plugin.restore import replicas as replicas_lib
from flax_ckpt_plugin.restore.reader import LeafReads


def inputs(leaves: list, batch: list[int], pack: read_plan.Pack | None,
            flats: dict[Any, np.ndarray] | None, slots: dict[int, jax.Array],
            reads: LeafReads, *, zeros: bool) -> tuple[Any, list[jax.Array]]:
  """A batch's program inputs: the packed slots and each other leaf's
  slots (taken out of `slots`); all zeros if `zeros`."""
  flat = None
  if pack is not None:
    if zeros or flats is None:
      flats = {d: np.zeros((1, pack.length), np.uint8) for d in pack.devices
               if d.process_index == jax.process_index()}
    flat = jax.make_array_from_single_device_arrays(
        (len(pack.devices), pack.length), pack.sharding,
        [jax.device_put(x, d) for d, x in flats.items()], dtype=np.uint8)
  arrays = []
  for i in batch:
    if pack is not None and i in pack.pieces:
      continue
    leaf, t, split = leaves[i]
    slot = slots.pop(i, None)
    arrays.append(slot if slot is not None and not zeros else leaf_slots(
        leaf, t, split, reads, read=False))
  return flat, arrays


def fill(flats: dict[Any, np.ndarray], leaf: Any, pieces: list,
          reads: LeafReads) -> None:
  """Reads this process's rows of a packed leaf into its devices' slots."""
  lr = reads.open(leaf)
  rest = tuple((0, n) for n in leaf.shape[1:])
  mine = [p for p in pieces if p[3] in flats]
  if not mine:
    return
  lo, hi = min(p[4] for p in mine), max(p[5] for p in mine)
  data = replicas_lib.as_bytes(lr.read(((lo, hi),) + rest)).reshape(
      hi - lo, -1)
  for _, offset, n, device, a, b in mine:  # Each read once.
    flats[device][0, offset:offset + n] = data[a - lo:b - lo].reshape(-1)


def leaf_slots(leaf: Any, t: Any, split: read_plan.Split, reads: LeafReads, *,
           read: bool
           ) -> jax.Array:
  """This process's slots of a shared leaf (zeros unless `read`), of
  `read_plan.carrier`'s dtype."""
  local = {d: normalize_index(i, leaf.shape) for d, i in
           t.sharding.addressable_devices_indices_map(leaf.shape).items()}
  ranges: dict[Index, tuple[int, int]] = {}  # This process's, per region.
  for device, region in local.items():
    lo, hi = split.parts.get(device, (None, ((0, 0),)))[1][0]
    if hi > lo:
      a, b = ranges.get(region, (lo, hi))
      ranges[region] = (min(a, lo), max(b, hi))
  carrier = read_plan.carrier(leaf.dtype)
  got = {}
  if read:
    lr = reads.open(leaf)
    got = {region: (lo, replicas_lib.as_bytes(
        lr.read(((lo, hi),) + region[1:])).view(carrier))
           for region, (lo, hi) in ranges.items()}  # Each read once.
  blocks = []
  for device, region in local.items():
    dims = tuple(hi - lo for lo, hi in region[1:]) + split.shape[-1:]
    block = np.zeros((1, split.rows) + dims, carrier)
    lo, hi = split.parts.get(device, (None, ((0, 0),)))[1][0]
    if hi > lo and read:
      first, data = got[region]
      block[0, :hi - lo] = data[lo - first:hi - first]
    blocks.append(jax.device_put(block, device))
  return jax.make_array_from_single_device_arrays(split.shape, split.stacked,
                                                  blocks, dtype=carrier)
