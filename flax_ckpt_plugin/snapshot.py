"""A consistent host copy of a pytree: the only blocking part of a save.

Each process keeps only the shards it writes: replica 0 of its addressable
shards of every global `jax.Array`. Host-local values (numpy arrays and Python
scalars, and `jax.Array`s that are fully addressable while several processes
run) are the same on every process by contract, so only the primary host
writes their bytes.

The snapshot stays correct when the next train step donates the state's
buffers, because it never refers to them once the runtime has run what
`take_snapshot` enqueued:

* On accelerators every shard's `copy_to_host_async()` is started before
  the first one is awaited.
* On the CPU backend every shard is copied by a jitted program into buffers
  that the staging area keeps and donates back to the same program at the
  next save, so no memory is newly mapped after the first save. The copy is
  enqueued, not waited for: `take_snapshot` returns in about a millisecond,
  the runtime runs the copy before the next step that donates the state
  (a donated buffer waits for the programs still reading it), and the
  writer waits for the copy before it reads the bytes, through zero-copy
  DLPack views.

Why not keep numpy views of the state's own buffers, which costs nothing?
A view pins the buffer, so the next step's donation is declined and that
step copies its whole input into newly allocated (so newly page-faulted)
memory: measured with a 0.98 GB state on 2 cores, the step after a save took
0.6-1.2 s longer. The enqueued copy costs the loop about 0.1 s per GB.

Dtypes that DLPack cannot hand to numpy as bits of the same width (complex,
sub-byte types) are copied by threads into reused numpy buffers instead,
which blocks for the copy.
"""

from __future__ import annotations

from concurrent import futures
import dataclasses
import functools
import os
import threading
from typing import Any, Sequence

import jax
from jax import lax
import jax.numpy as jnp
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
  """One shard's values, on the host or being copied there."""
  index: Index  # [start, stop) per dimension of the global array.
  # A C-contiguous host array of the shard's values, or (CPU backend) a
  # staging copy still being made: a jax.Array of the values' bits as
  # unsigned integers of the same width; `host()` waits for it.
  data: np.ndarray | jax.Array
  dtype: np.dtype | None = None  # The values' dtype, for a staging copy.

  def host(self) -> np.ndarray:
    """The values as a host array (a zero-copy view of a staging copy).

    Hold the view no longer than needed: while it lives, the staging
    buffer cannot be donated to the next save's copy (which then copies
    into new memory, still correctly).
    """
    if isinstance(self.data, np.ndarray):
      return self.data
    self.data.block_until_ready()
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


_COPY_CHUNK_BYTES = 16 << 20

# XLA:CPU runs a program inline, on the calling thread, when its estimated
# cost is under 1000 flops, which a pure copy (0 flops) always is; this much
# arithmetic on the side makes the runtime enqueue the copy instead, so
# the save call does not wait for it.
_ENQUEUE_PAD = np.zeros(4096, np.float32)


