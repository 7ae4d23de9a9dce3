"""Restoring a leaf into another dtype than it was saved in (`cast=True`).

Which conversions a restore makes is `matching`'s to say, before any data
is read (`matching.refusal`). Here they are made: `CastReader` converts a
leaf while it is read, piece by piece, so that a leaf never exists twice
in full (saved dtype and target dtype) in memory; a narrower integer
target (or one that lacks the saved negatives) is checked value by value
(`needs_check`). Floating values out of the narrower range become
infinities, or NaN in float8 kinds without them.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Protocol, TypeVar

import jax
import numpy as np

from flax_ckpt_plugin.errors import StructureMismatchError
from flax_ckpt_plugin.restore.data_files import host_buffer
from flax_ckpt_plugin.format.records import describe
from flax_ckpt_plugin.format.records import Index
from flax_ckpt_plugin.format.records import LeafRecord


class SavedValues(Protocol):
  """What a cast reads through: a leaf's saved values by region, checked
  (`reader.LeafReader` is one; named here so that the rules of casting
  stand below the reader that uses them)."""

  shape: tuple[int, ...]

  def small_shard_ranges(self, regions: Iterable[Index]
                         ) -> Iterator[tuple[str, int, int]]:
    ...

  def read_chunks(self, region: Index, limit: int
                  ) -> Iterator[tuple[Index, np.ndarray]]:
    ...


Values = TypeVar("Values", bound=SavedValues)

# Saved values converted at a time, in bytes of the saved dtype: the memory
# a cast costs besides the result.
CHUNK_BYTES = 4 << 20


def needs_check(saved: np.dtype, target: Any) -> bool:
  """Whether an integer cast can meet a value the target cannot hold."""
  if not jax.numpy.issubdtype(saved, jax.numpy.integer):
    return False
  have, want = jax.numpy.iinfo(saved), jax.numpy.iinfo(target)
  return int(want.min) > int(have.min) or int(want.max) < int(have.max)


def cast_leaves(saved: dict[str, LeafRecord],
                targets: Iterable[tuple[str, Any]]) -> list[str]:
  """The paths of the array leaves whose target dtype differs from the
  saved one (after `matching` accepted them)."""
  out = []
  for path, target in targets:
    leaf = saved.get(path)
    dtype = getattr(target, "dtype", None)
    if (leaf is not None and leaf.dtype is not None and dtype is not None
        and leaf.key_impl is None
        and np.dtype(dtype) != leaf.dtype.newbyteorder("=")):
      out.append(path)
  return out


class CastReader:
  """A `LeafReader` whose regions come back in another dtype.

  Reads `CHUNK_BYTES` of saved values at a time (`LeafReader.read_chunks`,
  checksums verified as usual) and converts each piece into the result, so
  the conversion costs one piece of memory, not a second copy of the leaf.
  Integer values that the target cannot hold raise, naming the leaf.

  Attributes:
    dtype: the target's dtype, which `read` returns.
    shape: the leaf's global shape.
  """

  def __init__(self, lr: SavedValues, leaf: LeafRecord, dtype: Any,
               where: str):
    self._lr = lr
    self._leaf = leaf
    self._where = where
    self.dtype = np.dtype(dtype)
    self.shape = lr.shape
    self._check = needs_check(leaf.dtype, self.dtype)

  def small_shard_ranges(self, regions):
    """See `LeafReader.small_shard_ranges`."""
    return self._lr.small_shard_ranges(regions)

  def read(self, region: Index, out: np.ndarray | None = None) -> np.ndarray:
    """The values of `region`, converted, in `out` or a new array.

    Raises:
      StructureMismatchError: an integer the target dtype cannot hold.
      CheckpointCorruptedError: as `LeafReader.read`.
    """
    if out is None:
      out = host_buffer([hi - lo for lo, hi in region], self.dtype)
    for piece, values in self._lr.read_chunks(region, CHUNK_BYTES):
      if self._check and values.size:
        self._check_range(values)
      where = tuple(slice(lo - r0, hi - r0)
                    for (lo, hi), (r0, _) in zip(piece, region))
      np.copyto(out[where], values, casting="unsafe")
    return out

  def _check_range(self, values: np.ndarray) -> None:
    info = jax.numpy.iinfo(self.dtype)
    for v in (int(values.min()), int(values.max())):
      if not int(info.min) <= v <= int(info.max):
        raise StructureMismatchError(
            f"{self._where}, leaf {self._leaf.path!r}: checkpoint has"
            f" {self._leaf.describe()}, target has"
            f" {describe(self.dtype, self.shape)}, which"
            f" cannot hold the saved value {v} ({self.dtype.name} holds"
            f" [{info.min}, {info.max}]); restore it into a wider integer")


def reader_for(lr: Values, leaf: LeafRecord, target: Any,
               where: str) -> Values | CastReader:
  """`lr`, or a `CastReader` over it when `target`'s dtype differs."""
  dtype = getattr(target, "dtype", None)
  if (dtype is None or leaf.key_impl is not None
      or np.dtype(dtype) == leaf.dtype.newbyteorder("=")):
    return lr
  return CastReader(lr, leaf, dtype, where)
