"""Staging memory that CPU snapshots are copied into.

On the CPU backend a snapshot copies every shard on its device; the copy is
enqueued behind the step that produced the shard, not waited for, and the
writer waits for it before reading the bytes through a zero-copy view. Two
kinds of copy, so that the first save after a start compiles nothing and no
save's cost grows faster than its number of leaves:

* Every shard is first copied by the runtime itself (`copies.fresh_copies`:
  no program, so nothing to compile, whatever the tree), about 25 us of
  the save call per shard.
* From then on, shards are copied by compiled programs into the staging
  memory of the save before, donated back to them, so no memory is mapped
  anew (new memory costs a page fault per 4 KiB: 0.7 s per GB on one core
  here, taken from the train loop). A shard of at least
  `copies.REUSE_BYTES` has a buffer of its own, up to `copies._GROUP` of
  them per program; smaller ones are packed, up to `copies.PACK_COUNT`
  into one buffer per program (about 4 us per shard). The programs
  (`copies.PROGRAMS`) are keyed by the shards' shapes and dtypes, compiled
  on a background thread (started when a manager opens) after the save
  that first needs them has dispatched its copies (or when the manager is
  warmed up), and cached for the process, across managers: a save never
  waits for a compiler, and the compile cost is bounded by the number of
  groups, not by the number of distinct shapes.

Dtypes that cannot be copied as unsigned bits of the same width (complex,
sub-byte types) are copied by threads into numpy buffers instead (`copy`),
which blocks for the copy.
"""

from __future__ import annotations

from concurrent import futures
import os
import threading
from typing import Any

import crc32c
import jax
import numpy as np

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.arrays import copies as copies_lib

_COPY_CHUNK_BYTES = 16 << 20

