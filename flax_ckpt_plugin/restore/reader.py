"""Reading a step's data: byte ranges of files, and regions of array leaves.

`ByteReader` reads byte ranges of the data files that a manifest names,
refusing files that are missing, short, not regular or outside the step
directory. `LeafReader` assembles any region of one saved array from the
shards that hold it, checking the CRC-32C of every block it reads. Both
read a `manifest.Manifest`'s records and need no JAX: `restore` puts the
regions on devices, `verify` checks whole steps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import math
import os
import threading
from typing import Iterable, Iterator, Sequence

from etils import epath
import numpy as np

from flax_ckpt_plugin.backends import backend as backend_lib
from flax_ckpt_plugin.backends import handles
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format.records import chunk_regions
from flax_ckpt_plugin.format.records import Index
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.format.records import ShardRecord
from flax_ckpt_plugin.format.storage import block_checksums

# Errors that mean a manifest's file name cannot name a data file.
# Past this many runs of fewer than this many bytes, one saved shard's part
# is read as whole rows of its first axis: a few larger reads beat many tiny.
_MAX_RUNS = 4096
_SMALL_RUN = 64 << 10
# `ByteReader.coalesced`: shards under this size are read together with
# the neighbours they touch (small shards lie side by side in a data file),
# in reads of at most `_SPAN` bytes. Where a read is a request (object
# stores), across gaps of up to `_GAP` bytes too, read and dropped.
COALESCE_BYTES = 1 << 20
_GAP = 64 << 10
_SPAN = 16 << 20


# A whole shard of at least 2 x this many bytes is read by several threads
# (`LeafReader._read_checked`), at most `_READ_THREADS`, from one pool of
# the process: they only read and check, and never wait for each other.
_PIECE_BYTES = 16 << 20
_READ_THREADS = min(8, os.cpu_count() or 1)
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
  global _POOL
  with _POOL_LOCK:
    if _POOL is None:
      _POOL = concurrent.futures.ThreadPoolExecutor(
          _READ_THREADS, thread_name_prefix="flax_ckpt_plugin-read")
    return _POOL


def host_buffer(shape: Sequence[int], dtype: np.dtype, *,
                offset: int = 0) -> np.ndarray:
  """An uninitialized C-order array starting `offset` bytes past a 64-byte
  boundary.

  The CPU backend adopts memory on such a boundary in `jax.device_put`
  without copying it, and copies any other (numpy's own allocations are
  only 16-byte aligned, so either may happen to them). Restored CPU arrays
  are not adopted (see `placement._owned_cpu_buffer` and
  `placement.place_array`); adopted ones are for numpy targets and the
  other cases.
  """
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + 128, np.uint8)
  start = -raw.ctypes.data % 64 + offset
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def _intersect(a: Index, b: Index) -> Index | None:
  out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
  if any(lo >= hi for lo, hi in out):
    return None
  return out


def _runs_of(numbers: list[int]) -> Iterator[tuple[int, int]]:
  """(first, last) of each run of consecutive numbers in sorted `numbers`."""
  for _, run in itertools.groupby(enumerate(numbers), lambda p: p[1] - p[0]):
    run = [k for _, k in run]
    yield run[0], run[-1]


def held_elements(shards: Iterable[ShardRecord], region: Index) -> int:
  """How many elements of `region` the (non-overlapping) `shards` hold."""
  return sum(math.prod(hi - lo for lo, hi in inter) for inter in (
      _intersect(s.index, region) for s in shards) if inter is not None)


class ByteReader:
  """Reads byte ranges of a step's data files; one open handle per file.

  Safe to use from several threads: each file is a `backend.RangedFile`
  (positional reads of one descriptor on local disks, one ranged GET per
  range on object stores).
  """

  def __init__(self, step_dir: epath.Path, files: dict[str, int],
               backend: backend_lib.Backend | None = None):
    self._dir = step_dir
    self._sizes = files
    self._backend = backend or backend_lib.for_path(step_dir)
    self._files: dict[str, backend_lib.RangedFile] = {}
    self._lock = threading.Lock()
    self._local = threading.local()  # `coalesced` spans of each thread.
    self.bytes_read = 0
    # Each read costs a request on object stores: readers of a few spread
    # ranges should rather fetch the span around them in one (see restore).
    self.prefers_few_reads = self._backend.reads_are_requests

  def _open(self, name: str) -> backend_lib.RangedFile:
    with self._lock:
      return self._open_locked(name)

  def _open_locked(self, name: str) -> backend_lib.RangedFile:
    f = self._files.get(name)
    if f is None:
      path = self._dir / name
      try:
        f = self._backend.open_ranged(path, within=self._dir)
      except FileNotFoundError as e:
        raise CheckpointCorruptedError(
            f"data file {path} named by the manifest is missing") from e
      except OSError as e:
        if e.errno not in handles.NOT_A_FILE:
          raise  # EACCES, EIO...: the file may be fine; do not call it bad.
        raise CheckpointCorruptedError(
            f"data file {path} named by the manifest cannot be a data file:"
            f" {e.strerror}") from e
      except CheckpointCorruptedError:
        raise  # A ValueError too, but already says what is wrong.
      except ValueError as e:  # A NUL byte in the name.
        raise CheckpointCorruptedError(
            f"data file name {name!r:.100} is not a valid file name") from e
      if f.size < self._sizes[name]:
        f.close()  # Not kept: every later open says the same.
        raise CheckpointCorruptedError(
            f"data file {path} is truncated: {f.size} bytes, manifest says"
            f" {self._sizes[name]}")
      self._files[name] = f
    return f

  def check_file(self, name: str) -> None:
    """Opens `name` if not yet open: raises if it is not whole.

    Called before allocating for a shard's bytes, so that a manifest's
    sizes never drive an allocation beyond what the files really hold.
    """
    self._open(name)

  def read_into(self, name: str, offset: int, out: memoryview) -> None:
    """Fills `out` with the bytes at [offset, offset + len(out)) of `name`."""
    for lo, data in getattr(self._local, "spans", {}).get(name, ()):
      if lo <= offset and offset + len(out) <= lo + len(data):
        out[:] = data[offset - lo:offset - lo + len(out)]
        return
    done = self._open(name).read_into(offset, out)
    if done < len(out):
      raise CheckpointCorruptedError(
          f"data file {self._dir / name} ended at byte {offset + done},"
          f" expected {offset + len(out)}")
    with self._lock:
      self.bytes_read += done

  @contextlib.contextmanager
  def mapped(self, name: str, offset: int, size: int, fresh: int
             ) -> Iterator[memoryview | None]:
    """The bytes at [offset, offset + size) of `name` as a read-only view of
    the file's pages, valid inside the context; None where the storage
    maps nothing (see `backend.RangedFile.mapped`). `fresh` of them count
    as read: the others were mapped before, for the caller's last region."""
    with self._open(name).mapped(offset, size) as view:
      if view is not None:
        with self._lock:
          self.bytes_read += fresh
      yield view

  @contextlib.contextmanager
  def coalesced(self, ranges: Iterable[tuple[str, int, int]]) -> Iterator[None]:
    """Reads the (file, offset, size) ranges in few reads, merged where near.

    Until the context exits, this thread's reads that fall inside one of
    them are served from memory: thousands of small leaves cost tens of
    reads (on object stores, requests) instead of thousands.
    """
    spans: dict[str, list[tuple[int, memoryview]]] = {}
    merged: list[list] = []
    gap = _GAP if self.prefers_few_reads else 0
    for name, lo, size in sorted(ranges):
      last = merged[-1] if merged else None
      if (last is not None and last[0] == name and lo - last[2] <= gap
          and max(last[2], lo + size) - last[1] <= _SPAN):
        last[2] = max(last[2], lo + size)
      else:
        merged.append([name, lo, lo + size])
    for name, lo, hi in merged:
      data = memoryview(np.empty(hi - lo, np.uint8))
      try:
        self.read_into(name, lo, data)
      except (CheckpointCorruptedError, OSError):
        continue  # Each leaf's own read reports it, naming the leaf.
      spans.setdefault(name, []).append((lo, data))
    self._local.spans = spans
    try:
      yield
    finally:
      self._local.spans = {}

  def close(self) -> None:
    for f in self._files.values():
      f.close()
    self._files.clear()


