"""The program that shares one batch of a restore made together.

`shared_read` reads each process's part of a batch's leaves into slots
(`read_plan.Split`) and packed slots (`read_plan.Pack`); this program,
one per batch, gathers the slots along the replica axes so that every
device gets its whole region, takes the rows back in order, and gathers
the packed slots on every device. Compiled ahead of the reads, on a thread
(see `shared_read._read`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from flax_ckpt_plugin.restore import replicas as replicas_lib
from flax_ckpt_plugin.restore import read_plan


def compile_batch(leaves: list, batch: list[int],
                  pack: read_plan.Pack | None, x64: bool) -> Any:
  """The program that shares a batch: it gathers the slots of each leaf
  of its own and takes the rows back in order (`_assemble`), and gathers
  the packed slots on every device."""
  alone = [i for i in batch if pack is None or i not in pack.pieces]
  how = [(leaves[i][0].dtype, leaves[i][2]) for i in alone]

  def program(flat, stacked):
    return (_assemble(stacked, [(d, s.rows, s.index, s.stacked)
                                for d, s in how]),
            None if pack is None else _constrain(flat, pack.everywhere))

  with jax.enable_x64(x64):
    return jax.jit(
        program,
        out_shardings=([leaves[i][1].sharding for i in alone],
                       pack and pack.everywhere)).lower(
            pack and jax.ShapeDtypeStruct(
                (len(pack.devices), pack.length), np.uint8,
                sharding=pack.sharding),
            [jax.ShapeDtypeStruct(s.shape, read_plan.carrier(d),
                                  sharding=s.stacked)
             for d, s in how]).compile()


def _runs(index: np.ndarray) -> list[tuple[int, int]]:
  """`index` as [start, stop) ranges of consecutive positions, in order."""
  breaks = np.flatnonzero(np.diff(index) != 1) + 1
  return [(int(run[0]), int(run[-1]) + 1)
          for run in np.split(index, breaks) if len(run)]


def _constrain(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """`x` laid out as `sharding` says, on a mesh of Explicit axes or not."""
  if any(t == jax.sharding.AxisType.Explicit
         for t in getattr(sharding.mesh, "axis_types", ())):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _assemble(stacked: list[jax.Array], how: list) -> list[jax.Array]:
  """Every device's region, from the slots contributed (see
  `read_plan.Split`)."""
  out = []
  for x, (dtype, rows, index, sharding) in zip(stacked, how):
    # The gather itself, said explicitly (the axis of slots no longer
    # sharded), so that it is the same on meshes of Auto or Explicit axes,
    # on which the slicing below would be refused.
    x = _constrain(x, NamedSharding(
        sharding.mesh, PartitionSpec(None, *sharding.spec[1:])))
    slots, regions, rest = x.shape[0], x.shape[1] // rows, x.shape[2:]
    x = jnp.moveaxis(x.reshape((slots, regions, rows) + rest), 1, 0)
    x = x.reshape((regions, slots * rows) + rest)
    # The slots end to end, then the rows in order: static slices, not a
    # gather by index, whose output sharding cannot be inferred on a mesh
    # of Explicit axes (`jax.make_mesh`'s).
    x = jnp.concatenate([x[:, a:b] for a, b in _runs(index)], axis=1)
    u8 = x.reshape((regions * len(index),) + rest)
    out.append(replicas_lib.from_bytes(u8, dtype))
  return out