@functools.lru_cache(maxsize=None)  # Per leaf per save: keep it cheap.
def bits_dtype(dtype: Any) -> np.dtype | None:
  """Unsigned integers as wide as `dtype`, or None where no bitcast fits."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return np.dtype(np.uint8)
  if jnp.issubdtype(dtype, jnp.floating):
    bits = jnp.finfo(dtype).bits
  elif jnp.issubdtype(dtype, jnp.integer):
    bits = jnp.iinfo(dtype).bits
  else:  # Complex numbers: XLA does not bitcast them.
    return None
  if bits != dtype.itemsize * 8 or bits not in (8, 16, 32, 64):
    return None  # Sub-byte types (int4, float4) take a byte in numpy.
  return np.dtype(f"uint{bits}")


def _bits(x: jax.Array) -> jax.Array:
  to = bits_dtype(x.dtype)
  if x.dtype == jnp.bool_:
    return x.astype(to)
  return lax.bitcast_convert_type(x, to)


def _update(dst: jax.Array, src: jax.Array) -> jax.Array:
  # A full-size dynamic_update_slice into a donated buffer: a copy in place.
  return lax.dynamic_update_slice(dst, _bits(src), (0,) * src.ndim)


def _copy(dsts, srcs, pad):
  return [_update(d, s) for d, s in zip(dsts, srcs)], pad * 2 + 1


_copy_into = jax.jit(_copy, donate_argnums=0)


@jax.jit
def _copy_new(srcs, pad):
  return _copy([jnp.zeros(s.shape, bits_dtype(s.dtype)) for s in srcs], srcs,
               pad)


# `_copy_into` compiled ahead of its first use, per (device, signature):
# compiled on a background thread after a first save, so that the second
# save does not wait for the compiler.
_COMPILED_COPIES: dict[tuple[Any, ...], Any] = {}
_COMPILED_LOCK = threading.Lock()
_MAX_COMPILED = 16


def _spec(a: jax.Array) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding,
                              weak_type=a.weak_type)


def _compile_copy_into(key: tuple[Any, ...], copies: list[jax.ShapeDtypeStruct],
                       srcs: list[jax.ShapeDtypeStruct],
                       pad: jax.ShapeDtypeStruct) -> None:
  try:
    compiled = _copy_into.lower(copies, srcs, pad).compile()
  except Exception:  # pylint: disable=broad-except
    return  # The save then compiles it through jit, as without this.
  with _COMPILED_LOCK:
    if len(_COMPILED_COPIES) >= _MAX_COMPILED:
      _COMPILED_COPIES.clear()
    _COMPILED_COPIES[key] = compiled


def _reusing_copy(key: tuple[Any, ...], dsts: list[jax.Array],
                  srcs: list[jax.Array], pad: jax.Array) -> list[jax.Array]:
  with _COMPILED_LOCK:
    compiled = _COMPILED_COPIES.get(key)
  if compiled is not None:
    try:
      return compiled(dsts, srcs, pad)[0]
    except (TypeError, ValueError):  # Arguments it was not compiled for.
      pass
  return _copy_into(dsts, srcs, pad)[0]


class HostStaging:
  """Staging memory for CPU shards, reused by every save of one manager.

  Two kinds: device copies (`copy_on_devices`, for every dtype that travels
  as unsigned bits) and numpy buffers filled by threads (`copy`, for the
  rest). Either is handed out again only by the next `take_snapshot`, which
  the manager calls after the previous commit (the only reader) has
  finished. Together they hold one copy of the CPU shards this process
  writes; `clear` frees them.
  """

  def __init__(self, threads: int | None = None):
    self._threads = threads or min(4, os.cpu_count() or 1)
    self._buffers: dict[tuple[Any, ...], np.ndarray] = {}
    # Per CPU device: the shapes and dtypes copied, and the copies.
    self._device: dict[Any, tuple[tuple[Any, ...], list[jax.Array]]] = {}
    self._pads: dict[Any, jax.Array] = {}
    self._pool: futures.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()

  @property
  def nbytes(self) -> int:
    return (sum(b.nbytes for b in self._buffers.values())
            + sum(a.nbytes for _, arrays in self._device.values()
                  for a in arrays))

  def clear(self) -> None:
    with self._lock:
      self._buffers = {}
      self._device = {}
      self._pads = {}
      if self._pool is not None:
        self._pool.shutdown(wait=True)
        self._pool = None

  def copy_on_devices(self, srcs: list[jax.Array]) -> list[jax.Array]:
    """Enqueues a copy of each single-device CPU array; returns the copies.

    The copies hold the sources' bits as unsigned integers (`bits_dtype`
    must accept every source's dtype). Copies of the previous call on the
    same device with the same shapes and dtypes are donated to this one,
    so their memory is reused; copies not reused are freed.
    """
    with self._lock:
      old, self._device = self._device, {}
      by_device: dict[Any, list[int]] = {}
      for i, src in enumerate(srcs):
        (device,) = src.devices()
        by_device.setdefault(device, []).append(i)
      out: list[Any] = [None] * len(srcs)
      for device, idx in by_device.items():
        group = [srcs[i] for i in idx]
        sig = tuple((a.shape, a.dtype, a.weak_type) for a in group)
        key = (device, sig)
        pad = self._pads.get(device)
        if pad is None:
          pad = self._pads[device] = jax.device_put(_ENQUEUE_PAD, device)
        prev = old.pop(device, None)
        if prev is not None and prev[0] == sig:
          copies = _reusing_copy(key, prev[1], group, pad)
        else:
          copies, _ = _copy_new(group, pad)
          with _COMPILED_LOCK:
            compiled = key in _COMPILED_COPIES
          if not compiled:
            # Not a daemon: one killed at interpreter exit inside the
            # compiler aborts the process.
            threading.Thread(
                target=_compile_copy_into, daemon=False,
                name="flax_ckpt_plugin-compile",
                args=(key, [_spec(c) for c in copies],
                      [_spec(g) for g in group], _spec(pad))).start()
        del prev
        self._device[device] = (sig, copies)
        for i, c in zip(idx, copies):
          out[i] = c
      return out

  def copy(self, items: list[tuple[tuple[Any, ...], np.ndarray]]
           ) -> list[np.ndarray]:
    """Copies each source into its buffer (by key); returns the buffers.

    Buffers not named by `items` are freed: the tree changed shape.
    """
    with self._lock:
      old, self._buffers = self._buffers, {}
      out = []
      for key, src in items:
        full = (key, src.shape, src.dtype.str)
        buf = old.pop(full, None)
        if buf is None:
          buf = np.empty(src.shape, src.dtype)
        self._buffers[full] = buf
        out.append(buf)
      del old
      chunks = []
      for buf, (_, src) in zip(out, items):
        if src.ndim == 0 or src.nbytes <= _COPY_CHUNK_BYTES:
          chunks.append((buf, src))
          continue
        # Split along the first axis: contiguous pieces, copied in parallel.
        rows = max(1, _COPY_CHUNK_BYTES // max(1, src[0].nbytes))
        for i in range(0, src.shape[0], rows):
          chunks.append((buf[i:i + rows], src[i:i + rows]))
      if self._threads == 1 or len(chunks) == 1:
        for dst, src in chunks:
          np.copyto(dst, src)
      else:
        if self._pool is None:
          self._pool = futures.ThreadPoolExecutor(
              self._threads, thread_name_prefix="flax_ckpt_plugin-snapshot")
        # np.copyto releases the GIL, so the copies run side by side.
        for f in [self._pool.submit(np.copyto, d, s_) for d, s_ in chunks]:
          f.result()
      return out


def take_snapshot(tree: Any, *, process_count: int, is_primary: bool,
                  staging: HostStaging) -> list[LeafSnapshot]:
  """Copies the shards this process writes to host memory.

  Args:
    tree: the state to save (e.g. a Flax `TrainState`).
    process_count: number of JAX processes.
    is_primary: whether this process writes host-local values.
    staging: the buffers CPU shards are copied into (reused by the next
      call, so the previous snapshot must no longer be in use).

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

  # CPU shards: copied by the runtime into staging buffers (enqueued, not
  # awaited), or, for dtypes that cannot travel as unsigned bits, copied by
  # threads from views of the runtime's buffers right here.
  on_device, cpu_items = [], []
  for path, _, _, arr, _, shards in plans:
    for s in shards or ():
      if s.device.platform != "cpu":
        continue
      if bits_dtype(arr.dtype) is not None:
        on_device.append(s.data)
      else:
        index = normalize_index(s.index, arr.shape)
        cpu_items.append(((path, index), np.asarray(s.data)))
  device_copies = iter(staging.copy_on_devices(on_device))
  host_copies = iter(staging.copy(cpu_items))
  del cpu_items, on_device  # No view of a runtime buffer outlives this call.

  out = []
  for path, keys, leaf, arr, impl, shards in plans:
    if arr is not None:
      data = []
      for s in shards:
        index = normalize_index(s.index, arr.shape)
        if s.device.platform != "cpu":
          data.append(ShardData(index, _c_order(np.asarray(s.data))))
        elif bits_dtype(arr.dtype) is not None:
          data.append(ShardData(index, next(device_copies),
                                np.dtype(arr.dtype)))
        else:
          data.append(ShardData(index, next(host_copies)))
      out.append(LeafSnapshot(path, keys, "array", _dtype_name(arr.dtype),
                              tuple(arr.shape), data, key_impl=impl))
    else:
      out.append(_host_leaf(path, keys, leaf, is_primary))
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
