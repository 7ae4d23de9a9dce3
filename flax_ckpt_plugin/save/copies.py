"""Copies of single-device shards into new or reused host memory.

Two kinds, so that the first save after a start compiles nothing and no
save's cost grows faster than its number of leaves (see `staging`): the
runtime's own copies (`copies_onto`, `fresh_copies`: no program), and
compiled programs that copy up to `_GROUP` shards of one device into
buffers donated back to them (`PROGRAMS`), keyed by the shards' shapes and
dtypes, compiled on a background thread and cached for the process.
`bits_dtype` names the unsigned integers a shard is copied as.
"""

from __future__ import annotations

import collections
from concurrent import futures
import ctypes
import functools
import math
import threading
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# Shards this large get staging memory that is reused from save to save.
# Smaller ones come from the allocator's pool (glibc maps blocks above its
# dynamic threshold, at most 32 MiB, anew each time; below it, it reuses).
REUSE_BYTES = 4 << 20
_GROUP = 32  # Shards per compiled copy program: bounds each compile.

# XLA:CPU runs a program inline, on the calling thread, when its estimated
# cost is under 1000 flops, which a pure copy (0 flops) always is; this much
# arithmetic on the side makes the runtime enqueue the copy instead, so
# the save call does not wait for it.
ENQUEUE_PAD = np.zeros(4096, np.float32)


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


try:  # The runtime's batched copy, without the per-array Python work that
  # `jax.device_put` adds (about 20 us per array, 200 us onto pinned memory).
  from jax._src.lib import xla_client as _xc  # pylint: disable=g-import-not-at-top
  _BATCHED_COPY = _xc.batched_copy_array_to_devices_with_sharding
  _ALWAYS_COPY = _xc.ArrayCopySemantics.ALWAYS_COPY
except (AttributeError, ImportError):  # Another JAX: the public call.
  _BATCHED_COPY = None


def copies_onto(srcs: list[jax.Array],
                shardings: list[jax.sharding.Sharding]) -> list[jax.Array]:
  """A copy of each single-device array in new memory, on its sharding (its
  own, another device or another memory kind), started by the runtime:
  nothing is compiled or awaited. The runtime copies a source that is ready
  at once and enqueues the copy of one still being computed."""
  if not srcs:
    return []
  if _BATCHED_COPY is not None:
    try:
      return list(_BATCHED_COPY(
          list(srcs), [s._internal_device_list for s in shardings],  # pylint: disable=protected-access
          list(shardings), [_ALWAYS_COPY] * len(srcs)))
    except (AttributeError, TypeError):  # Its signature changed.
      pass
  return list(jax.device_put(list(srcs), list(shardings), may_alias=False))


def writable_view(arr: jax.Array) -> np.ndarray:
  """A writable numpy view of a ready single-device host buffer (a CPU
  device's, or pinned host memory), to fill in place before the array is
  handed out. The view does not keep `arr` alive: the caller holds both."""
  if not arr.nbytes:
    return np.empty(arr.shape, arr.dtype)
  mem = (ctypes.c_char * arr.nbytes).from_address(arr.unsafe_buffer_pointer())
  return np.frombuffer(mem, arr.dtype).reshape(arr.shape)


def fresh_copies(srcs: list[jax.Array]) -> list[jax.Array]:
  """A copy of each single-device array in new memory, compiling nothing;
  the copies keep the sources' dtypes."""
  return copies_onto(srcs, [s.sharding for s in srcs])


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


class _Programs:
  """The compiled copy programs of one process, by device and signature.

  `get` returns a (new, into) pair only once it is compiled; the first
  `get` of a key queues its compile on one background thread (not a
  daemon: one killed at interpreter exit inside the compiler aborts the
  process; a compile still queued when the program exits is skipped).
  """

  def __init__(self, capacity: int = 512):
    self._lock = threading.Lock()
    self._done: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    self._pending: dict[Any, futures.Future] = {}
    self._capacity = capacity
    self._pool: futures.ThreadPoolExecutor | None = None

  def get(self, key: Any, make_specs) -> tuple[Any, Any] | None:
    """The compiled pair for `key`, or None (queued, or failed to compile).
    """
    with self._lock:
      if key in self._done:
        self._done.move_to_end(key)
        return self._done[key]
      if key not in self._pending:
        if self._pool is None:
          self._pool = futures.ThreadPoolExecutor(
              1, thread_name_prefix="flax_ckpt_plugin-compile")
        self._pending[key] = self._pool.submit(self._compile, key,
                                               make_specs())
      return None

  def wait(self) -> None:
    """Waits for every queued compile (tests use it to be deterministic)."""
    with self._lock:
      pending = list(self._pending.values())
    futures.wait(pending)

  def _compile(self, key: Any, specs: tuple[Any, Any, Any]) -> None:
    pair = None
    try:
      if threading.main_thread().is_alive():  # Not at interpreter exit.
        dsts, srcs, pad = specs
        pair = (_copy_new.lower(srcs, pad).compile(),
                _copy_into.lower(dsts, srcs, pad).compile())
    except Exception:  # pylint: disable=broad-except
      pass  # The shards keep being copied by the runtime: still correct.
    with self._lock:
      del self._pending[key]
      # A failed compile is not tried again: None keeps the runtime copying.
      self._done[key] = pair
      while len(self._done) > self._capacity:
        self._done.popitem(last=False)


PROGRAMS = _Programs()


def _spec(shape, dtype, weak_type, device) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(
      shape, dtype, weak_type=weak_type,
      sharding=jax.sharding.SingleDeviceSharding(device))


def group_specs(device, sig):
  def make():
    return ([_spec(shape, bits_dtype(dtype), False, device)
             for shape, dtype, _ in sig],
            [_spec(*s, device) for s in sig],
            _spec(ENQUEUE_PAD.shape, ENQUEUE_PAD.dtype, False, device))
  return make


def large_groups(srcs: list[jax.Array], devices: list[Any]
                  ) -> dict[Any, list[int]]:
  """Indices of the shards whose staging memory is reused, grouped.

  The same tree gives the same groups at every save: per device, by
  signature, in chunks of at most `_GROUP` (worked out once per layout).
  """
  return _grouped(tuple((s.shape, s.dtype, s.weak_type) for s in srcs),
                  tuple(devices), REUSE_BYTES)


@functools.lru_cache(maxsize=64)
def _grouped(sigs: tuple[tuple[Any, Any, bool], ...], devices: tuple[Any, ...],
             reuse_bytes: int) -> dict[Any, list[int]]:
  by_device: dict[Any, list[tuple[Any, int]]] = {}
  for i, (sig, device) in enumerate(zip(sigs, devices)):
    shape, dtype, _ = sig
    if math.prod(shape) * np.dtype(dtype).itemsize >= reuse_bytes:
      by_device.setdefault(device, []).append((sig, i))
  groups: dict[Any, list[int]] = {}
  for device in sorted(by_device, key=lambda d: d.id):
    items = sorted(by_device[device],
                   key=lambda t: (t[0][0], t[0][1].str, t[0][2], t[1]))
    for start in range(0, len(items), _GROUP):
      chunk = items[start:start + _GROUP]
      groups[(device, tuple(s for s, _ in chunk))] = [i for _, i in chunk]
  return groups
