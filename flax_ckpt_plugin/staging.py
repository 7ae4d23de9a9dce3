"""Staging memory that CPU snapshots are copied into, reused across saves.

On the CPU backend every shard is copied by a jitted program into buffers
that the staging area keeps and donates back to the same program at the next
save, so no memory is newly mapped after the first save. The copy is
enqueued, not waited for: `snapshot.take_snapshot` returns in about a
millisecond, the runtime runs the copy before the next step that donates the
state (a donated buffer waits for the programs still reading it), and the
writer waits for the copy before it reads the bytes, through zero-copy
DLPack views.

Dtypes that DLPack cannot hand to numpy as bits of the same width (complex,
sub-byte types) are copied by threads into reused numpy buffers instead,
which blocks for the copy.
"""

from __future__ import annotations

from concurrent import futures
import functools
import os
import threading
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

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