class LeafReader:
  """Assembles regions of one saved array leaf from its shards.

  With `verify`, every byte that reaches the result comes from a checksum
  block that was read whole and matched its CRC-32C: a shard read whole is
  checked in place; a part of a shard is read as the span of whole blocks
  around it. Without `verify`, exactly the needed bytes are read.
  """

  def __init__(self, *, reader: ByteReader, leaf: LeafRecord, where: str,
               verify: bool, block: int):
    self._reader = reader
    self._where = f"{where}, leaf {leaf.path!r}"
    self._verify = verify
    self._block = block
    self.dtype = leaf.dtype
    self.shape = leaf.shape
    self._shards = leaf.shards
    # Per shard: a buffer of its bytes (pages touched only where read) and the
    # blocks in it already read and checked, so no block is read twice.
    self._verified: dict[int, tuple[np.ndarray, set[int]]] = {}
    self._edges: dict[tuple[int, int], memoryview] = {}  # (shard, block).
    self._used: set[tuple[int, int]] = set()  # Edges of the latest read.
    self._mapped_blocks: dict[int, set[int]] = {}  # Per shard, by `mapped`.

  def small_shard_ranges(self, regions: Iterable[Index]
                         ) -> Iterator[tuple[str, int, int]]:
    """(file, offset, size) of the shards under `COALESCE_BYTES` that
    `regions` need whole, for `ByteReader.coalesced`.

    Verified reads take each such shard whole anyway (it is one checksum
    block), and where reads are requests a few more bytes cost less than
    one more; otherwise unverified reads take exactly the bytes needed, so
    a shard only partly needed is left to them.
    """
    regions = list(regions)
    any_part = self._verify or self._reader.prefers_few_reads
    for shard in self._shards:
      if shard.nbytes >= COALESCE_BYTES:
        continue
      parts = [_intersect(shard.index, r) for r in regions]
      if any(p is not None if any_part else p == shard.index
             for p in parts):
        yield shard.file, shard.offset, shard.nbytes

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

  def read_chunks(self, region: Index, limit: int
                  ) -> Iterator[tuple[Index, np.ndarray]]:
    """`region` in pieces of at most `limit` bytes, in C order
    (`chunk_regions`): (piece, its values), the values in one buffer
    reused for every piece, valid until the next is asked for.

    Memory stays about `limit` plus a few checksum blocks, whatever the
    region's size: between pieces, only the blocks at the edge of the
    last piece are kept (the next piece starts in them).
    """
    itemsize = self.dtype.itemsize
    buf = None
    for piece in chunk_regions(region, itemsize, limit):
      shape = [hi - lo for lo, hi in piece]
      if buf is None:  # Sized for the first (largest) piece.
        buf = host_buffer([math.prod(shape)], self.dtype)
      self._used = set()
      yield piece, self.read(piece, out=buf[:math.prod(shape)].reshape(shape))
      self._edges = {k: v for k, v in self._edges.items() if k in self._used}
      self._verified.clear()

  def _read(self, region: Index, out: np.ndarray | None) -> np.ndarray:
    if out is None:
      out = host_buffer([hi - lo for lo, hi in region], self.dtype)
    filled = 0
    for n, shard in enumerate(self._shards):
      inter = _intersect(shard.index, region) if region else ()
      if inter is None:
        continue
      filled += math.prod(hi - lo for lo, hi in inter)
      self._read_part(n, shard, inter, region, out)
    if filled != out.size:
      raise CheckpointCorruptedError(
          f"{self._where}: shards cover {filled} of the {out.size} elements"
          f" of region {region}")
    return out

  @contextlib.contextmanager
  def mapped(self, region: Index) -> Iterator[np.ndarray | None]:
    """`region`'s values as a read-only array over the data file's pages,
    its blocks checked when `verify` is set, valid inside the context; None
    where that does not apply: the region is not one run of bytes of one
    saved shard, or the storage maps nothing.

    For a caller that copies the values anyway (`placement`): the copy out
    of the file's pages is then the only one, where `read` first copies the
    file into the destination, which must exist (be written) before.
    """
    shape = [hi - lo for lo, hi in region]
    for n, shard in enumerate(self._shards):
      if _intersect(shard.index, region) == region:
        break
    else:
      yield None
      return
    offsets, run_bytes, _ = self._runs(shard.index, region)
    if len(offsets) != 1 or run_bytes != math.prod(shape) * self.dtype.itemsize:
      yield None
      return
    lo, hi = offsets[0], offsets[0] + run_bytes
    block = self._block
    if self._verify:  # The whole blocks around the run.
      a, b = lo // block * block, min(-(-hi // block) * block, shard.nbytes)
      # Each block is checked (and counted as read) once for all regions:
      # the one at the edge of two is mapped for both.
      checked = self._mapped_blocks.setdefault(n, set())
      fresh = [k for k in range(a // block, -(-b // block))
               if k not in checked]
      fresh_bytes = sum(min((k + 1) * block, shard.nbytes) - k * block
                        for k in fresh)
    else:  # Exactly the run.
      a, b, fresh = lo, hi, []
      fresh_bytes = b - a
    self._reader.check_file(shard.file)
    damage = None
    with self._reader.mapped(shard.file, shard.offset + a, b - a,
                             fresh_bytes) as view:
      if view is None:
        yield None
        return
      try:
        for first, last in _runs_of(fresh):
          self._check_spread(shard, first, view[first * block - a:min(
              (last + 1) * block, shard.nbytes) - a])
      except CheckpointCorruptedError as e:
        # Raised once unmapped: the error's frames would keep views of
        # the pages (and the mapping) alive as long as the error is kept.
        damage = str(e)
      else:
        if self._verify:
          checked.update(fresh)
        yield np.frombuffer(view[lo - a:hi - a], np.uint8).view(
            self.dtype).reshape(shape)
    if damage is not None:
      raise CheckpointCorruptedError(damage)

  def _check_spread(self, shard: ShardRecord, first_block: int,
                    data: memoryview) -> None:
    """`_check` of `data`, large ones split over the read threads."""
    spans = self._spans(len(data))
    if len(spans) == 1:
      self._check(shard, first_block, data)
      return
    for f in [_read_pool().submit(
        self._check, shard, first_block + lo // self._block, data[lo:hi])
              for lo, hi in spans]:
      f.result()

  def _spans(self, nbytes: int) -> list[tuple[int, int]]:
    """[lo, hi) byte spans of whole blocks that split `nbytes` over the read
    threads: one per `_PIECE_BYTES` at least, one for a small shard."""
    pieces = max(1, min(_READ_THREADS, nbytes // _PIECE_BYTES))
    step = max(1, -(-nbytes // pieces // self._block)) * self._block
    return [(lo, min(lo + step, nbytes))
            for lo in range(0, nbytes, step)] or [(0, 0)]

  def _read_checked(self, shard: ShardRecord, flat: memoryview) -> None:
    """Reads a whole shard into `flat`, checking every block when `verify`
    is set. A large shard is read in pieces of whole blocks by the read
    threads at once: one reader alone leaves a disk's queue and the other
    cores idle (measured: a 256 MB shard from the page cache at 5 GB/s on
    one core)."""
    spans = self._spans(len(flat))

    def read(span: tuple[int, int]) -> None:
      lo, hi = span
      if not self._verify:
        self._reader.read_into(shard.file, shard.offset + lo, flat[lo:hi])
        return
      # Block by block: each is checked while it is still in the cache.
      for a in range(lo, hi, self._block):
        b = min(a + self._block, hi)
        self._reader.read_into(shard.file, shard.offset + a, flat[a:b])
        self._check(shard, a // self._block, flat[a:b])

    if len(spans) == 1:
      read(spans[0])
      return
    for f in [_read_pool().submit(read, span) for span in spans]:
      f.result()

  def _check(self, shard: ShardRecord, first_block: int,
             data: memoryview) -> None:
    """Compares the blocks in `data` (from block `first_block`) to the sums."""
    expected = shard.crc32c[first_block:]
    actual = block_checksums(data, self._block)
    for n, (want, got) in enumerate(zip(expected, actual)):
      if want != got:
        lo = (first_block + n) * self._block
        hi = min(lo + self._block, shard.nbytes)
        raise CheckpointCorruptedError(
            f"{self._where}: checksum mismatch in {shard.file} at bytes"
            f" [{shard.offset + lo}, {shard.offset + hi}) (shard"
            f" {shard.index_list}): crc32c {got:#010x}, manifest says"
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

  def _read_range_verified(self, n: int, shard: ShardRecord, lo: int,
                           dest: memoryview) -> None:
    """Fills `dest` with shard `n`'s bytes from `lo`, checking every block.

    Blocks inside the range are read straight into `dest` and checked
    there; only the (at most two) blocks at its edges go through scratch,
    kept for the neighbouring region that needs the rest of them.
    """
    hi, block = lo + len(dest), self._block
    name, base = shard.file, shard.offset
    # Whole blocks inside [lo, hi); the shard's last block may be short.
    inner_lo = -(-lo // block) * block
    inner_hi = hi if hi == shard.nbytes else hi // block * block
    inner_hi = max(inner_lo, inner_hi)
    if inner_lo < inner_hi:
      view = dest[inner_lo - lo:inner_hi - lo]
      self._reader.read_into(name, base + inner_lo, view)
      self._check(shard, inner_lo // block, view)
    for k in {lo // block, (hi - 1) // block}:
      a, b = k * block, min((k + 1) * block, shard.nbytes)
      if inner_lo <= a and b <= inner_hi:
        continue  # Read whole above.
      scratch = self._edges.get((n, k))
      if scratch is None:
        self._reader.check_file(name)
        scratch = memoryview(np.empty(b - a, np.uint8))
        self._reader.read_into(name, base + a, scratch)
        self._check(shard, k, scratch)
        self._edges[(n, k)] = scratch
      self._used.add((n, k))
      s, e = max(a, lo), min(b, hi)
      dest[s - lo:e - lo] = scratch[s - a:e - a]

  def _verified_bytes(self, n: int, shard: ShardRecord, lo: int,
                      hi: int) -> memoryview:
    """Shard `n` as bytes, with at least [lo, hi) read in whole blocks.

    The blocks are checked when `verify` is set. Each block is read once
    for all the regions of this leaf that need it.
    """
    if n not in self._verified:
      self._reader.check_file(shard.file)
      self._verified[n] = (np.empty(shard.nbytes, np.uint8), set())
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
      a, b = k * block, min(j * block, shard.nbytes)
      self._reader.read_into(shard.file, shard.offset + a, view[a:b])
      if self._verify:
        self._check(shard, k, view[a:b])
      done.update(range(k, j))
      k = j
    return view

  def _read_part(self, n: int, shard: ShardRecord, inter: Index,
                 region: Index, out: np.ndarray) -> None:
    """Copies the part `inter` of saved shard `n` into `out`."""
    index = shard.index
    offsets, run_bytes, local = self._runs(index, inter)
    part_shape = [hi - lo for lo, hi in local]
    direct = inter == region and part_shape == list(out.shape)
    part = out if direct else np.empty(part_shape, dtype=self.dtype)
    flat = memoryview(part.reshape(-1).view(np.uint8))
    name, base = shard.file, shard.offset
    whole = run_bytes * len(offsets) == shard.nbytes
    # Exactly the runs, one read each; but where a read is a request (object
    # stores), many runs are fetched as the blocks around them instead.
    exact = not self._verify and (len(offsets) == 1
                                  or not self._reader.prefers_few_reads)
    if whole and len(offsets) == 1:  # Read whole: check it where it lies.
      self._read_checked(shard, flat)
    elif exact or whole:
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
