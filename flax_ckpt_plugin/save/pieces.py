"""The pieces of a state that this process writes at a save.

Per leaf: every distinct shard this process holds (a copy for it alone:
the local tier), or the whole value on the primary (an array of this
process's own, the same everywhere), or the shards and row ranges of them
that `division` gives this process (arrays that several processes hold).
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

from flax_ckpt_plugin.arrays import division
from flax_ckpt_plugin.format.treepaths import Index
from flax_ckpt_plugin.format.treepaths import KeyEntry
from flax_ckpt_plugin.format.treepaths import leaf_paths
from flax_ckpt_plugin.format.treepaths import shard_plan


@functools.lru_cache(maxsize=None)  # Per leaf per save: keep it cheap.
def _is_prng_dtype(dtype: Any) -> bool:
  return jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


class PieceSpec(NamedTuple):
  """Where one piece of an array leaf is, worked out once per layout.

  Attributes:
    shard: the place of the piece's shard among the array's single-device
      arrays (in `addressable_shards` order).
    index: the piece's [start, stop) per dimension of the global array.
    device: the device that holds the shard.
    rows: the [start, stop) of the shard's rows that the piece is, or None:
      all of the shard.
  """
  shard: int
  index: Index
  device: Any
  rows: tuple[int, int] | None


def _own_copy_specs(arr: jax.Array) -> list[PieceSpec]:
  """Every distinct shard this process holds: a copy for it alone to
  restore from."""
  plan = shard_plan(arr.sharding, arr.shape)
  out, seen = [], set()
  for k, s in enumerate(arr.addressable_shards):
    index, _ = plan[s.device]
    if index not in seen:
      seen.add(index)
      out.append(PieceSpec(k, index, s.device, None))
  return out


def _planned_specs(arr: jax.Array, pieces: tuple[division.Piece, ...]
                   ) -> list[PieceSpec]:
  """The pieces of `arr` that `division` gave this process."""
  if not pieces:
    return []
  place = {s.device: k for k, s in enumerate(arr.addressable_shards)}
  return [PieceSpec(place[p.device], p.index, p.device, p.rows)
          for p in pieces]


class LeafLayout(NamedTuple):
  """What a save knows of an array leaf before looking at its values."""
  path: str
  keys: list[KeyEntry]
  dtype: np.dtype  # Of the array written (a key array's data).
  shape: tuple[int, ...]
  weak_type: bool
  single: bool  # On one device, with a `SingleDeviceSharding`.
  impl: str | None  # A typed PRNG key array's implementation.
  specs: tuple[PieceSpec, ...]


class Layout:
  """What saving one layout of a tree takes, worked out at its first save.

  `names[i]` is leaf i's (path, keys); `leaves[i]` its `LeafLayout`, or
  None for a leaf that is not a `jax.Array` (its value is looked at in
  every save: `host` lists them). `memo` keeps what users of the layout
  work out from it once (see `routes`).
  """

  def __init__(self, names: list[tuple[str, list[KeyEntry]]],
               leaves: list[LeafLayout | None]):
    self.names = names
    self.leaves = leaves
    self.host = [i for i, lay in enumerate(leaves) if lay is None]
    self.memo: dict[Any, Any] = {}
    self._lock = threading.Lock()

  def remember(self, key: Any, make) -> Any:
    """`memo[key]`, made by `make()` the first time."""
    with self._lock:
      if key not in self.memo:
        self.memo[key] = make()
      return self.memo[key]


class Plan(NamedTuple):
  """One save's tree: its leaves' values in flattening order, and its
  layout (`routes.Routes.arrays` takes its pieces' arrays)."""
  values: list[Any]
  layout: Layout


# Layouts of the trees saved lately (see the module's docstring).
# By structure: the signature of its arrays, and their layout (the newest
# for that structure).
_LAYOUTS: collections.OrderedDict[Any, tuple[tuple[Any, ...], Layout]] = (
    collections.OrderedDict())
_LAYOUTS_LOCK = threading.Lock()
_LAYOUTS_KEPT = 8


def _layout(leaves: list[tuple[str, list[KeyEntry], Any]], process_count: int,
            is_primary: bool, own_copy: bool) -> Layout:
  out: list[LeafLayout | None] = []
  shared = []  # (place in out, array) of the arrays `division` spreads.
  for path, keys, leaf in leaves:
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
    out.append(LeafLayout(
        path, keys, np.dtype(arr.dtype), tuple(arr.shape), arr.weak_type,
        type(arr.sharding) is jax.sharding.SingleDeviceSharding, impl,
        tuple(specs or ())))
  if shared:
    planned = division.plan(
        tuple((arr.sharding, tuple(arr.shape), np.dtype(arr.dtype))
              for _, arr in shared), jax.process_index(), jax.process_count())
    for (at, arr), mine in zip(shared, planned):
      out[at] = out[at]._replace(specs=tuple(_planned_specs(arr, mine)))
  return Layout([(path, keys) for path, keys, _ in leaves], out)


def plan(tree: Any, process_count: int, is_primary: bool, own_copy: bool
         ) -> Plan:
  """Every leaf of `tree`, with the layout of what this process writes.

  Raises:
    ValueError: an array leaf was deleted (donated before the save).
  """
  values, treedef = jax.tree_util.tree_flatten(tree)
  sig = []
  for value in values:
    if isinstance(value, jax.Array):
      if value.is_deleted():
        _raise_deleted(tree)
      sig.append((value.shape, value.dtype, value.sharding,
                  getattr(value, "weak_type", None)))  # (Key arrays: none.)
    else:
      sig.append(None)
  # Found by the tree's structure, then its arrays compared one by one (a
  # shape, dtype or sharding that is the one saved before is compared by
  # identity): a hash of the whole signature would hash every sharding.
  key = (treedef, process_count, is_primary, own_copy)
  sig = tuple(sig)
  try:
    hash(key)
  except TypeError:  # Static data of a node that cannot be hashed.
    key = None
  # (The oldest layout goes first, used or not: moving a used one to the
  # end would compare treedefs once more, 0.1 ms at 1,500 leaves.)
  with _LAYOUTS_LOCK:
    known = _LAYOUTS.get(key) if key is not None else None
    layout = known[1] if known is not None and known[0] == sig else None
  if layout is None:
    leaves, _ = leaf_paths(tree)
    layout = _layout(leaves, process_count, is_primary, own_copy)
    if key is not None:
      with _LAYOUTS_LOCK:
        _LAYOUTS.pop(key, None)
        _LAYOUTS[key] = (sig, layout)
        while len(_LAYOUTS) > _LAYOUTS_KEPT:
          _LAYOUTS.popitem(last=False)
  return Plan(values, layout)


def _raise_deleted(tree: Any) -> None:
  for path, _, leaf in leaf_paths(tree)[0]:
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      raise ValueError(
          f"leaf {path!r} of the state to save was deleted (donated to a"
          " jitted step before save was called?). Save the state that the"
          " step returned, before passing it to the next step.")
