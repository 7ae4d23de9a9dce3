"""What a snapshot holds, as the writer reads it: each leaf of the saved
tree (`LeafSnapshot`) and the shards of it this process writes
(`ShardData`), whose values are on the host or being copied there
(`snapshot` starts the copies; `ShardData.host` waits for one). What the
writer writes of a shard, its bytes and their checksums, comes from here
(`ShardData.host_bytes`, `ShardData.checksums`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from flax_ckpt_plugin.arrays.copies import Packed
from flax_ckpt_plugin.arrays.pinned import PINNED
from flax_ckpt_plugin.arrays.pinned import wait_ready
from flax_ckpt_plugin.format.records import block_checksums
from flax_ckpt_plugin.format.treepaths import extents
from flax_ckpt_plugin.format.treepaths import Index
from flax_ckpt_plugin.format.treepaths import KeyEntry


@dataclasses.dataclass(frozen=True)
class ShardData:
  """One shard's values, on the host or being copied there."""
  index: Index  # [start, stop) per dimension of the global array.
  # A C-contiguous host array of the shard's values, or a copy still being
  # made: in pinned host memory (see `pinned`), or (CPU backend) a staging
  # copy, a jax.Array of the values or of their bits as unsigned integers
  # of the same width (a copy in reused memory, see `staging`), or the
  # shard's bits in a pack of small shards (`copies.Packed`); `host()`
  # waits for it.
  data: np.ndarray | jax.Array | Packed
  dtype: np.dtype | None = None  # The values' dtype, for a staging copy.
  # The CRC-32C of each `records.CHECKSUM_BLOCK` bytes, when the copy took
  # them (`HostStaging.copy_summed`); else the writer does.
  crc32c: list[int] | None = None

  @property
  def nbytes(self) -> int:
    return self.data.nbytes

  @property
  def address(self) -> int | None:
    """Where `host()`'s values are in memory, known while the copy is in
    flight; None if the runtime does not say."""
    if isinstance(self.data, np.ndarray):
      return self.data.ctypes.data
    if not self.holdable:  # An accelerator's own memory: not the host's.
      return None
    try:
      if isinstance(self.data, Packed):
        return self.data.pack.unsafe_buffer_pointer() + self.data.offset
      return self.data.unsafe_buffer_pointer()
    except Exception:  # pylint: disable=broad-except
      return None

  @property
  def holdable(self) -> bool:
    """Whether a restore may still read the values after the save
    (`backends.held`): a staging copy on a CPU device, or pinned host
    memory, which the next save reuses anyway. Not a numpy copy (a plain
    transfer past the pinned budget, or after the runtime refused pinned
    memory; a numpy leaf): that pageable memory is freed with its save,
    as a budget asks. Not a copy in an accelerator's own memory (a partner
    copy just received)."""
    data = self.data.pack if isinstance(self.data, Packed) else self.data
    if isinstance(data, np.ndarray):
      return False
    try:
      return (data.sharding.memory_kind == PINNED
              or next(iter(data.devices())).platform == "cpu")
    except Exception:  # pylint: disable=broad-except
      return False

  @property
  def pinned_array(self) -> jax.Array | None:
    """The copy itself where it is a `jax.Array` in pinned host memory of
    the values' dtype (what a restore sends to a device as it is: see
    `backends.held`); else None."""
    data = self.data
    try:
      if (isinstance(data, jax.Array) and data.dtype == self.dtype
          and data.sharding.memory_kind == PINNED):
        return data
    except Exception:  # pylint: disable=broad-except
      pass
    return None

  def host(self) -> np.ndarray:
    """The values as a host array (a zero-copy view of a staging or pinned
    copy). Raises the copy's error if it failed.

    Hold the view no longer than needed: while it lives, the staging
    buffer cannot be donated to the next save's copy (which then copies
    into new memory, still correctly).
    """
    if isinstance(self.data, np.ndarray):
      return self.data
    if isinstance(self.data, Packed):  # Reused: DLPack, as below.
      packed = self.data
      wait_ready([packed.pack], lambda: "the copy of a pack of small"
                 f" shards ({packed.pack.nbytes} bytes) to host memory")
      flat = np.from_dlpack(packed.pack)
      return flat[packed.offset:packed.offset + packed.nbytes].view(
          self.dtype).reshape(extents(self.index))
    wait_ready([self.data], lambda: "the copy of shard"
               f" {[list(r) for r in self.index]} ({self.data.nbytes} bytes)"
               " to host memory")
    if self.data.dtype == self.dtype:  # Not reused: its view pins nothing.
      return np.asarray(self.data)
    # DLPack, not np.asarray: the view goes when the caller drops it,
    # while np.asarray's stays cached on the copy and keeps it from being
    # donated to the next save.
    return np.from_dlpack(self.data).view(self.dtype)

  def host_bytes(self) -> np.ndarray:
    """`host()` as its bytes, in C order (uint8): what the data file holds.
    A view through uint8 works for dtypes that the buffer protocol lacks
    too (bfloat16, float8, int4 from ml_dtypes)."""
    return np.asarray(self.host(), order="C").reshape(-1).view(np.uint8)

  def checksums(self, data: np.ndarray | None = None) -> list[int]:
    """The CRC-32C of each `records.CHECKSUM_BLOCK` bytes: those the
    snapshot took while copying, else computed from `data` (the shard's
    `host_bytes()`, by default read here)."""
    if self.crc32c is not None:
      return self.crc32c
    return block_checksums(memoryview(
        self.host_bytes() if data is None else data))


