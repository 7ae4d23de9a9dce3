"""The pieces of a state that this process writes at a save.

Per leaf: every distinct shard this process holds (a copy for it alone:
the local tier), or the whole value on the primary (an array of this
process's own, the same everywhere), or the shards and row ranges of them
that `writeplan` gives this process (arrays that several processes hold).
What depends only on the tree's layout (its structure, and each array's
shape, dtype and sharding) is worked out once per layout and cached; each
save only fills in the state's arrays. A train loop saves one layout again
and again, and working it out costs per leaf what the save call should not
pay each time (`jax.Array.addressable_shards` alone: about 10 us).
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

from flax_ckpt_plugin.save import writeplan
from flax_ckpt_plugin.format.treepaths import Index
from flax_ckpt_plugin.format.treepaths import KeyEntry
from flax_ckpt_plugin.format.treepaths import leaf_paths
from flax_ckpt_plugin.format.treepaths import shard_plan


@functools.lru_cache(maxsize=None)  # Per leaf per save: keep it cheap.
def _is_prng_dtype(dtype: Any) -> bool:
  return jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


def _check_array_alive(path: str, arr: jax.Array) -> None:
  if arr.is_deleted():
    raise ValueError(
        f"leaf {path!r} of the state to save was deleted (donated to a"
        " jitted step before save was called?). Save the state that the step"
        " returned, before passing it to the next step.")


class Piece(NamedTuple):
  """A shard, or rows of it, that this process writes."""
  index: Index  # Its place in the global array.
  data: jax.Array  # The shard, on one device.
  device: Any
  rows: tuple[int, int] | None  # [start, stop) of its first axis; None: all.

  @property
  def nbytes(self) -> int:
    if self.rows is None:
      return self.data.nbytes
    start, stop = self.rows
    return self.data.nbytes // max(1, self.data.shape[0]) * (stop - start)

  def cut(self) -> jax.Array:
    """The piece as an array of its own. A part of a shard is cut on its
    device by a slice, which the runtime runs before the next step, into
    memory of its own: the donation of the state's buffers stays safe."""
    if self.rows is None:
      return self.data
    return jax.lax.slice_in_dim(self.data, *self.rows)


# Where a piece is: (its shard's place among the array's single-device
# arrays, its index, its device, its rows or None).
_PieceSpec = tuple[int, Index, Any, "tuple[int, int] | None"]


def _own_copy_specs(arr: jax.Array) -> list[_PieceSpec]:
  """Every distinct shard this process holds: a copy for it alone to
  restore from."""
  plan = shard_plan(arr.sharding, arr.shape)
  out, seen = [], set()
  for k, s in enumerate(arr.addressable_shards):
    index, _ = plan[s.device]
    if index not in seen:
      seen.add(index)
      out.append((k, index, s.device, None))
  return out


def _planned_specs(arr: jax.Array, pieces: tuple[writeplan.Piece, ...]
                   ) -> list[_PieceSpec]:
  """The pieces of `arr` that `writeplan` gave this process."""
  if not pieces:
    return []
  place = {s.device: k for k, s in enumerate(arr.addressable_shards)}
  return [(place[p.device], p.index, p.device, p.rows) for p in pieces]


class Leaf(NamedTuple):
  path: str
  keys: list[KeyEntry]
  leaf: Any
  arr: jax.Array | None  # The array to write (a key array's data), if any.
  impl: str | None  # A typed PRNG key array's implementation.
  pieces: list[Piece] | None


class _LeafLayout(NamedTuple):
  """What `_plan` knows of a leaf before looking at its values."""
  impl: str | None
  specs: tuple[_PieceSpec, ...]


# Layouts of the trees saved lately (see the module's docstring).
_LAYOUTS: collections.OrderedDict[Any, list[_LeafLayout | None]] = (
    collections.OrderedDict())
_LAYOUTS_LOCK = threading.Lock()
_LAYOUTS_KEPT = 8


def _single_arrays(arr: jax.Array) -> list[jax.Array]:
  """The array's single-device arrays, in `addressable_shards` order."""
  arrays = getattr(arr, "_arrays", None)  # Without making Shard objects.
  if arrays is None:
    arrays = [s.data for s in arr.addressable_shards]
  return arrays


def _layout(leaves: list[tuple[str, list[KeyEntry], Any]], process_count: int,
            is_primary: bool, own_copy: bool) -> list[_LeafLayout | None]:
  out: list[_LeafLayout | None] = []
  shared = []  # (place in out, array) of the arrays `writeplan` spreads.
  for _, _, leaf in leaves:
    if not isinstance(leaf, jax.Array):
      out.append(None)
      continue
    arr, impl = leaf, None
    if _is_prng_dtype(leaf.dtype):
      impl = str(jax.random.key_impl(leaf))
      arr = jax.random.key_data(leaf)
    specs = None
    if own_copy:
      specs = _own_copy_specs(arr)
    elif process_count > 1 and arr.is_fully_addressable:
      # A value of this process's own, the same on every process by
      # contract: the primary writes it.
      specs = _own_copy_specs(arr) if is_primary else []
    elif jax.process_count() == 1:  # No other process holds any of it.
      specs = _own_copy_specs(arr)
    else:
      shared.append((len(out), arr))
    out.append(_LeafLayout(impl, tuple(specs or ())))
  if shared:
    planned = writeplan.plan(
        tuple((arr.sharding, tuple(arr.shape), np.dtype(arr.dtype))
              for _, arr in shared), jax.process_index(), jax.process_count())
    for (at, arr), mine in zip(shared, planned):
      out[at] = out[at]._replace(specs=tuple(_planned_specs(arr, mine)))
  return out


def plan(tree: Any, process_count: int, is_primary: bool, own_copy: bool
          ) -> list[Leaf]:
  """Every leaf of `tree`, with the pieces of it this process writes."""
  leaves, treedef = leaf_paths(tree)
  sig = []
  for path, _, leaf in leaves:
    if isinstance(leaf, jax.Array):
      _check_array_alive(path, leaf)
      sig.append((leaf.shape, leaf.dtype, leaf.sharding))
    else:
      sig.append(None)
  key = (treedef, tuple(sig), process_count, is_primary, own_copy)
  try:
    hash(key)
  except TypeError:  # Static data of a node that cannot be hashed.
    key = None
  with _LAYOUTS_LOCK:
    layout = _LAYOUTS.get(key) if key is not None else None
    if layout is not None:
      _LAYOUTS.move_to_end(key)
  if layout is None:
    layout = _layout(leaves, process_count, is_primary, own_copy)
    if key is not None:
      with _LAYOUTS_LOCK:
        _LAYOUTS[key] = layout
        while len(_LAYOUTS) > _LAYOUTS_KEPT:
          _LAYOUTS.popitem(last=False)
  out = []
  for (path, keys, leaf), lay in zip(leaves, layout):
    if lay is None:
      out.append(Leaf(path, keys, leaf, None, None, None))
      continue
    arr = leaf if lay.impl is None else jax.random.key_data(leaf)
    arrays = _single_arrays(arr)
    out.append(Leaf(path, keys, leaf, arr, lay.impl,
                     [Piece(index, arrays[k], device, rows)
                      for k, index, device, rows in lay.specs]))
  return out
