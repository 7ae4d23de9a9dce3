"""A consistent host copy of a pytree: the only blocking part of a save.

Each process keeps only the shards it writes: replica 0 of its addressable
shards of every global `jax.Array`. Host-local values (numpy arrays and Python
scalars, and `jax.Array`s that are fully addressable while several processes
run) are the same on every process by contract, so only the primary host
writes their bytes.

The snapshot stays correct when the next train step donates the state's
buffers: on the CPU backend a numpy view keeps the runtime's buffer alive (the
runtime then declines the donation and allocates new output instead, so the
view costs no copy); on accelerators every shard is copied to host memory,
with all transfers started before the first one is awaited.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

KeyEntry = dict[str, Any]
Index = tuple[tuple[int, int], ...]


def key_entry(key: Any) -> KeyEntry:
  """A JSON form of one `jax.tree_util` key path entry."""
  if isinstance(key, jax.tree_util.DictKey):
    k = key.key
    if isinstance(k, bool) or not isinstance(k, (str, int)):
      raise TypeError(
          f"dict key {k!r} of type {type(k).__name__} cannot be saved: only"
          " str and int dict keys are supported.")
    return {"dict": k}
  if isinstance(key, jax.tree_util.GetAttrKey):
    return {"attr": key.name}
  if isinstance(key, jax.tree_util.SequenceKey):
    return {"seq": key.idx}
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return {"flat": key.key}
  raise TypeError(f"unsupported pytree key {key!r}")


def path_string(keys: Sequence[KeyEntry]) -> str:
  """'params/dense_1/kernel': how errors and the manifest name a leaf."""
  return "/".join(str(next(iter(k.values()))) for k in keys) or "<root>"


def leaf_paths(tree: Any) -> tuple[list[tuple[str, list[KeyEntry], Any]], Any]:
  """(path string, JSON keys, leaf) for every leaf, and the treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out = []
  seen: dict[str, Any] = {}
  for keypath, leaf in flat:
    keys = [key_entry(k) for k in keypath]
    path = path_string(keys)
    if path in seen:
      # E.g. {'a/b': x, 'a': {'b': y}}: one name for two leaves would lose one.
      raise ValueError(
          f"two leaves have the same path {path!r}:"
          f" {jax.tree_util.keystr(seen[path])} and"
          f" {jax.tree_util.keystr(keypath)}; rename a key (keys may not"
          " contain '/' where that makes them clash).")
    seen[path] = keypath
    out.append((path, keys, leaf))
  return out, treedef


def normalize_index(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
  """Slices of a shard into ((start, stop), ...) over the global shape."""
  out = []
  for sl, dim in zip(index, shape):
    start, stop, step = sl.indices(dim)
    if step != 1:
      raise ValueError(f"strided shard index {index} is not supported")
    out.append((start, stop))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class ShardData:
  index: Index  # [start, stop) per dimension of the global array.
  data: np.ndarray  # C-contiguous host array of the shard's values.


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


def _is_prng_key(x: Any) -> bool:
  return jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key)


def _check_array_alive(path: str, arr: jax.Array) -> None:
  if arr.is_deleted():
    raise ValueError(
        f"leaf {path!r} of the state to save was deleted (donated to a"
        " jitted step before save was called?). Save the state that the step"
        " returned, before passing it to the next step.")


def _owned_shards(arr: jax.Array, *, single_writer: bool,
                  is_primary: bool) -> list[Any]:
  if single_writer and not is_primary:
    return []
  return [s for s in arr.addressable_shards if s.replica_id == 0]


def take_snapshot(tree: Any, *, process_count: int,
                  is_primary: bool) -> list[LeafSnapshot]:
  """Copies (or, on CPU, pins) the shards this process writes.

  Args:
    tree: the state to save (e.g. a Flax `TrainState`).
    process_count: number of JAX processes.
    is_primary: whether this process writes host-local values.

  Returns:
    One `LeafSnapshot` per leaf, in flattening order, on every process (so
    every process knows the whole tree's metadata).
  """
  leaves, _ = leaf_paths(tree)
  plans = []  # (path, keys, leaf, array to write or None, shards)
  for path, keys, leaf in leaves:
    if isinstance(leaf, jax.Array):
      _check_array_alive(path, leaf)
      arr, impl = leaf, None
      if _is_prng_key(leaf):
        impl = str(jax.random.key_impl(leaf))
        arr = jax.random.key_data(leaf)
      single = process_count > 1 and arr.is_fully_addressable
      shards = _owned_shards(arr, single_writer=single, is_primary=is_primary)
      plans.append((path, keys, leaf, arr, impl, shards))
    else:
      plans.append((path, keys, leaf, None, None, None))

  # Start every device-to-host transfer before waiting on any of them.
  for *_, arr, _, shards in plans:
    if shards:
      for s in shards:
        if s.device.platform != "cpu":
          s.data.copy_to_host_async()

  out = []
  for path, keys, leaf, arr, impl, shards in plans:
    if arr is not None:
      data = [ShardData(normalize_index(s.index, arr.shape),
                        _c_order(np.asarray(s.data))) for s in shards]
      out.append(LeafSnapshot(path, keys, "array", str(arr.dtype),
                              tuple(arr.shape), data, key_impl=impl))
    else:
      out.append(_host_leaf(path, keys, leaf, is_primary))
  return out


def _c_order(arr: np.ndarray) -> np.ndarray:
  # Not np.ascontiguousarray: it turns 0-d arrays into shape (1,).
  return arr if arr.flags.c_contiguous else np.array(arr, order="C")


def _host_leaf(path: str, keys: list[KeyEntry], leaf: Any,
               is_primary: bool) -> LeafSnapshot:
  if isinstance(leaf, (np.ndarray, np.generic)):
    arr = np.asarray(leaf)
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
