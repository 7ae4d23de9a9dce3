"""Placing restored leaves and their regions on devices.

`restore_leaf` makes one leaf like its target, from the step's bytes
(`from_host` from values every process holds); `on_context_mesh` puts a
target's abstract mesh on the mesh the caller set. A region of a leaf is
read once per process (`reader.LeafReader`) and goes
to every device of the target's sharding that holds it:

* on accelerators with pinned host memory, read into a pinned buffer and
  sent from there (`window_lib.RestoreWindow`), at the link's speed;
* on CPU devices, large shards are read straight into memory that the
  runtime owns (made by a zeros program, then written in place through a
  view), so that the first train step can donate the restored state;
  small ones into host buffers that the runtime copies, with no program
  compiled per shape;
* elsewhere, into host buffers put on the device.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
from jax import lax
import numpy as np

from flax_ckpt_plugin.restore import casting
from flax_ckpt_plugin.arrays import pinned
from flax_ckpt_plugin.restore import window as window_lib
from flax_ckpt_plugin.arrays import copies
from flax_ckpt_plugin.restore.data_files import host_buffer
from flax_ckpt_plugin.restore.reader import LeafReader
from flax_ckpt_plugin.restore.reader import LeafReads
from flax_ckpt_plugin.format.records import Index
from flax_ckpt_plugin.format.records import is_python_scalar
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.arrays.copies import bits_dtype
from flax_ckpt_plugin.format.treepaths import normalize_index


try:  # Builds an array from host pieces in one call (`_assemble`).
  from jax._src.lib import xla_client as _xc  # pylint: disable=g-import-not-at-top
  _BATCHED_PUT = _xc.batched_device_put
except (AttributeError, ImportError):  # Another JAX: the public way.
  _BATCHED_PUT = None
try:  # Drops the host arrays that the runtime let go of (`_copied_from_file`).
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  _RELEASE_HOST_ARRAYS = _jax.collect_garbage
except (AttributeError, ImportError):  # Another JAX: they go later.
  _RELEASE_HOST_ARRAYS = None


@functools.lru_cache(maxsize=None)
def _zeros_on(device: Any) -> Any:
  """A jitted `zeros(shape, dtype)` whose result is placed on `device`."""
  # A constant zero (not a parameter) lets the compiler emit a memset.
  return jax.jit(lambda shape, dtype: lax.full(shape, 0, dtype),
                 static_argnums=(0, 1),
                 out_shardings=jax.sharding.SingleDeviceSharding(device))


@functools.lru_cache(maxsize=256)
def _zeros_over(sharding: jax.sharding.Sharding) -> Any:
  """A jitted `zeros(shape, dtype)` placed on `sharding` (fully addressable):
  one program for all its devices."""
  return jax.jit(lambda shape, dtype: lax.full(shape, 0, dtype),
                 static_argnums=(0, 1), out_shardings=sharding)


def _owns(shape: tuple[int, ...], dtype: np.dtype, device: Any) -> bool:
  """Whether a restored shard of `shape` on `device` goes into memory the
  runtime owns (`_owned_cpu_buffer`): CPU devices, dtypes of whole bytes,
  and shards of at least `REUSE_BYTES` (see `place_array`: no program
  compiled per shape of a small shard)."""
  return (device.platform == "cpu"
          and (bits_dtype(dtype) is not None
               or jax.numpy.issubdtype(dtype, jax.numpy.complexfloating))
          and math.prod(shape) * dtype.itemsize >= copies.REUSE_BYTES)


def _regions(shape: tuple[int, ...], sharding: jax.sharding.Sharding
             ) -> dict[Index, list[Any]]:
  """The regions of a leaf of `shape` that this process's devices of
  `sharding` hold, each with those devices."""
  by_region: dict[Index, list[Any]] = {}
  for device, index in sharding.addressable_devices_indices_map(
      shape).items():
    region = normalize_index(index, shape) if index is not None else tuple(
        (0, d) for d in shape)
    by_region.setdefault(region, []).append(device)
  return by_region


def _copied_from_file(lr: LeafReader | casting.CastReader,
                      shape: tuple[int, ...], sharding: jax.sharding.Sharding
                      ) -> jax.Array | None:
  """The array on a sharding of this process's CPU devices, each shard
  copied by the runtime into memory of its own straight from the data
  file's pages (`LeafReader.mapped`, checked first); None where that does
  not apply (nothing placed is kept then).

  Each byte is then copied once, into memory the runtime owns (so the first
  train step can donate it), and that memory is faulted in by the copy
  itself: the other way (`_owned_cpu_array`) writes the new memory twice,
  the zeros of the program that makes it and then the file's bytes, and
  compiles a program per shape, so a first restore in a fresh process is
  slower that way (docs/architecture.md, *Where the time goes*, has both
  times).
  """
  mapped = getattr(lr, "mapped", None)
  if (_BATCHED_PUT is None or mapped is None
      or not sharding.is_fully_addressable
      or jax.dtypes.canonicalize_dtype(lr.dtype) != lr.dtype):
    return None
  by_region = _regions(shape, sharding)
  if not all(_owns(tuple(hi - lo for lo, hi in region), lr.dtype, d)
             for region, devices in by_region.items() for d in devices):
    return None
  placed: dict[Any, jax.Array] = {}
  for region, devices in by_region.items():
    with mapped(region) as host:
      if host is None:
        return None
      aval = jax.core.ShapedArray(host.shape, host.dtype)
      lo = host.ctypes.data
      for device in devices:
        try:  # The last argument: copy, never adopt the file's pages.
          arr = _BATCHED_PUT(aval, jax.sharding.SingleDeviceSharding(device),
                             [host], [device], True, True)
        except (TypeError, ValueError):  # Its signature changed.
          return None
        arr.block_until_ready()  # Before the pages are unmapped.
        if lo <= arr.unsafe_buffer_pointer() < lo + host.nbytes:
          return None  # Adopted after all: the other way.
        placed[device] = arr
      # The runtime holds the host array it copied until it next drops
      # such references; dropped now, the file's pages are unmapped when
      # the context ends, not at some later call.
      del host
      if _RELEASE_HOST_ARRAYS is not None:
        _RELEASE_HOST_ARRAYS()
  return jax.make_array_from_single_device_arrays(
      shape, sharding,
      [placed[d] for d in sharding.addressable_devices_indices_map(shape)])


def _owned_cpu_array(lr: LeafReader | casting.CastReader,
                     shape: tuple[int, ...], sharding: jax.sharding.Sharding
                     ) -> jax.Array | None:
  """The array on a sharding of this process's CPU devices, each shard
  written in place as in `_owned_cpu_buffer`, with one program for every
  device (one compile per shape and sharding, not per device); None where
  that does not apply."""
  dtype = lr.dtype
  if not (sharding.is_fully_addressable
          and all(_owns(sharding.shard_shape(shape), dtype, d)
                  for d in sharding.device_set)):
    return None
  arr = _zeros_over(sharding)(shape, dtype)
  arr.block_until_ready()
  done: dict[Index, np.ndarray] = {}
  for shard in arr.addressable_shards:
    region = normalize_index(shard.index, shape)
    view = copies.writable_view(shard.data)
    if region in done:
      np.copyto(view, done[region])
    else:
      done[region] = lr.read(region, out=view)
  return arr


def _owned_cpu_buffer(shape: tuple[int, ...], dtype: np.dtype, device: Any
                      ) -> tuple[jax.Array, np.ndarray] | None:
  """A new CPU device array that the runtime owns, and a writable view of it.

  Memory that `jax.device_put` adopts (aligned numpy memory, or the copy
  that `may_alias=False` makes) cannot be donated: the first jitted step
  that donates a restored state would then copy every input into new
  memory, with both states alive at once (with a 0.98 GB state on 2
  cores, a step nearly three times as long). So the array is made by
  a jitted program (which fills it with zeros), and its bytes are then
  written in place, through a view of its buffer: the array is new, ready,
  and referenced by nothing else until it is returned. None where this
  does not apply (other platforms, and dtypes whose elements are not whole
  bytes, which the runtime may pack).
  """
  if not _owns(shape, dtype, device):
    return None
  arr = _zeros_on(device)(shape, dtype)
  arr.block_until_ready()
  return arr, copies.writable_view(arr)


def _assemble(shape: tuple[int, ...], dtype: np.dtype,
              sharding: jax.sharding.Sharding, devices: list[Any],
              pieces: list[jax.Array | np.ndarray]) -> jax.Array:
  """The global array from each device's piece (device arrays, or host
  buffers that the runtime copies)."""
  if _BATCHED_PUT is not None and all(
      isinstance(p, np.ndarray) for p in pieces):
    try:  # One call for the whole array: 25 us, a quarter of the public way.
      return _BATCHED_PUT(jax.core.ShapedArray(shape, dtype), sharding,
                          pieces, devices, True)
    except (TypeError, ValueError):  # Its signature changed.
      pass
  arrays = [p if isinstance(p, jax.Array) else jax.device_put(p, d)
            for p, d in zip(pieces, devices)]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _sent_as_held(held: Callable[[Index], Any], region: Index,
                  devices: list[Any], sharding: jax.sharding.Sharding,
                  placed: dict[Any, jax.Array]) -> bool:
  """Sends `region` to `devices` from the pinned snapshot buffer that holds
  it (`LeafReader.pinned`), if one does, and waits for the transfers (the
  buffer is the next save's to reuse once the read ends); whether it
  did."""
  with held(region) as arr:
    if arr is None:
      return False
    sent = copies.copies_onto([arr] * len(devices), [
        pinned.sharding_on(d, sharding.memory_kind
                           or d.default_memory().kind) for d in devices])
    pinned.wait_ready(sent, lambda: f"sending {arr.nbytes} bytes held in"
                      " pinned host memory to the devices")
  placed.update(zip(devices, sent))
  return True


def _through_pinned(lr: LeafReader | casting.CastReader,
                    shape: tuple[int, ...], sharding: jax.sharding.Sharding,
                    window: window_lib.RestoreWindow) -> jax.Array | None:
  """The array, each region read into a pinned host buffer and sent from
  there to every device that holds it (see `pinned`); None if the runtime
  gives no pinned memory (what was sent of it is then dropped, and the
  caller reads it the plain way). A buffer whose read fails is given back
  to the window."""
  placed = {}
  held = getattr(lr, "pinned", None)  # Not through a cast.
  for region, devices in _regions(shape, sharding).items():
    if held is not None and _sent_as_held(held, region, devices, sharding,
                                          placed):
      continue
    taken = window.take(tuple(hi - lo for lo, hi in region), lr.dtype,
                        devices[0])
    if taken is None:
      return None
    buf, view = taken
    try:
      lr.read(region, out=view)
    except BaseException:
      window.give_back(buf)  # Else its bytes stay counted: see `take`.
      raise
    finally:
      del view  # Before the buffer may be freed.
    for device, arr in zip(devices, window.send(buf, [
        pinned.sharding_on(d, sharding.memory_kind
                           or d.default_memory().kind)
        for d in devices])):
      placed[device] = arr
  devices = list(sharding.addressable_devices_indices_map(shape))
  return jax.make_array_from_single_device_arrays(
      shape, sharding, [placed[d] for d in devices])


def place_array(lr: LeafReader | casting.CastReader,
                shape: tuple[int, ...], sharding: jax.sharding.Sharding,
                window: window_lib.RestoreWindow | None = None) -> jax.Array:
  """The leaf that `lr` reads, on `sharding`: each region this process
  holds read once, and placed on every device of it that holds it.

  With a `window`, regions for devices with pinned host memory travel
  through it; CPU devices get memory the runtime owns, written in place
  (large shards), or host buffers it copies (small ones).
  """
  indices = sharding.addressable_devices_indices_map(shape)
  if window is not None and pinned.fits(lr.dtype) and all(
      pinned.takes(d) for d in indices):
    arr = _through_pinned(lr, shape, sharding, window)
    if arr is not None:
      return arr
  for way in (_copied_from_file, _owned_cpu_array):
    arr = way(lr, shape, sharding)
    if arr is not None:
      return arr
  cache: dict[Index, np.ndarray] = {}
  devices, pieces = list(indices), []
  for device, index in indices.items():
    region = normalize_index(index, shape) if index is not None else tuple(
        (0, d) for d in shape)
    region_shape = tuple(hi - lo for lo, hi in region)
    host = cache.get(region)
    owned = _owned_cpu_buffer(region_shape, lr.dtype, device)
    if owned is not None:
      arr, view = owned
      if host is None:
        cache[region] = lr.read(region, out=view)
      else:
        np.copyto(view, host)
      pieces.append(arr)
    elif device.platform == "cpu":
      # The runtime adopts host memory on a 64-byte boundary instead of
      # copying it, and adopted memory is not donated; bytes 16 past one
      # it copies into memory of its own, once per device. For shards under
      # `REUSE_BYTES` that copy costs less than the program per distinct
      # shape that `_owned_cpu_buffer` compiles (restores of thousands of
      # small leaves of hundreds of shapes).
      if host is None:
        host = cache[region] = lr.read(
            region, out=host_buffer(region_shape, lr.dtype, offset=16))
      pieces.append(host)
    else:
      # Read once, but never hand one host buffer to two devices: a backend
      # may adopt the memory, and a jitted step that donates one replica
      # could then write over the other.
      if host is None:
        host = cache[region] = lr.read(region)
      else:
        host = np.copy(host)
      pieces.append(jax.device_put(host, device))
  return _assemble(shape, lr.dtype, sharding, devices, pieces)


def target_sharding(leaf: Any) -> jax.sharding.Sharding:
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return sharding


def on_context_mesh(path: str, leaf: Any) -> Any:
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


def restore_leaf(saved: LeafRecord, target: Any, reads: LeafReads | None,
                 *, window: window_lib.RestoreWindow | None = None) -> Any:
  """One leaf like `target`, read as `reads` say (None for a leaf whose
  value is in the manifest: a Python scalar). With `reads.cast`, values
  are converted to the target's dtype as they are read (`casting`). With a
  `window`, regions for devices with pinned host memory travel through it.
  """
  if saved.is_scalar:  # `matching` checked that the target holds it.
    value = saved.value
    if is_python_scalar(target):
      return type(target)(value)
    host = np.asarray(value, dtype=target.dtype)
    if isinstance(target, np.ndarray | np.generic):
      return host if isinstance(target, np.ndarray) else host[()]
    return _put(host, target_sharding(target))
  lr = reads.open(saved)
  if reads.cast:
    lr = casting.reader_for(lr, saved, target, reads.where)
  if (isinstance(target, (bool, int, float, np.ndarray, np.generic))
      or lr.dtype.byteorder == ">" or saved.key_impl is not None):
    return from_host(saved, target, lr.read(tuple((0, d) for d in lr.shape)))
  return place_array(lr, lr.shape, target_sharding(target),
                               window)


def from_host(saved: LeafRecord, target: Any, host: np.ndarray) -> Any:
  """A leaf like `target` from all of `saved`'s values, on the host.

  Every process that restores the leaf holds the same values (the step's
  checksummed bytes, or a collective's result), so each places its own
  shards (`_put`), and no leaf costs a collective.
  """
  if is_python_scalar(target):
    return type(target)(host[()].item())
  if isinstance(target, np.ndarray | np.generic):
    if host.dtype != target.dtype:  # Byte order only (see `_same_dtype`).
      host = host.astype(target.dtype)
    return host if isinstance(target, np.ndarray) else host[()]
  if host.dtype.byteorder == ">":  # Saved big-endian by an older version.
    host = host.astype(host.dtype.newbyteorder("="))
  sharding = target_sharding(target)
  if saved.key_impl is None:
    return _put(host, sharding)
  if not sharding.is_fully_addressable:
    return jax.random.wrap_key_data(_put(host, sharding), impl=saved.key_impl)
  return jax.device_put(jax.random.wrap_key_data(host, impl=saved.key_impl),
                        sharding)


def _put(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """`host`, the same on every process, on `sharding`. Over several
  processes, `jax.device_put` would first check that every process holds
  the same values, with a collective per leaf (about 10 ms each here, and
  a wait for a process that restores alone or skipped the leaf); each
  process places its own shards instead."""
  if not sharding.is_fully_addressable:
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda index: host[index])
  return jax.device_put(host, sharding)


def log_casts(where: str, saved: dict[str, LeafRecord],
              targets: list[tuple[str, Any]]) -> list[str]:
  """The one log line of a restore with `cast=True`: how many leaves it
  converts. Returns their paths."""
  cast = casting.cast_leaves(saved, targets)
  log.info("%s: casting %d of %d leaves to the target's dtypes%s", where,
           len(cast), len(targets), f" (first: {cast[0]!r})" if cast else "")
  return cast
