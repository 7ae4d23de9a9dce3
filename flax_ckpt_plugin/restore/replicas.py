"""Arrays that travel between devices as bytes, along a mesh's replica axes.

Two restores move bytes this way: a rejoin's state, from the survivors'
local tiers to every device (`peer`), and a restore read once and shared
(`shared_read`, `read_plan`, `share_program`). Each leaf travels as its
bytes with an axis of the item's bytes last (`as_bytes`), stacked along the
axes its sharding replicates over (`replica_axes`), and is taken back from
its bytes on the device (`from_bytes`).
"""

from __future__ import annotations

import math

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np


def replica_axes(sharding: NamedSharding, ndim: int
                 ) -> tuple[tuple[str, ...], NamedSharding, int]:
  """The mesh axes that `sharding` replicates over (its spec names none of
  them); the sharding of an array of `ndim` dims stacked along them, with
  an axis of bytes last ([replicas, *shape, itemsize]); and how many
  replicas that is."""
  mesh, spec = sharding.mesh, tuple(sharding.spec)
  used = set()
  for entry in spec:
    used.update(entry if isinstance(entry, tuple) else
                () if entry is None else (entry,))
  spare = tuple(a for a in mesh.axis_names if a not in used)
  spec = spec + (None,) * (ndim - len(spec))
  return (spare, NamedSharding(mesh, PartitionSpec(spare or None, *spec,
                                                   None)),
          math.prod(mesh.shape[a] for a in spare))


def as_bytes(arr: np.ndarray) -> np.ndarray:
  """`arr`'s bytes, with an axis of the item's bytes last."""
  arr = np.asarray(arr, order="C")  # Not ascontiguousarray: 0-d stays 0-d.
  return arr.reshape(-1).view(np.uint8).reshape(arr.shape + (
      arr.dtype.itemsize,))


def from_bytes(u8: jax.Array, dtype: np.dtype) -> jax.Array:
  """Values of `dtype` from their bytes (`as_bytes`'s layout), or from
  themselves with an axis of 1 last (`read_plan.carrier`)."""
  if u8.dtype == dtype:
    return u8[..., 0]
  if dtype == np.bool_:
    return u8[..., 0] != 0
  if dtype.itemsize == 1:
    return lax.bitcast_convert_type(u8[..., 0], dtype)
  return lax.bitcast_convert_type(u8, dtype)
