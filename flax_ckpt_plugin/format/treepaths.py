"""Leaves of a pytree by key path: how the manifest and errors name them.

`leaf_paths` flattens a tree (a Flax `TrainState`, an NNX state, nested dicts)
into ('params/dense_1/kernel', JSON keys, leaf) triples; `normalize_index`
turns a shard's slices into the [start, stop) pairs the manifest records.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Mapping, Sequence

import jax

KeyEntry = dict[str, Any]
Index = tuple[tuple[int, int], ...]


def extents(index: Index) -> tuple[int, ...]:
  """The shape of the block of an array at `index`."""
  return tuple(stop - start for start, stop in index)


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


# Paths of the trees flattened lately, by treedef: a train loop saves the
# same structure every time, and naming thousands of leaves costs more than
# flattening them (0.1 s at 5000 leaves).
_PATHS: collections.OrderedDict[Any, list[tuple[str, list[KeyEntry]]]] = (
    collections.OrderedDict())
_PATHS_LOCK = threading.Lock()
_PATHS_KEPT = 8


def leaf_paths(tree: Any) -> tuple[list[tuple[str, list[KeyEntry], Any]], Any]:
  """(path string, JSON keys, leaf) for every leaf, and the treedef.

  The key lists are shared between calls on the same structure: read them,
  never change them.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  try:
    hash(treedef)
  except TypeError:  # A node's static data that cannot be hashed.
    return _name_leaves(tree), treedef
  with _PATHS_LOCK:
    named = _PATHS.get(treedef)
    if named is not None:
      _PATHS.move_to_end(treedef)
  if named is None:
    named = [(path, keys) for path, keys, _ in _name_leaves(tree)]
    with _PATHS_LOCK:
      _PATHS[treedef] = named
      while len(_PATHS) > _PATHS_KEPT:
        _PATHS.popitem(last=False)
  return [(path, keys, leaf) for (path, keys), leaf in zip(named, leaves)
          ], treedef


def _name_leaves(tree: Any) -> list[tuple[str, list[KeyEntry], Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
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
  return out


@functools.lru_cache(maxsize=4096)
def shard_plan(sharding: Any, shape: tuple[int, ...]
               ) -> Mapping[Any, tuple[Index, int]]:
  """Per device of `sharding`: its shard's index and replica id.

  Replica ids count the devices holding the same index, in the sharding's
  device order, so every process agrees on which copy is replica 0. Cached:
  computing them per shard costs 30 us, per leaf per save.
  """
  out, seen = {}, collections.Counter()
  for device, index in sharding.devices_indices_map(shape).items():
    region = normalize_index(index, shape)
    out[device] = (region, seen[region])
    seen[region] += 1
  return out


def normalize_index(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
  """Slices of a shard into ((start, stop), ...) over the global shape."""
  out = []
  for sl, dim in zip(index, shape):
    start, stop, step = sl.indices(dim)
    if step != 1:
      raise ValueError(f"strided shard index {index} is not supported")
    out.append((start, stop))
  return tuple(out)

