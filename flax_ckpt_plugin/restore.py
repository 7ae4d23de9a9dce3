"""Restore a step into a target pytree, on the target's devices and shardings.

The target is a concrete pytree (e.g. a Flax `TrainState` as created at start)
or an abstract one from `jax.eval_shape`, whose `jax.ShapeDtypeStruct` leaves
may carry `sharding=`. The result has the target's tree type, so non-array
parts of a `TrainState` (`apply_fn`, `tx`) come from the target. Each process
reads only the byte ranges that its addressable target shards need, so a
checkpoint written by any number of devices can be read by any other.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import itertools
import math
import os
from typing import Any, Sequence

from etils import epath
import jax
from jax import lax
import numpy as np

from flax_ckpt_plugin import storage
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import StructureMismatchError
from flax_ckpt_plugin.snapshot import bits_dtype
from flax_ckpt_plugin.snapshot import Index
from flax_ckpt_plugin.snapshot import leaf_paths
from flax_ckpt_plugin.snapshot import normalize_index

# Past this many runs of fewer than this many bytes, one saved shard's part
# is read as whole rows of its first axis: a few larger reads beat many tiny.
_MAX_RUNS = 4096
_SMALL_RUN = 64 << 10
# Leaves restored at once: reads and checksums release the GIL.
_THREADS = min(8, os.cpu_count() or 1)


def host_buffer(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
  """An uninitialized C-order array whose data starts on a 64-byte boundary.

  The CPU backend adopts such memory in `jax.device_put` without copying it
  (numpy's own allocations are only 16-byte aligned and would be copied).
  Restored CPU arrays are not made this way, but by the runtime (see
  `_owned_cpu_buffer`); this is for numpy targets and the other cases.
  """
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  start = -raw.ctypes.data % 64
  return raw[start:start + nbytes].view(dtype).reshape(shape)


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
  """Assembles regions of one saved array leaf from its shards.

  With `verify`, every byte that reaches the result comes from a checksum
  block that was read whole and matched its CRC-32C: a shard read whole is
  checked in place; a part of a shard is read as the span of whole blocks
  around it. Without `verify`, exactly the needed bytes are read.
  """

  def __init__(self, *, reader: storage.ByteReader, saved: dict,
               leaf_path: str, where: str, verify: bool, block: int):
    self._reader = reader
    self._where = f"{where}, leaf {leaf_path!r}"
    self._verify = verify
    self._block = block
    self.dtype = storage.parse_dtype(saved["dtype"], self._where)
    self.shape = tuple(saved["shape"])
    self._shards = [(tuple(tuple(r) for r in s["index"]), s)
                    for s in saved["shards"]]
    # Per shard: a buffer of its bytes (pages touched only where read) and the
    # blocks in it already read and checked, so no block is read twice.
    self._verified: dict[int, tuple[np.ndarray, set[int]]] = {}
    self._edges: dict[tuple[int, int], memoryview] = {}  # (shard, block).

  def read(self, region: Index, out: np.ndarray | None = None) -> np.ndarray:
    """The values of `region` of the global array, in `out` or a new array.

    `out`, when given, is a writable C-order array of the region's shape
    and of this leaf's dtype.
    """
    try:
      return self._read(region, out)
    except CheckpointCorruptedError as e:
      if str(e).startswith(self._where):
        raise
      raise CheckpointCorruptedError(f"{self._where}: {e}") from e

  def _read(self, region: Index, out: np.ndarray | None) -> np.ndarray:
    if out is None:
      out = host_buffer([hi - lo for lo, hi in region], self.dtype)
    filled = 0
    for n, (index, shard) in enumerate(self._shards):
      inter = _intersect(index, region) if region else ()
      if inter is None:
        continue
      filled += math.prod(hi - lo for lo, hi in inter)
      self._read_part(n, index, shard, inter, region, out)
    if filled != out.size:
      raise CheckpointCorruptedError(
          f"{self._where}: shards cover {filled} of the {out.size} elements"
          f" of region {region}")
    return out

  def _check(self, shard: dict, first_block: int, data: memoryview) -> None:
    """Compares the blocks in `data` (from block `first_block`) to the sums."""
    expected = shard["crc32c"][first_block:]
    actual = storage.block_checksums(data, self._block)
    for n, (want, got) in enumerate(zip(expected, actual)):
      if want != got:
        lo = (first_block + n) * self._block
        hi = min(lo + self._block, shard["nbytes"])
        raise CheckpointCorruptedError(
            f"{self._where}: checksum mismatch in {shard['file']} at bytes"
            f" [{shard['offset'] + lo}, {shard['offset'] + hi}) (shard"
            f" {shard['index']}): crc32c {got:#010x}, manifest says"
            f" {want:#010x}. The file was damaged after it was written.")

  def _runs(self, index: Index, inter: Index) -> tuple[list[int], int, Index]:
    """Byte offsets (in the shard) of the runs that hold `inter`.

    In C order the part `inter` of a shard is a set of runs contiguous in the
    file, one per combination of the axes before the last axis that `inter`
    does not span whole. Layouts that would need very many tiny runs take
    whole rows of the first axis instead.

    Returns:
      The runs' byte offsets, the bytes per run, and the part of the shard
      (shard-local [start, stop) per axis) that the runs hold.
    """
    shape = [hi - lo for lo, hi in index]
    local = [(lo - i0, hi - i0) for (lo, hi), (i0, _) in zip(inter, index)]
    if not shape:
      return [0], self.dtype.itemsize, ()
    k = len(shape) - 1
    while k > 0 and local[k] == (0, shape[k]):
      k -= 1
    strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    run_elems = (local[k][1] - local[k][0]) * strides[k]
    runs = math.prod(hi - lo for lo, hi in local[:k])
    if runs > _MAX_RUNS and run_elems * self.dtype.itemsize < _SMALL_RUN:
      local = [local[0]] + [(0, d) for d in shape[1:]]
      k, run_elems = 0, (local[0][1] - local[0][0]) * strides[0]
    first = sum(lo * st for (lo, _), st in zip(local, strides))
    item = self.dtype.itemsize
    offsets = [(first + sum(i * st for i, st in zip(idx, strides))) * item
               for idx in itertools.product(
                   *(range(hi - lo) for lo, hi in local[:k]))]
    return offsets, run_elems * item, tuple(local)

  def _read_range_verified(self, n: int, shard: dict, lo: int,
                           dest: memoryview) -> None:
    """Fills `dest` with shard `n`'s bytes from `lo`, checking every block.

    Blocks inside the range are read straight into `dest` and checked
    there; only the (at most two) blocks at its edges go through scratch,
    kept for the neighbouring region that needs the rest of them.
    """
    hi, block = lo + len(dest), self._block
    name, base = shard["file"], shard["offset"]
    # Whole blocks inside [lo, hi); the shard's last block may be short.
    inner_lo = -(-lo // block) * block
    inner_hi = hi if hi == shard["nbytes"] else hi // block * block
    inner_hi = max(inner_lo, inner_hi)
    if inner_lo < inner_hi:
      view = dest[inner_lo - lo:inner_hi - lo]
      self._reader.read_into(name, base + inner_lo, view)
      self._check(shard, inner_lo // block, view)
    for k in {lo // block, (hi - 1) // block}:
      a, b = k * block, min((k + 1) * block, shard["nbytes"])
      if inner_lo <= a and b <= inner_hi:
        continue  # Read whole above.
      scratch = self._edges.get((n, k))
      if scratch is None:
        scratch = memoryview(np.empty(b - a, np.uint8))
        self._reader.read_into(name, base + a, scratch)
        self._check(shard, k, scratch)
        self._edges[(n, k)] = scratch
      s, e = max(a, lo), min(b, hi)
      dest[s - lo:e - lo] = scratch[s - a:e - a]

  def _verified_bytes(self, n: int, shard: dict, lo: int,
                      hi: int) -> memoryview:
    """Shard `n` as bytes, with at least [lo, hi) read in whole blocks.

    The blocks are checked when `verify` is set. Each block is read once
    for all the regions of this leaf that need it.
    """
    if n not in self._verified:
      self._verified[n] = (np.empty(shard["nbytes"], np.uint8), set())
    buf, done = self._verified[n]
    view = memoryview(buf)
    block, k, end = self._block, lo // self._block, -(-hi // self._block)
    while k < end:
      if k in done:
        k += 1
        continue
      j = k
      while j < end and j not in done:
        j += 1
      a, b = k * block, min(j * block, shard["nbytes"])
      self._reader.read_into(shard["file"], shard["offset"] + a, view[a:b])
      if self._verify:
        self._check(shard, k, view[a:b])
      done.update(range(k, j))
      k = j
    return view

  def _read_part(self, n: int, index: Index, shard: dict, inter: Index,
                 region: Index, out: np.ndarray) -> None:
    """Copies the part `inter` of a saved shard at `index` into `out`."""
    offsets, run_bytes, local = self._runs(index, inter)
    part_shape = [hi - lo for lo, hi in local]
    direct = inter == region and part_shape == list(out.shape)
    part = out if direct else np.empty(part_shape, dtype=self.dtype)
    flat = memoryview(part.reshape(-1).view(np.uint8))
    name, base = shard["file"], shard["offset"]
    whole = run_bytes * len(offsets) == shard["nbytes"]
    # Exactly the runs, one read each; but where a read is a request (object
    # stores), many runs are fetched as the blocks around them instead.
    exact = not self._verify and (len(offsets) == 1
                                  or not self._reader.prefers_few_reads)
    if exact or whole:
      for r, off in enumerate(offsets):
        self._reader.read_into(name, base + off,
                               flat[r * run_bytes:(r + 1) * run_bytes])
      if self._verify:  # Read whole: check it where it lies.
        self._check(shard, 0, flat)
    elif len(offsets) == 1:
      self._read_range_verified(n, shard, offsets[0], flat[:run_bytes])
    else:
      # Whole (checked) blocks: copy the runs out of them.
      src = self._verified_bytes(n, shard, offsets[0], offsets[-1] + run_bytes)
      for r, off in enumerate(offsets):
        flat[r * run_bytes:(r + 1) * run_bytes] = src[off:off + run_bytes]
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


def _on_context_mesh(path: str, leaf: Any) -> Any:
  """`leaf`, with a sharding over an `AbstractMesh` put on the set mesh.

  `nnx.eval_shape` (or `jax.eval_shape`) under `jax.set_mesh(mesh)` gives
  `ShapeDtypeStruct`s whose `NamedSharding` names only an abstract mesh. The
  devices are those of the mesh set by the caller, which only the caller's
  thread sees (not the threads that restore leaves): so it is looked up here.
  """
  sharding = getattr(leaf, "sharding", None)
  abstract = getattr(jax.sharding, "AbstractMesh", ())  # Not in older jax.
  if not (isinstance(sharding, jax.sharding.NamedSharding)
          and isinstance(sharding.mesh, abstract)):
    return leaf
  get_mesh = getattr(jax.sharding, "get_mesh", None)
  mesh = get_mesh() if get_mesh else None
  if (mesh is None or mesh.empty
      or mesh.shape_tuple != sharding.mesh.shape_tuple):
    found = ("no mesh is set" if mesh is None or mesh.empty
             else f"the mesh set is {mesh}")
    raise ValueError(
        f"leaf {path!r}: the target's sharding is over an abstract mesh"
        f" {sharding.mesh} and {found}. Restore inside `with"
        " jax.set_mesh(mesh)` with the mesh of that shape, or give the target"
        " shardings over a concrete `jax.sharding.Mesh` (for Flax NNX:"
        " `nnx.get_named_sharding(abstract_state, mesh)`).")
  return leaf.update(sharding=jax.sharding.NamedSharding(
      mesh, sharding.spec, memory_kind=sharding.memory_kind))


@functools.lru_cache(maxsize=None)
def _zeros_on(device: Any) -> Any:
  """A jitted `zeros(shape, dtype)` whose result is placed on `device`."""
  # A constant zero (not a parameter) lets the compiler emit a memset.
  return jax.jit(lambda shape, dtype: lax.full(shape, 0, dtype),
                 static_argnums=(0, 1),
                 out_shardings=jax.sharding.SingleDeviceSharding(device))


def _owned_cpu_buffer(shape: tuple[int, ...], dtype: np.dtype, device: Any
                      ) -> tuple[jax.Array, np.ndarray] | None:
  """A new CPU device array that the runtime owns, and a writable view of it.

  Memory that `jax.device_put` adopts (aligned numpy memory, or the copy
  that `may_alias=False` makes) cannot be donated: the first jitted step
  that donates a restored state would then copy every input into new
  memory, with both states alive at once (measured with a 0.98 GB state:
  that step took 1.3 s instead of 0.47 s). So the array is made by
  a jitted program (which fills it with zeros), and its bytes are then
  written in place, through a view of its buffer: the array is new, ready,
  and referenced by nothing else until it is returned. None where this
  does not apply (other platforms, and dtypes whose elements are not whole
  bytes, which the runtime may pack).
  """
  if device.platform != "cpu" or (
      bits_dtype(dtype) is None
      and not jax.numpy.issubdtype(dtype, jax.numpy.complexfloating)):
    return None
  arr = _zeros_on(device)(shape, dtype)
  arr.block_until_ready()
  nbytes = arr.nbytes
  if not nbytes:
    return arr, np.empty(shape, dtype)
  mem = (ctypes.c_char * nbytes).from_address(arr.unsafe_buffer_pointer())
  return arr, np.frombuffer(mem, dtype).reshape(shape)


def _restore_array(lr: _LeafReader, shape: tuple[int, ...],
                   sharding: jax.sharding.Sharding) -> jax.Array:
  indices = sharding.addressable_devices_indices_map(shape)
  cache: dict[Index, np.ndarray] = {}
  arrays = []
  for device, index in indices.items():
    region = normalize_index(index, shape) if index is not None else tuple(
        (0, d) for d in shape)
    host = cache.get(region)
    owned = _owned_cpu_buffer(tuple(hi - lo for lo, hi in region), lr.dtype,
                              device)
    if owned is not None:
      arr, view = owned
      if host is None:
        cache[region] = lr.read(region, out=view)
      else:
        np.copyto(view, host)
      arrays.append(arr)
      continue
    if host is None:
      host = cache[region] = lr.read(region)
    else:
      # Read once, but never hand one host buffer to two devices: the CPU
      # backend adopts the memory, and a jitted step that donates one replica
      # could then write over the other.
      copy = host_buffer(host.shape, host.dtype)
      np.copyto(copy, host)
      host = copy
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


def _restore_leaf(path: str, saved: dict, target: Any, lr_args: dict) -> Any:
  _check_compatible(path, saved, target)
  if saved["kind"] in ("int", "float", "bool"):
    value = saved["value"]
    if isinstance(target, (bool, int, float)):
      return type(target)(value)
    try:
      host = np.asarray(value, dtype=target.dtype)
    except (OverflowError, ValueError) as e:
      raise CheckpointCorruptedError(
          f"{lr_args['where']}, leaf {path!r}: value {value!r:.60} does not"
          f" fit {target.dtype}") from e
    if isinstance(target, np.ndarray | np.generic):
      return host if isinstance(target, np.ndarray) else host[()]
    return jax.device_put(host, _target_sharding(target))
  lr = _LeafReader(saved=saved, leaf_path=path, **lr_args)
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


def restore_tree(step_dir: epath.Path, manifest: dict, target: Any, *,
                 verify: bool = True) -> tuple[Any, int]:
  """Builds a pytree like `target` from the step at `step_dir`.

  Args:
    step_dir: the finalized step directory.
    manifest: its manifest, from `storage.read_manifest`.
    target: the concrete or abstract pytree to restore like.
    verify: check the CRC-32C of every block of data read.

  Returns:
    The pytree, and the number of bytes this process read from data files.

  Raises:
    StructureMismatchError: leaf paths, shapes or dtypes differ; the message
      names the leaf and both sides.
    CheckpointCorruptedError: data files are missing, short, inconsistent
      or fail their checksums; the message names the file, step and leaf.
  """
  saved = {leaf["path"]: leaf for leaf in manifest["leaves"]}
  targets, treedef = leaf_paths(target)
  _match_structure(saved, [p for p, _, _ in targets], step_dir)
  targets = [(p, k, _on_context_mesh(p, leaf)) for p, k, leaf in targets]
  reader = storage.ByteReader(step_dir, manifest["files"])
  lr_args = {"reader": reader, "verify": verify,
             "block": manifest["checksum"]["block_bytes"],
             "where": f"step {manifest['step']} in {step_dir}"}
  try:
    with concurrent.futures.ThreadPoolExecutor(
        _THREADS, thread_name_prefix="flax_ckpt_plugin-restore") as pool:
      futures = [pool.submit(_restore_leaf, path, saved[path], leaf, lr_args)
                 for path, _, leaf in targets]
      try:
        leaves = [f.result() for f in futures]
      except BaseException:
        for f in futures:
          f.cancel()
        raise
  finally:
    reader.close()
  return jax.tree_util.tree_unflatten(treedef, leaves), reader.bytes_read
