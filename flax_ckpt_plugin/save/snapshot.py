"""A consistent host copy of a pytree: the only blocking part of a save.

Each process keeps only the parts it writes of every global `jax.Array`:
its share of the shards it holds, as `writeplan` spreads them over the
processes that hold them (every byte once). Host-local values (numpy
arrays and Python scalars, and `jax.Array`s that are fully addressable
while several processes run) are the same on every process by contract, so
only the primary host writes their bytes.

The snapshot stays correct when the next train step donates the state's
buffers, because it never refers to them once the runtime has run what
`take_snapshot` enqueued:

* On accelerators with pinned host memory every shard is copied there in
  one batched call that is not awaited (see `pinned`); the writer waits
  for each shard before writing it. Elsewhere off the CPU, every shard's
  `copy_to_host_async()` is started before the first one is awaited.
* On the CPU backend every shard is copied into reused staging buffers by
  a program the runtime runs before the next step that donates the state
  (see `staging`); `take_snapshot` does not wait for the copy.

Why not keep numpy views of the state's own buffers, which costs nothing?
A view pins the buffer, so the next step's donation is declined and that
step copies its whole input into newly allocated (so newly page-faulted)
memory: measured with a 0.98 GB state on 2 cores, the step after a save took
0.6-1.2 s longer. The enqueued copy costs the loop about 0.1 s per GB.
"""


from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from flax_ckpt_plugin.save import pieces as pieces_lib
from flax_ckpt_plugin.save import pinned
from flax_ckpt_plugin.backends.layout import CHECKSUM_BLOCK
from flax_ckpt_plugin.save.copies import bits_dtype
from flax_ckpt_plugin.save.staging import HostStaging
from flax_ckpt_plugin.format.treepaths import Index
from flax_ckpt_plugin.format.treepaths import KeyEntry


@dataclasses.dataclass(frozen=True)
class ShardData:
  """One shard's values, on the host or being copied there."""
  index: Index  # [start, stop) per dimension of the global array.
  # A C-contiguous host array of the shard's values, or a copy still being
  # made: in pinned host memory (see `pinned`), or (CPU backend) a staging
  # copy, a jax.Array of the values or of their bits as unsigned integers
  # of the same width (a copy in reused memory, see `staging`); `host()`
  # waits for it.
  data: np.ndarray | jax.Array
  dtype: np.dtype | None = None  # The values' dtype, for a staging copy.
  # The CRC-32C of each `layout.CHECKSUM_BLOCK` bytes, when the copy took
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
    try:
      return self.data.unsafe_buffer_pointer()
    except Exception:  # pylint: disable=broad-except
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
    self.data.block_until_ready()
    if self.data.dtype == self.dtype:  # Not reused: its view pins nothing.
      return np.asarray(self.data)
    # DLPack, not np.asarray: the view goes when the caller drops it,
    # while np.asarray's stays cached on the copy and keeps it from being
    # donated to the next save.
    return np.from_dlpack(self.data).view(self.dtype)


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


def _to_pin(plans: list[pieces_lib.Leaf], staging: pinned.PinnedStaging
            ) -> list[tuple[int, int, pieces_lib.Piece]]:
  """(leaf number, piece number, piece) of the pieces that go through
  pinned host memory, within the budget."""
  takes: dict[Any, bool] = {}
  todo = []
  for i, leaf in enumerate(plans):
    if leaf.arr is None or not leaf.pieces or not pinned.fits(leaf.arr.dtype):
      continue
    for j, p in enumerate(leaf.pieces):
      if p.device not in takes:
        takes[p.device] = pinned.takes(p.device)
      if takes[p.device]:
        todo.append((i, j, p))
  return todo[:staging.split([p.nbytes for *_, p in todo])]


def pinned_pieces(tree: Any, *, process_count: int, is_primary: bool,
                  pinned_staging: pinned.PinnedStaging,
                  own_copy: bool = False) -> list[jax.Array]:
  """The arrays that a save of `tree` copies onto pinned host memory (see
  `pinned.PinnedStaging.warm_up`)."""
  plans = pieces_lib.plan(tree, process_count, is_primary, own_copy)
  return [p.cut() for *_, p in _to_pin(plans, pinned_staging)]