@dataclasses.dataclass
class LeafSnapshot:
  """One leaf of the saved tree and the shards this process writes."""
  path: str
  keys: list[KeyEntry]
  kind: str  # 'array' | 'numpy' | 'int' | 'float' | 'bool'
  dtype: str | None
  shape: tuple[int, ...]
  shards: list[ShardData]
  value: Any = None  # Python scalars only.
  key_impl: str | None = None  # Typed PRNG key arrays only.

  def meta(self) -> dict[str, Any]:
    """The manifest entry, without shard locations."""
    entry: dict[str, Any] = {"path": self.path, "keys": self.keys,
                             "kind": self.kind}
    if self.kind in ("int", "float", "bool"):
      entry["value"] = self.value
      return entry
    entry["dtype"] = self.dtype
    entry["shape"] = list(self.shape)
    if self.key_impl is not None:
      entry["key_impl"] = self.key_impl
    return entry


def host_leaf(path: str, keys: list[KeyEntry], leaf: Any,
               is_primary: bool) -> LeafSnapshot:
  """The record of a leaf that is not a `jax.Array`: a numpy value (whose
  bytes the primary host writes) or a Python scalar (kept in the
  manifest).

  Raises:
    TypeError: the leaf cannot be saved; the message names it.
  """
  if isinstance(leaf, (np.ndarray, np.generic)):
    arr = np.asarray(leaf)
    if arr.dtype.byteorder == ">":  # The format stores little-endian bytes.
      arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.dtype.hasobject or arr.dtype.names is not None:
      raise TypeError(f"leaf {path!r}: numpy dtype {arr.dtype} cannot be"
                      " saved (object and structured dtypes are not).")
    index = tuple((0, d) for d in arr.shape)
    shards = [ShardData(index, np.array(arr, order="C"))] if is_primary else []
    return LeafSnapshot(path, keys, "numpy", str(arr.dtype), arr.shape, shards)
  # bool before int: bool is an int subclass.
  for kind, typ in (("bool", bool), ("int", int), ("float", float)):
    if isinstance(leaf, typ):
      return LeafSnapshot(path, keys, kind, None, (), [], value=typ(leaf))
  if isinstance(leaf, jax.ShapeDtypeStruct):
    raise TypeError(f"leaf {path!r} is an abstract ShapeDtypeStruct, not a"
                    " value: save a concrete state.")
  raise TypeError(
      f"leaf {path!r} has type {type(leaf).__name__}, which cannot be saved:"
      " leaves must be jax/numpy arrays or Python int/float/bool. Mark"
      " non-array fields of a flax.struct dataclass with"
      " `struct.field(pytree_node=False)`.")
