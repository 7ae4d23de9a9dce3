"""Copies of single-device shards into new or reused host memory.

Three kinds, so that the first save after a start compiles nothing and no
save's cost grows faster than its number of leaves (see `staging`): the
runtime's own copies (`copies_onto`, `fresh_copies`: no program); compiled
programs that copy up to `_GROUP` large shards of one device into buffers
donated back to them; and compiled programs that pack up to `PACK_COUNT`
small shards of one device into one buffer, donated back to them too
(`Packed`: a shard's place in it): one call for them all, where the
runtime takes about 25 us per shard. The programs (`PROGRAMS`) are keyed by the shards' shapes and
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
from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# Shards this large get staging memory that is reused from save to save.
# Smaller ones come from the allocator's pool (glibc maps blocks above its
# dynamic threshold, at most 32 MiB, anew each time; below it, it reuses).
REUSE_BYTES = 4 << 20
_GROUP = 32  # Shards per compiled copy program: bounds each compile.
# Small shards per pack, and its bytes: the program of a pack of 256
# compiles in about 1 s here (in the background), and is called in 1 ms
# where the runtime's copies of 256 shards take 6 ms.
PACK_COUNT = 256
PACK_BYTES = 64 << 20
PACK_ALIGN = 64  # Each shard's offset in its pack: as the runtime aligns.

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
  handed out. The view keeps `arr` alive: a read left behind by its
  deadline (`deadlines`) that writes into it later never writes into
  memory freed and handed to another array."""
  if not arr.nbytes:
    return np.empty(arr.shape, arr.dtype)
  mem = (ctypes.c_char * arr.nbytes).from_address(arr.unsafe_buffer_pointer())
  mem.owner = arr
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


class Packed(NamedTuple):
  """A shard's bytes inside a pack that a compiled program is filling."""
  pack: jax.Array  # uint8, one dimension.
  offset: int
  nbytes: int


