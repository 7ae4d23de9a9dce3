"""`writeplan`: every byte written once, spread over the processes.

The plan depends on the shardings alone, so these tests build shardings of
a 4-process x 2-device job from stand-in devices (one JAX process cannot
have devices of four): `_Sharding.devices_indices_map` is all the plan
reads, with each device's `process_index`. The real 4-process job is in
`tests/test_multihost_topology.py`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.save import writeplan


@dataclasses.dataclass(frozen=True)
class _Device:
  id: int
  process_index: int


@dataclasses.dataclass(frozen=True)
class _Sharding:
  """Rows split over `row_parts` devices of each process group: a
  stand-in for NamedSharding over a (replicas, row_parts) mesh."""
  devices: tuple[_Device, ...]
  row_parts: int

  def devices_indices_map(self, shape):
    out = {}
    rows = shape[0] if shape else 0
    for n, device in enumerate(self.devices):
      if not shape:
        out[device] = ()
        continue
      part = n % self.row_parts
      step = rows // self.row_parts
      out[device] = (slice(part * step, (part + 1) * step),) + tuple(
          slice(0, d) for d in shape[1:])
    return out


DEVICES = tuple(_Device(i, i // 2) for i in range(8))  # 4 processes x 2.
DATA_PARALLEL = _Sharding(DEVICES, 1)  # Every array on all 8 devices.
HSDP = _Sharding(DEVICES, 2)  # Sharded over a host's 2, replicated x4.


def _tree(sharding):
  """A 50 MB-ish Adam TrainState's arrays: large kernels, small biases."""
  shapes = [(1024, 1024), (1024,), (1024, 2048), (2048,), (2048, 512),
            (512,), ()] * 3
  return [(sharding, shape, np.dtype(np.float32)) for shape in shapes]


@pytest.mark.parametrize("sharding", [DATA_PARALLEL, HSDP],
                         ids=["data_parallel", "hsdp"])
def test_the_bytes_are_spread_evenly_and_written_once(sharding):
  arrays = _tree(sharding)
  total = sum(math.prod(s) * 4 for _, s, _ in arrays)
  per_process = writeplan.bytes_per_process(arrays, 4)
  assert sum(per_process) == total  # Every byte once.
  assert max(per_process) <= 1.25 * total / 4, per_process


@pytest.mark.parametrize("sharding", [DATA_PARALLEL, HSDP],
                         ids=["data_parallel", "hsdp"])
def test_the_pieces_of_an_array_tile_it_as_a_grid(sharding):
  arrays = _tree(sharding)
  key = tuple(arrays)
  for n, (_, shape, _) in enumerate(arrays):
    indices = [list(map(list, p.index))
               for proc in range(4)
               for p in writeplan.plan(key, proc, 4)[n]]
    # What a reader checks of every saved array: no element missing or
    # written twice.
    manifest_lib.check_grid(indices, list(shape), f"leaf {n}")


def test_each_piece_is_a_row_range_of_a_shard_this_process_holds():
  arrays = _tree(HSDP)
  for proc in range(4):
    for (_, shape, _), pieces in zip(
        arrays, writeplan.plan(tuple(arrays), proc, 4)):
      for piece in pieces:
        assert piece.device.process_index == proc
        held = HSDP.devices_indices_map(shape)[piece.device]
        if piece.rows is not None:
          start, stop = piece.rows
          assert piece.index[0] == (held[0].start + start,
                                    held[0].start + stop)


def test_small_shards_are_written_whole_and_one_process_writes_all():
  small = [(DATA_PARALLEL, (64, 4), np.dtype(np.float32))] * 8
  per_process = writeplan.bytes_per_process(small, 4)
  assert per_process == [2048, 2048, 2048, 2048]  # Whole, by least load.
  for proc in range(4):
    for pieces in writeplan.plan(tuple(small), proc, 4):
      assert all(p.rows is None for p in pieces)
  one = _Sharding(tuple(_Device(i, 0) for i in range(2)), 1)
  assert writeplan.bytes_per_process(_tree(one), 1) == [
      sum(math.prod(s) * 4 for _, s, _ in _tree(one))]
