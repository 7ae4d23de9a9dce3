"""Leaves of a pytree by key path: how the manifest and errors name them.

`leaf_paths` flattens a tree (a Flax `TrainState`, an NNX state, nested dicts)
into ('params/dense_1/kernel', JSON keys, leaf) triples; `normalize_index`
turns a shard's slices into the [start, stop) pairs the manifest records.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

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