def pack_offsets(sig: tuple[tuple[Any, Any, bool], ...]
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Each shard's offset in the pack of shards of signature `sig`, and its
  bytes (not cached: a save reads them from its group's key, `offsets`)."""
  offsets, sizes, end = [], [], 0
  for shape, dtype, _ in sig:
    offsets.append(end)
    sizes.append(math.prod(shape) * np.dtype(dtype).itemsize)
    end += sizes[-1] + -sizes[-1] % PACK_ALIGN
  return tuple(offsets), tuple(sizes)


def _flat_bytes(x: jax.Array) -> jax.Array:
  b = _bits(x)
  if b.dtype.itemsize > 1:
    b = lax.bitcast_convert_type(b, jnp.uint8)  # A last axis of bytes.
  return b.reshape(-1)


def _packed(srcs) -> jax.Array:
  parts = []
  for s in srcs:
    flat = _flat_bytes(s)
    parts.append(flat)
    gap = -flat.shape[0] % PACK_ALIGN
    if gap:
      parts.append(jnp.zeros(gap, jnp.uint8))
  return jnp.concatenate(parts)


def _pack(dsts, srcs, pad):
  # Into the donated pack of the save before, in place (a concatenate of
  # its own would be written into new memory).
  return [lax.dynamic_update_slice(dsts[0], _packed(srcs), (0,))], pad * 2 + 1


_pack_into = jax.jit(_pack, donate_argnums=0)


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
  """The compiled copy programs of one process, by kind, device and
  signature.

  `get` returns what `compile_fn` made only once it is compiled; the first
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

  def get(self, key: Any, compile_fn: Callable[[], Any]) -> Any:
    """The compiled program(s) for `key`, or None (queued, or failed to
    compile)."""
    with self._lock:
      if key in self._done:
        self._done.move_to_end(key)
        return self._done[key]
      if key not in self._pending:
        self._pending[key] = self._started().submit(self._compile, key,
                                                    compile_fn)
      return None

  def ready(self, key: Any) -> Any:
    """The compiled program(s) for `key` if compiled; None otherwise,
    queuing nothing (a save looks them up with this, and queues what it
    lacks with `get` after its copies are dispatched: the woken compile
    thread then contends with the train loop, not with the save call)."""
    with self._lock:
      if key in self._done:
        self._done.move_to_end(key)
        return self._done[key]
      return None

  def start(self) -> None:
    """Starts the compile thread if it is not running, where waiting for
    that costs nothing (a manager's open): a thread that the first `get`
    starts, in a save call, makes that call wait for a core (3-6 ms on 2
    busy ones), and then for the interpreter's lock, which the new
    thread's tracing holds."""
    with self._lock:
      self._started().submit(lambda: None)

  def _started(self) -> futures.ThreadPoolExecutor:
    if self._pool is None:
      self._pool = futures.ThreadPoolExecutor(
          1, thread_name_prefix="flax_ckpt_plugin-compile")
    return self._pool

  def _compile(self, key: Any, compile_fn: Callable[[], Any]) -> None:
    pair = None
    try:
      if threading.main_thread().is_alive():  # Not at interpreter exit.
        pair = compile_fn()
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


def group_programs(device, sig) -> Callable[[], tuple[Any, Any]]:
  """Compiles the (new, into) copy programs of a group of large shards."""
  def compile_fn():
    dsts = [_spec(shape, bits_dtype(dtype), False, device)
            for shape, dtype, _ in sig]
    srcs = [_spec(*s, device) for s in sig]
    pad = _spec(ENQUEUE_PAD.shape, ENQUEUE_PAD.dtype, False, device)
    return (_copy_new.lower(srcs, pad).compile(),
            _copy_into.lower(dsts, srcs, pad).compile())
  return compile_fn


def pack_programs(device, sig) -> Callable[[], tuple[None, Any]]:
  """Compiles the program that packs a group of small shards into a pack
  (donated to it: see `new_pack` for the first)."""
  def compile_fn():
    srcs = [_spec(*s, device) for s in sig]
    dsts = [_spec((pack_bytes(sig),), np.dtype(np.uint8), False, device)]
    pad = _spec(ENQUEUE_PAD.shape, ENQUEUE_PAD.dtype, False, device)
    return None, _pack_into.lower(dsts, srcs, pad).compile()
  return compile_fn


def programs_of(key: GroupKey) -> Any:
  """The compiled programs of the group `key` (see `groups`), or None
  while they compile (the first call queues the compile; `PROGRAMS.ready`
  looks them up without queuing)."""
  return PROGRAMS.get(key, (pack_programs if key.kind == PACK
                            else group_programs)(key.device, key.sig))


def new_pack(device, sig) -> list[jax.Array]:
  """Memory for the pack of shards of signature `sig` (no program: one
  compile per pack, not two)."""
  return [jax.device_put(np.zeros(pack_bytes(sig), np.uint8), device)]


def pack_bytes(sig: tuple[tuple[Any, Any, bool], ...]) -> int:
  offsets, sizes = pack_offsets(sig)
  return offsets[-1] + sizes[-1] + -sizes[-1] % PACK_ALIGN if sig else 0


def groups(sigs: tuple[tuple[Any, Any, bool], ...], devices: tuple[Any, ...]
           ) -> tuple[Group, ...]:
  """The shards copied by programs, in `Group`s; two groups may share a
  key (and its program).

  Shards of at least `REUSE_BYTES` are copied into staging memory reused
  from save to save, per device, by signature, `_GROUP` at a time; smaller
  ones are packed, per device in leaf order, `PACK_COUNT` or `PACK_BYTES`
  at a time. The same layout gives the same groups at every save (worked
  out once per layout). Every dtype must have a `bits_dtype`.
  """
  return _grouped(sigs, devices, REUSE_BYTES, PACK_COUNT, PACK_BYTES)


REUSE, PACK = "reuse", "pack"


class _GroupKeyFields(NamedTuple):
  """`GroupKey`'s fields (a NamedTuple's own class cannot replace its
  `__new__`, which `GroupKey` needs to keep its hash)."""
  kind: str
  device: Any
  sig: tuple[tuple[Any, Any, bool], ...]


class GroupKey(_GroupKeyFields):
  """What a group's programs are compiled for (`PROGRAMS`' key): its hash
  is taken once, so that finding its program each save does not hash the
  signature.

  Attributes:
    kind: `REUSE` (large shards, a buffer each) or `PACK` (small shards
      packed into one buffer).
    device: the device of the group's shards.
    sig: the shards' signature: (shape, dtype, weak type) of each.
  """

  def __new__(cls, kind: str, device: Any, sig: tuple[Any, ...]):
    key = super().__new__(cls, kind, device, sig)
    key._hash = hash((kind, device, sig))
    return key

  def __hash__(self) -> int:
    return self._hash

  def offsets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A pack's `pack_offsets`, kept (not looked up by the signature)."""
    if not hasattr(self, "_offsets"):
      self._offsets = pack_offsets(self.sig)
    return self._offsets

  def __eq__(self, other) -> bool:
    return self is other or tuple.__eq__(self, other)

  def __ne__(self, other) -> bool:
    return not self == other


class Group(NamedTuple):
  """Shards that one call of a compiled program copies (see `groups`).

  Attributes:
    key: the program's `GroupKey`.
    shards: the numbers of the group's shards among those `groups` was
      given, in the order of `key.sig`.
  """
  key: GroupKey
  shards: tuple[int, ...]


def _by_signature(item: tuple[Any, int]) -> tuple[Any, ...]:
  # Dtypes by name: numpy's dtypes do not order.
  (shape, dtype, weak_type), i = item
  return shape, dtype.str, weak_type, i


@functools.lru_cache(maxsize=64)
def _grouped(sigs: tuple[tuple[Any, Any, bool], ...], devices: tuple[Any, ...],
             reuse_bytes: int, pack_count: int, pack_bytes: int
             ) -> tuple[Group, ...]:
  large: dict[Any, list[tuple[Any, int]]] = {}
  small: dict[Any, list[tuple[Any, int, int]]] = {}
  for i, (sig, device) in enumerate(zip(sigs, devices)):
    shape, dtype, _ = sig
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes >= reuse_bytes:
      large.setdefault(device, []).append((sig, i))
    else:
      small.setdefault(device, []).append((sig, i, nbytes))
  out = []
  for device in sorted(large, key=lambda d: d.id):
    items = sorted(large[device], key=_by_signature)
    for start in range(0, len(items), _GROUP):
      chunk = items[start:start + _GROUP]
      out.append(Group(GroupKey(REUSE, device, tuple(s for s, _ in chunk)),
                       tuple(i for _, i in chunk)))
  for device in sorted(small, key=lambda d: d.id):
    chunks: list[list[tuple[Any, int, int]]] = [[]]
    size = 0
    for sig, i, nbytes in small[device]:
      if chunks[-1] and (len(chunks[-1]) == pack_count
                         or size + nbytes > pack_bytes):
        chunks.append([])
        size = 0
      chunks[-1].append((sig, i, nbytes))
      size += nbytes
    for chunk in chunks:
      if chunk:
        out.append(Group(
            GroupKey(PACK, device, tuple(s for s, _, _ in chunk)),
            tuple(i for _, i, _ in chunk)))
  return tuple(out)
