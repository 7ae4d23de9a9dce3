"""`division`: every byte written once, spread over the processes.

The plan depends on the shardings alone, so these tests build shardings of
a 4-process x 2-device job from stand-in devices (one JAX process cannot
have devices of four): `_Sharding.devices_indices_map` is all the plan
reads, with each device's `process_index`. The real 4-process job is in
`tests/multihost/test_multihost_topology.py`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib

import numpy as np
import pytest

from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.arrays import division


def bytes_per_process(arrays, process_count: int) -> list[int]:
  """The bytes each process writes under `division.plan` of `arrays`
  ((sharding, shape, dtype) each)."""
  key = tuple((s, tuple(shape), np.dtype(d)) for s, shape, d in arrays)
  return [sum(math.prod(stop - start for start, stop in p.index)
              * np.dtype(d).itemsize
              for pieces, (_, _, d) in zip(
                  division.plan(key, proc, process_count), key)
              for p in pieces)
          for proc in range(process_count)]


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

  @property
  def device_set(self):
    return frozenset(self.devices)

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
  per_process = bytes_per_process(arrays, 4)
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
               for p in division.plan(key, proc, 4)[n]]
    # What a reader checks of every saved array: no element missing or
    # written twice.
    manifest_lib.check_grid(indices, list(shape), f"leaf {n}")


def test_each_piece_is_a_row_range_of_a_shard_this_process_holds():
  arrays = _tree(HSDP)
  for proc in range(4):
    for (_, shape, _), pieces in zip(
        arrays, division.plan(tuple(arrays), proc, 4)):
      for piece in pieces:
        assert piece.device.process_index == proc
        held = HSDP.devices_indices_map(shape)[piece.device]
        if piece.rows is not None:
          start, stop = piece.rows
          assert piece.index[0] == (held[0].start + start,
                                    held[0].start + stop)


def test_small_shards_are_written_whole_and_one_process_writes_all():
  small = [(DATA_PARALLEL, (64, 4), np.dtype(np.float32))] * 8
  per_process = bytes_per_process(small, 4)
  assert per_process == [2048, 2048, 2048, 2048]  # Whole, by least load.
  for proc in range(4):
    for pieces in division.plan(tuple(small), proc, 4):
      assert all(p.rows is None for p in pieces)
  one = _Sharding(tuple(_Device(i, 0) for i in range(2)), 1)
  assert bytes_per_process(_tree(one), 1) == [
      sum(math.prod(s) * 4 for _, s, _ in _tree(one))]


def _simulator():
  path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "control_plane.py"
  spec = importlib.util.spec_from_file_location("control_plane_sim", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


SIM = _simulator()


def _mesh_arrays(processes: int, per_process: int, model: int):
  """A (data, model) mesh whose model axis is `model` devices wide, across
  processes when wider than `per_process`, with arrays cut every way: both
  axes, the model axis alone (replicated over data), replicated, a
  scalar, and shapes the cuts do not divide."""
  devices = [SIM.FakeDevice(i, i // per_process)
             for i in range(processes * per_process)]
  axes = (("data", processes * per_process // model), ("model", model))
  f32 = np.dtype(np.float32)
  shard = lambda *spec: SIM.MeshSharding(devices, axes, spec)  # pylint: disable=unnecessary-lambda-assignment
  both, tensor, vector = shard("data", "model"), shard(None, "model"), shard(
      "model")
  replicated = shard()
  arrays = [(both, (512, 1024), f32), (tensor, (1024, 512), f32),
            (vector, (4096,), f32), (replicated, (256,), f32),
            (replicated, (), np.dtype(np.int32)),
            (tensor, (1030, 514), f32),  # 514 columns: not divided by 4.
            (replicated, (2048, 256), f32)] * 3
  return arrays


@pytest.mark.parametrize("processes,per_process,model", [
    (8, 2, 4),  # The model axis spans 2 processes.
    (4, 2, 2),  # Within each process.
    (6, 1, 1),  # Data parallel, one device a process.
])
def test_a_2d_mesh_is_written_once_evenly_from_held_shards(
    processes, per_process, model):
  """Each process plans alone from the shards it holds; together the plans
  write every byte of every array once, as a grid, each piece from a
  device of its writer that holds it, and spread evenly."""
  arrays = _mesh_arrays(processes, per_process, model)
  key = tuple(arrays)
  plans = [division.plan(key, proc, processes) for proc in range(processes)]
  total = sum(math.prod(s) * d.itemsize for _, s, d in arrays)
  for n, (sharding, shape, _) in enumerate(arrays):
    indices = []
    for proc in range(processes):
      for piece in plans[proc][n]:
        assert piece.device.process_index == proc
        region = tuple(sl.indices(size)[:2] for sl, size in zip(
            sharding.devices_indices_map(shape)[piece.device], shape))
        if piece.rows is None:
          assert piece.index == region
        else:
          assert piece.index[0] == (region[0][0] + piece.rows[0],
                                    region[0][0] + piece.rows[1])
          assert piece.index[1:] == region[1:]
        indices.append(list(map(list, piece.index)))
    manifest_lib.check_grid(indices, list(shape), f"leaf {n}")
  per_process = bytes_per_process(arrays, processes)
  assert sum(per_process) == total
  assert max(per_process) <= 1.25 * total / processes, per_process


def test_the_plan_reads_each_shardings_indices_once_not_per_leaf():
  """At thousands of processes, JAX's indices of one array list every
  device of the job: the plan reads them once per sharding and rank (and
  once per shape that the sharding's cuts do not divide), not per leaf."""
  calls = []

  class Counting(SIM.MeshSharding):

    def devices_indices_map(self, shape):
      calls.append(tuple(shape))
      return super().devices_indices_map(shape)

  devices = [SIM.FakeDevice(i, i // 4) for i in range(64)]
  axes = (("data", 8), ("model", 8))
  shardings = [Counting(devices, axes, spec)
               for spec in [("data", "model"), (None, "model"), ()]]
  arrays = [(shardings[k % 3], (64 * (1 + k % 5), 64), np.dtype(np.float32))
            for k in range(600)]
  arrays += [(shardings[1], (64, 12), np.dtype(np.float32))] * 100  # Uneven.
  division.plan(tuple(arrays), 5, 16)
  # Per sharding and rank, the grid's probe; and one for the uneven shape.
  assert len(calls) == 3 + 1, calls


def test_holder_sets_that_share_processes_spread_their_small_shards():
  """3 processes x 2 devices on a (data=2, model=3) mesh, arrays cut over
  the model axis: each shard is held by a pair of processes ({0, 1}, {0,
  2}, {1, 2}), and each process writes one small shard of each array."""
  devices = [SIM.FakeDevice(i, i // 2) for i in range(6)]
  sharding = SIM.MeshSharding(devices, (("data", 2), ("model", 3)),
                              ("model",))
  one = [(sharding, (3 * 256,), np.dtype(np.float32))]
  assert bytes_per_process(one, 3) == [1024] * 3
  many = [(sharding, (3 * (256 + 8 * k),), np.dtype(np.float32))
          for k in range(31)]
  per_process = bytes_per_process(many, 3)
  assert max(per_process) - min(per_process) <= 2 * 4 * (256 + 8 * 30), (
      per_process)


def test_real_shardings_give_their_grid_without_listing_devices_per_leaf():
  """JAX's own shardings on this process's devices: the grid comes from
  one probe per sharding and rank, and the plan is the one every device's
  indices give."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin.format.treepaths import shard_plan  # pylint: disable=g-import-not-at-top
  devices = np.array(jax.devices()[:2])
  shardings = [NamedSharding(jax.sharding.Mesh(devices.reshape(2, 1),
                                               ("data", "model")), spec)
               for spec in (P("data"), P(None, "data"), P("data", "model"),
                            P(), P("model"))]
  shardings.append(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  for sharding in shardings:
    ndim = 2 if len(getattr(sharding, "spec", ())) > 1 else 1
    grid = division._grid(sharding, ndim, 0)  # pylint: disable=protected-access
    assert grid is not None, sharding
    shape = (64, 8)[:ndim]
    held = division._held(sharding, shape, 4, 0, division.SPLIT_BYTES)  # pylint: disable=protected-access
    expected = sorted({index for index, _ in shard_plan(sharding,
                                                         shape).values()})
    got = [p.index for p in held.own] + [s.index for s in held.shared]
    assert sorted(got) == expected, sharding