def take_snapshot(tree: Any, *, process_count: int, is_primary: bool,
                  staging: HostStaging, own_copy: bool = False,
                  pinned_staging: pinned.PinnedStaging | None = None
                  ) -> list[LeafSnapshot]:
  """Copies the shards this process writes to host memory.

  Args:
    tree: the state to save (e.g. a Flax `TrainState`).
    process_count: number of JAX processes.
    is_primary: whether this process writes host-local values.
    staging: the buffers CPU shards are copied into (reused by the next
      call, so the previous snapshot must no longer be in use).
    own_copy: take every distinct shard this process holds, replicas
      included (a copy that restores this process alone: the local tier).
    pinned_staging: where shards of devices with pinned host memory go
      (see `pinned`); None: the plain transfer.

  Returns:
    One `LeafSnapshot` per leaf, in flattening order, on every process (so
    every process knows the whole tree's metadata).
  """
  plans = pieces_lib.plan(tree, process_count, is_primary, own_copy)
  # Each piece's ShardData, by (leaf number, piece number), filled below.
  done: dict[tuple[int, int], ShardData] = {}

  # Onto pinned host memory: one batched copy, not awaited (see `pinned`).
  if pinned_staging is not None:
    todo = _to_pin(plans, pinned_staging)
    copies = pinned_staging.copy([p.cut() for *_, p in todo]) if todo else []
    for (i, j, p), copy in zip(todo, copies or ()):
      done[i, j] = ShardData(p.index, copy, np.dtype(plans[i].arr.dtype))

  # Off the CPU, the rest: every device-to-host transfer is started before
  # the first is waited for.
  rest = [(i, j, p, p.device.platform == "cpu") for i, leaf in
          enumerate(plans) if leaf.arr is not None
          for j, p in enumerate(leaf.pieces) if (i, j) not in done]
  transfers = [(i, j, p.index, p.cut()) for i, j, p, on_cpu in rest
               if not on_cpu]
  for *_, data in transfers:
    data.copy_to_host_async()

  # CPU shards: copied on their devices into staging memory (enqueued, not
  # awaited), or, for dtypes that cannot travel as unsigned bits and for
  # every dtype where the staging memory is an arena (`memfile`), copied
  # by threads from views of the runtime's buffers right here. A part of a
  # shard is cut by a slice into memory of its own, which the writer waits
  # for.
  on_device, cpu_items = [], []
  for i, j, p, on_cpu in rest:
    if not on_cpu:
      continue
    dtype = np.dtype(plans[i].arr.dtype)
    if p.rows is not None:
      done[i, j] = ShardData(p.index, p.cut(), dtype)
    elif bits_dtype(dtype) is not None and staging.arena is None:
      on_device.append((i, j, p))
    else:
      cpu_items.append((i, j, p))
  srcs = [((plans[i].path, p.index), np.asarray(p.data))
          for i, _, p in cpu_items]
  summed = None if staging.arena is None else staging.copy_summed(
      [src for _, src in srcs], CHECKSUM_BLOCK)
  if summed is None:
    for (i, j, p), copy in zip(cpu_items, staging.copy(srcs)):
      done[i, j] = ShardData(p.index, copy)
  else:
    for (i, j, p), copy, sums in zip(cpu_items, *summed):
      done[i, j] = ShardData(p.index, copy, crc32c=sums)
  del srcs  # No view of a runtime buffer outlives this call.

  for i, j, index, data in transfers:
    done[i, j] = ShardData(index, _c_order(np.asarray(data)))

  out = []
  for i, leaf in enumerate(plans):
    if leaf.arr is None:
      out.append(_host_leaf(leaf.path, leaf.keys, leaf.leaf, is_primary))
      continue
    out.append(LeafSnapshot(
        leaf.path, leaf.keys, "array", _dtype_name(leaf.arr.dtype),
        tuple(leaf.arr.shape),
        [done.get((i, j)) for j in range(len(leaf.pieces))],
        key_impl=leaf.impl))
  # The staging copies last: the runtime's threads start copying at once,
  # on every core, and the call should be over by then; all that is left
  # to do after them is worked out before.
  places = [(out[i].shards, j, p.index, np.dtype(plans[i].arr.dtype))
            for i, j, p in on_device]
  srcs = [p.data for *_, p in on_device]
  devices = [p.device for *_, p in on_device]
  for (shards, j, index, dtype), copy in zip(
      places, staging.copy_on_devices(srcs, devices)):
    shards[j] = ShardData(index, copy, dtype)
  return out


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: np.dtype) -> str:
  return str(dtype)  # Slow in numpy; called per leaf per save.


def _c_order(arr: np.ndarray) -> np.ndarray:
  # Not np.ascontiguousarray: it turns 0-d arrays into shape (1,).
  return arr if arr.flags.c_contiguous else np.array(arr, order="C")


def _host_leaf(path: str, keys: list[KeyEntry], leaf: Any,
               is_primary: bool) -> LeafSnapshot:
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