class HostStaging:
  """Staging memory for CPU shards, reused by every save of one manager.

  Two kinds: device copies (`copy_on_devices`, for every dtype that travels
  as unsigned bits) and numpy buffers filled by threads (`copy`, for the
  rest). Reused memory is handed out again only by the next
  `take_snapshot`, which the manager calls after the previous commit (the
  only reader) has finished. Together they hold one copy of the CPU shards
  this process writes; `clear` frees them.
  """

  def __init__(self, threads: int | None = None, *, arena: Any = None):
    self._threads = threads or min(4, os.cpu_count() or 1)
    # Where `copy` takes its buffers, fresh at every save, if not None
    # (`memfile.SpareArena`); the snapshot then copies every CPU shard
    # with `copy`.
    self.arena = arena
    self._buffers: dict[tuple[Any, ...], np.ndarray] = {}
    # By (group's number, its `GroupKey`): the copies that the next save
    # reuses.
    self._device: dict[Any, list[jax.Array]] = {}
    self._pads: dict[Any, jax.Array] = {}
    self._spent: list[Any] = []  # See `copy_on_devices`.
    self._pool: futures.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()

  def prepare(self) -> None:
    """Starts the thread that compiles the copy programs (see
    `copies.PROGRAMS`), so that the first save only queues its compiles."""
    copies_lib.PROGRAMS.start()

  @property
  def nbytes(self) -> int:
    return (sum(b.nbytes for b in self._buffers.values())
            + sum(a.nbytes for arrays in self._device.values()
                  for a in arrays))

  def clear(self) -> None:
    with self._lock:
      self._buffers = {}
      self._device = {}
      self._spent = []
      self._pads = {}
      if self._pool is not None:
        self._pool.shutdown(wait=True)
        self._pool = None

  def copy_on_devices(self, srcs: list[jax.Array], groups: Any
                      ) -> list[Any]:
    """Starts a copy of each single-device CPU array, in `groups` (see
    `copies.groups`: every array is in one); returns the copies.

    A copy is a `jax.Array` that holds either the source's values (made by
    the runtime) or its bits as unsigned integers (made by a compiled
    program into reused memory), or a `copies.Packed` (its bits in a pack
    of small shards, made by a compiled program); `copies.bits_dtype` must
    accept every dtype. Reused copies of the previous call are donated to
    this one; those not reused are freed. The handles of both go by
    `release_spent` (the commit thread's), or at the next call: dropping a
    donated handle waits for the runtime (2.5 ms for 24 of them here),
    which the caller should not.
    """
    with self._lock:
      old, self._device = self._device, {}
      spent, self._spent = self._spent, [old]
      out: list[Any] = [None] * len(srcs)
      started, by_runtime, lacking = [], [], []
      for n, group in enumerate(groups):
        key = group.key
        programs = copies_lib.PROGRAMS.ready(key)
        if programs is None:  # Not compiled (yet): queued below.
          by_runtime += group.shards
          lacking.append(key)
          continue
        pad = self._pads.get(key.device)
        if pad is None:
          pad = self._pads[key.device] = jax.device_put(
              copies_lib.ENQUEUE_PAD, key.device)
        started.append((n, key, group.shards, programs, pad))
      # The runtime's copies first, the programs last: once a program runs,
      # the runtime's threads take every core, and this thread may wait
      # for one (measured: up to a scheduler's slice, 4 ms, on 2 cores).
      for i, c in zip(by_runtime, copies_lib.fresh_copies(
          [srcs[i] for i in by_runtime])):
        out[i] = c
      for n, key, idx, programs, pad in started:
        arrays = [srcs[i] for i in idx]
        place = (n, key)
        prev = old.pop(place, None)
        if prev is None and programs[0] is None:  # A pack's first memory.
          prev = copies_lib.new_pack(key.device, key.sig)
        try:
          if prev is None:
            copies = programs[0](arrays, pad)[0]
          else:
            copies = programs[1](prev, arrays, pad)[0]
        except (TypeError, ValueError):  # Not what it was compiled for.
          for i, c in zip(idx, copies_lib.fresh_copies(arrays)):
            out[i] = c
          continue
        self._spent.append(prev)
        del prev
        self._device[place] = copies
        if key.kind == copies_lib.PACK:
          for i, offset, nbytes in zip(idx, *key.offsets()):
            out[i] = copies_lib.Packed(copies[0], offset, nbytes)
        else:
          for i, c in zip(idx, copies):
            out[i] = c
      del old
    for key in lacking:  # Compiled in the background, after the copies.
      copies_lib.programs_of(key)
    del spent  # Only if `release_spent` was not called since the last call.
    return out

  def release_spent(self) -> None:
    """Drops the handles that the last `copy_on_devices` replaced."""
    with self._lock:
      spent, self._spent = self._spent, []
    del spent

  def copy_summed(self, srcs: list[np.ndarray], block: int
                  ) -> tuple[list[np.ndarray], list[list[int]]] | None:
    """Copies each source into the arena, block by block, and takes each
    block's CRC-32C right after copying it, while it is in the cache (one
    pass over memory instead of two); returns the buffers and, per buffer,
    its blocks' CRC-32C. None if the arena has no room (see `copy`)."""
    out = self.arena.buffers(srcs)
    if out is None:
      return None
    sums = [[0] * max(1, -(-src.nbytes // block)) for src in srcs]
    jobs = []
    for dst, src, into in zip(out, srcs, sums):
      d = dst.reshape(-1).view(np.uint8)
      s_ = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
      for k, i in enumerate(range(0, max(1, s_.nbytes), block)):
        jobs.append((d[i:i + block], s_[i:i + block], into, k))

    def run(job) -> None:
      d, s_, into, k = job
      np.copyto(d, s_)
      into[k] = crc32c.crc32c(d)

    with self._lock:
      if self._threads == 1 or len(jobs) == 1:
        for job in jobs:
          run(job)
      else:
        for f in [self._executor().submit(run, job) for job in jobs]:
          f.result(timeout=deadlines.IO_TIMEOUT_SECS)  # Copies in memory.
    return out, sums

  def _executor(self) -> futures.ThreadPoolExecutor:
    if self._pool is None:
      self._pool = futures.ThreadPoolExecutor(
          self._threads, thread_name_prefix="flax_ckpt_plugin-snapshot")
    return self._pool

  def copy(self, items: list[tuple[tuple[Any, ...], np.ndarray]]
           ) -> list[np.ndarray]:
    """Copies each source into its buffer (by key); returns the buffers.

    Buffers not named by `items` are freed: the tree changed shape. With
    an arena, the buffers are the arena's, new at every call.
    """
    with self._lock:
      old, self._buffers = self._buffers, {}
      out = None if self.arena is None else self.arena.buffers(
          [src for _, src in items])
      if out is None:
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
        # np.copyto releases the GIL, so the copies run side by side.
        for f in [self._executor().submit(np.copyto, d, s_)
                  for d, s_ in chunks]:
          f.result(timeout=deadlines.IO_TIMEOUT_SECS)  # Copies in memory.
      return out
