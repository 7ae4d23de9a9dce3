"""Restore a step into a target pytree, on the target's devices and shardings.

The target is a concrete pytree (e.g. a Flax `TrainState` as created at start)
or an abstract one from `jax.eval_shape`, whose `jax.ShapeDtypeStruct` leaves
may carry `sharding=`. The result has the target's tree type, so non-array
parts of a `TrainState` (`apply_fn`, `tx`) come from the target. Each process
reads only the byte ranges that its addressable target shards need, so a
checkpoint written by any number of devices can be read by any other.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from etils import epath
import jax
import numpy as np

from flax_ckpt_plugin import storage
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import StructureMismatchError
from flax_ckpt_plugin.snapshot import Index
from flax_ckpt_plugin.snapshot import leaf_paths
from flax_ckpt_plugin.snapshot import normalize_index

# Past this many runs of fewer than this many bytes, one saved shard's part
# is read as whole rows of its first axis: a few larger reads beat many tiny.
_MAX_RUNS = 4096
_SMALL_RUN = 64 << 10


def _describe(dtype: Any, shape: Sequence[int]) -> str:
  return f"{np.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def _describe_saved(leaf: dict) -> str:
  if leaf["kind"] in ("int", "float", "bool"):
    return f"Python {leaf['kind']} {leaf['value']!r}"
  desc = _describe(storage.parse_dtype(leaf["dtype"], leaf["path"]),
                   leaf["shape"])
  if "key_impl" in leaf:
    desc += f" (key data of PRNG impl {leaf['key_impl']})"
  return desc


def _match_structure(saved: dict[str, dict], target_paths: list[str],
                     step_dir: epath.Path) -> None:
  missing = [p for p in target_paths if p not in saved]
  unexpected = sorted(set(saved) - set(target_paths))
  if not missing and not unexpected:
    return
  parts = []
  if missing:
    parts.append(f"target leaves not in the checkpoint: {missing[:10]}"
                 + (f" and {len(missing) - 10} more" if len(missing) > 10
                    else ""))
  if unexpected:
    parts.append(f"checkpoint leaves not in the target: {unexpected[:10]}"
                 + (f" and {len(unexpected) - 10} more"
                    if len(unexpected) > 10 else ""))
  raise StructureMismatchError(
      f"the tree in {step_dir} does not match the restore target; "
      + "; ".join(parts))


def _intersect(a: Index, b: Index) -> Index | None:
  out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
  if any(lo >= hi for lo, hi in out):
    return None
  return out


class _LeafReader:
  """Assembles regions of one saved array leaf from its shards."""

  def __init__(self, reader: storage.ByteReader, leaf: dict, where: str):
    self._reader = reader
    self._leaf = leaf
    self._where = where
    self.dtype = storage.parse_dtype(leaf["dtype"], where)
    self.shape = tuple(leaf["shape"])
    self._shards = [(tuple(tuple(r) for r in s["index"]), s)
                    for s in leaf["shards"]]

  def read(self, region: Index) -> np.ndarray:
    """The values of `region` of the global array, as a new numpy array."""
    out = np.empty([hi - lo for lo, hi in region], dtype=self.dtype)
    filled = 0
    for index, shard in self._shards:
      inter = _intersect(index, region) if region else ()
      if inter is None:
        continue
      filled += math.prod(hi - lo for lo, hi in inter)
      self._read_part(index, shard, inter, region, out)
    if filled != out.size:
      raise CheckpointCorruptedError(
          f"{self._where}: shards cover {filled} of the {out.size} elements"
          f" of region {region}")
    return out

  def _read_part(self, index: Index, shard: dict, inter: Index,
                 region: Index, out: np.ndarray) -> None:
    """Copies the part `inter` of a saved shard at `index` into `out`.

    Reads exactly the bytes of `inter`: in C order they form runs that are
    contiguous in the file, one per combination of the axes before the last
    axis that `inter` does not span whole. Layouts that would need very many
    tiny reads read the covering rows of the first axis instead.
    """
    shape = [hi - lo for lo, hi in index]
    local = [(lo - i0, hi - i0) for (lo, hi), (i0, _) in zip(inter, index)]
    # Axes after `k` are spanned whole, so each run covers axis k's part.
    k = len(shape) - 1
    while k > 0 and local[k] == (0, shape[k]):
      k -= 1
    strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    runs = math.prod(hi - lo for lo, hi in local[:k]) if shape else 1
    run_elems = ((local[k][1] - local[k][0]) * strides[k]) if shape else 1
    if runs > _MAX_RUNS and run_elems * self.dtype.itemsize < _SMALL_RUN:
      local = [local[0]] + [(0, d) for d in shape[1:]]
      k, runs = 0, 1
      run_elems = (local[0][1] - local[0][0]) * strides[0]
    part_shape = [hi - lo for lo, hi in local]
    direct = inter == region and part_shape == list(out.shape)
    part = out if direct else np.empty(part_shape, dtype=self.dtype)
    flat = memoryview(part.reshape(-1).view(np.uint8))
    run_bytes = run_elems * self.dtype.itemsize
    first = sum(lo * st for (lo, _), st in zip(local, strides))
    for n, idx in enumerate(itertools.product(
        *(range(hi - lo) for lo, hi in local[:k]))):
      elem = first + sum(i * st for i, st in zip(idx, strides))
      self._reader.read_into(
          shard["file"], shard["offset"] + elem * self.dtype.itemsize,
          flat[n * run_bytes:(n + 1) * run_bytes])
    if direct:
      return
    src = tuple(slice(lo - l0, hi - l0) for (lo, hi), (l0, _) in
                zip([(a - i0, b - i0) for (a, b), (i0, _) in zip(inter, index)],
                    local))
    dst = tuple(slice(lo - g0, hi - g0)
                for (lo, hi), (g0, _) in zip(inter, region))
    out[dst] = part[src]


def _target_sharding(leaf: Any) -> jax.sharding.Sharding:
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return sharding


def _restore_array(lr: _LeafReader, shape: tuple[int, ...],
                   sharding: jax.sharding.Sharding) -> jax.Array:
  indices = sharding.addressable_devices_indices_map(shape)
  cache: dict[Index, np.ndarray] = {}
  arrays = []
  for device, index in indices.items():
    region = normalize_index(index, shape) if index is not None else tuple(
        (0, d) for d in shape)
    host = cache.get(region)
    if host is None:
      host = cache[region] = lr.read(region)
    arrays.append(jax.device_put(host, device))
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _check_compatible(path: str, saved: dict, target: Any) -> None:
  """Raises StructureMismatchError when shape or dtype differ."""
  if saved["kind"] in ("int", "float", "bool"):
    shape, dtype = (), None
  else:
    shape = tuple(saved["shape"])
    dtype = storage.parse_dtype(saved["dtype"], path)
  if isinstance(target, (bool, int, float)):
    if shape != ():
      raise StructureMismatchError(
          f"leaf {path!r}: checkpoint has {_describe_saved(saved)}, target"
          f" has Python {type(target).__name__}")
    return
  t_dtype = target.dtype
  is_key = jax.numpy.issubdtype(t_dtype, jax.dtypes.prng_key)
  if is_key != ("key_impl" in saved):
    raise StructureMismatchError(
        f"leaf {path!r}: checkpoint has {_describe_saved(saved)}, target has"
        f" {t_dtype}")
  if is_key:
    t_shape = tuple(jax.eval_shape(jax.random.key_data, target).shape)
    t_desc = f"{t_dtype}{list(target.shape)}"
  else:
    t_shape = tuple(np.shape(target))
    t_desc = _describe(t_dtype, t_shape)
  if dtype is None:  # A Python scalar saved; an array of shape () wanted.
    ok = t_shape == () and not is_key
  else:
    ok = t_shape == shape and (is_key or np.dtype(t_dtype) == dtype)
  if not ok:
    raise StructureMismatchError(
        f"leaf {path!r}: checkpoint has {_describe_saved(saved)}, target has"
        f" {t_desc}")


def _restore_leaf(path: str, saved: dict, target: Any,
                  reader: storage.ByteReader, where: str) -> Any:
  _check_compatible(path, saved, target)
  if saved["kind"] in ("int", "float", "bool"):
    value = saved["value"]
    if isinstance(target, (bool, int, float)):
      return type(target)(value)
    host = np.asarray(value, dtype=target.dtype)
    if isinstance(target, np.ndarray | np.generic):
      return host if isinstance(target, np.ndarray) else host[()]
    return jax.device_put(host, _target_sharding(target))
  lr = _LeafReader(reader, saved, f"{where}, leaf {path!r}")
  whole = tuple((0, d) for d in lr.shape)
  if isinstance(target, (bool, int, float)):
    return type(target)(lr.read(whole)[()].item())
  if isinstance(target, np.ndarray):
    return lr.read(whole)
  if isinstance(target, np.generic):
    return lr.read(whole)[()]
  sharding = _target_sharding(target)
  if "key_impl" in saved:
    data = lr.read(whole)
    keys = jax.random.wrap_key_data(data, impl=saved["key_impl"])
    return jax.device_put(keys, sharding)
  return _restore_array(lr, lr.shape, sharding)


def restore_tree(step_dir: epath.Path, manifest: dict,
                 target: Any) -> tuple[Any, int]:
  """Builds a pytree like `target` from the step at `step_dir`.

  Returns:
    The pytree, and the number of bytes this process read from data files.

  Raises:
    StructureMismatchError: leaf paths, shapes or dtypes differ; the message
      names the leaf and both sides.
    CheckpointCorruptedError: data files are missing, short or inconsistent.
  """
  saved = {leaf["path"]: leaf for leaf in manifest["leaves"]}
  targets, treedef = leaf_paths(target)
  _match_structure(saved, [p for p, _, _ in targets], step_dir)
  reader = storage.ByteReader(step_dir, manifest["files"])
  try:
    leaves = [_restore_leaf(path, saved[path], leaf, reader,
                            str(step_dir / storage.MANIFEST))
              for path, _, leaf in targets]
  finally:
    reader.close()
  return jax.tree_util.tree_unflatten(treedef, leaves), reader.bytes_read
