"""Bytes from every process to another, by XLA's collective permute.

One step of the partner plan (`partners`) moves, for every process p, a
buffer of p's bytes to one other process, along a permutation of the
processes that every process knows alike. `permute` does it with JAX's
own collectives, no socket of ours: each process splits its bytes over its
local devices (one row of `ceil(length / devices)` bytes each, the length
the longest process's, padded), and one jitted `shard_map` of
`jax.lax.ppermute` over a 1-D mesh of every device sends device j of
process p to device j of its receiver. The lengths travel first, by
JAX's `process_allgather`, so that each receiver cuts off the padding.

Memory: each device holds its row twice (sent and received) while the
program runs, and the received rows come back to the host; a caller
bounds a step's bytes to bound that. Every process must call `permute`
at the same point of its program (as it must any collective): from the
loop's thread, between the same two train steps, so that the permute
never interleaves with the step's own collectives in another order on
another process. Needs the same number of devices on every process.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

_AXIS = "processes_devices"


def _devices() -> list[jax.Device]:
  """Every device, process by process (the order of `ppermute`'s rows)."""
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


@functools.lru_cache(maxsize=16)
def _program(devices: tuple[jax.Device, ...], to: tuple[int, ...]):
  per = len(devices) // len(to)
  pairs = [(p * per + j, to[p] * per + j)
           for p in range(len(to)) for j in range(per)]
  mesh = Mesh(np.array(devices), (_AXIS,))
  # `jax.shard_map` where this JAX has it; its older home otherwise.
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map  # pylint: disable=g-import-not-at-top
  moved = shard_map(lambda rows: jax.lax.ppermute(rows, _AXIS, pairs),
                    mesh=mesh, in_specs=PartitionSpec(_AXIS),
                    out_specs=PartitionSpec(_AXIS))
  return mesh, jax.jit(moved)


def permute(data: np.ndarray, to: Sequence[int]) -> np.ndarray:
  """Sends this process's bytes `data` (uint8, one dimension) to process
  `to[this process]`; returns the bytes that the process sending here
  sent. Called by every process together, with the same `to`: a
  permutation of the processes, p to `to[p]`.

  Raises:
    ValueError: `to` is no permutation of the processes, or the processes
      have different numbers of devices.
  """
  count, me = jax.process_count(), jax.process_index()
  to = tuple(int(p) for p in to)
  if sorted(to) != list(range(count)):
    raise ValueError(f"not a permutation of the {count} processes: {to}")
  devices = tuple(_devices())
  local = [d for d in devices if d.process_index == me]
  if len(devices) != len(local) * count:
    raise ValueError("every process needs the same number of devices to"
                     " exchange partner copies")
  data = np.ascontiguousarray(data, np.uint8).reshape(-1)
  lengths = np.asarray(multihost_utils.process_allgather(
      np.array([data.size], np.int64))).reshape(-1)
  per = len(local)
  row = max(1, -(-int(lengths.max()) // per))
  padded = np.zeros(per * row, np.uint8)
  padded[:data.size] = data
  mesh, program = _program(devices, to)
  sharding = NamedSharding(mesh, PartitionSpec(_AXIS))
  rows = jax.make_array_from_single_device_arrays(
      (len(devices), row), sharding,
      [jax.device_put(padded[j * row:(j + 1) * row].reshape(1, row), d)
       for j, d in enumerate(local)])
  out = program(rows)
  got = {s.device: np.asarray(s.data).reshape(-1)
         for s in out.addressable_shards}
  sender = to.index(me)
  return np.concatenate([got[d] for d in local])[:int(lengths[sender])]
