"""Reading regions of a step's array leaves, checked.

`LeafReader` assembles any region of one saved array from the shards that
hold it, read through a `data_files.ByteReader`, checking the CRC-32C of
every block it reads. It reads a `manifest.Manifest`'s records and needs no
JAX: `restore` puts the regions on devices, `verify` checks whole steps.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Iterable, Iterator, NamedTuple

import numpy as np

from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format.records import chunk_regions
from flax_ckpt_plugin.format.records import Index
from flax_ckpt_plugin.format.records import intersect
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.format.records import ShardRecord
from flax_ckpt_plugin.format.records import block_checksums
from flax_ckpt_plugin.restore.data_files import ByteReader
from flax_ckpt_plugin.restore.data_files import COALESCE_BYTES
from flax_ckpt_plugin.restore.data_files import host_buffer
from flax_ckpt_plugin.restore.data_files import on_read_threads
from flax_ckpt_plugin.restore.data_files import PIECE_BYTES
from flax_ckpt_plugin.restore.data_files import READ_THREADS

# Past this many runs of fewer than this many bytes, one saved shard's part
# is read as whole rows of its first axis: a few larger reads beat many tiny.
# Not where the rows hold over `_MAX_WASTE` times the bytes needed and the
# runs are of `_TINY_RUN` bytes at least: a target that splits the columns
# of a large array over 8 devices (an embedding of 50257 rows, which no
# device count divides) would read it 8 times over, and reads of a few
# hundred bytes each cost less than that.
_MAX_RUNS = 4096
_SMALL_RUN = 64 << 10
_TINY_RUN = 256
_MAX_WASTE = 4


def _runs_of(numbers: list[int]) -> Iterator[tuple[int, int]]:
  """(first, last) of each run of consecutive numbers in sorted `numbers`."""
  for _, run in itertools.groupby(enumerate(numbers), lambda p: p[1] - p[0]):
    run = [k for _, k in run]
    yield run[0], run[-1]


class LeafReads(NamedTuple):
  """How every leaf of one restore is read.

  Attributes:
    reader: the step's data files.
    verify: check every block read against its CRC-32C.
    block: bytes per checksum of the shards.
    where: how messages name the step ("step 5 in /ckpt/5").
    cast: convert leaves to the target's dtype as they are read
      (`casting`; `placement.restore_leaf` does).
  """
  reader: ByteReader
  verify: bool
  block: int
  where: str
  cast: bool = False

  def open(self, leaf: LeafRecord) -> LeafReader:
    """The reader of `leaf`'s regions."""
    return LeafReader(reader=self.reader, leaf=leaf, where=self.where,
                      verify=self.verify, block=self.block)


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
      parts = [intersect(shard.index, r) for r in regions]
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
      inter = intersect(shard.index, region) if region else ()
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
      if intersect(shard.index, region) == region:
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

  @contextlib.contextmanager
  def pinned(self, region: Index) -> Iterator[Any]:
    """`region`'s values as the `jax.Array` in pinned host memory that
    holds exactly them (the snapshot of the step this process saved:
    `backends.held`), its blocks checked as `mapped` checks them, valid
    inside the context; None where there is none: the region is not one
    whole saved shard, or no such array holds it. A restore sends it to
    the device as it is: no host buffer, no copy on the host."""
    shape = tuple(hi - lo for lo, hi in region)
    nbytes = math.prod(shape) * self.dtype.itemsize
    # The shard `mapped` checks the bytes of: the first that holds them.
    shard = next((s for s in self._shards
                  if intersect(s.index, region) == region), None)
    arr = None if shard is None or shard.nbytes != nbytes else (
        self._reader.pinned_array(shard.file, shard.offset, shard.nbytes))
    if (arr is None or arr.dtype != self.dtype
        or tuple(arr.shape) != shape):
      yield None
      return
    with self.mapped(region) as view:
      yield None if view is None else arr

  def _check_spread(self, shard: ShardRecord, first_block: int,
                    data: memoryview) -> None:
    """`_check` of `data` (a mapped view: the check is where its pages are
    first touched, so it runs with the reads' deadline), large ones split
    over the read threads."""
    spans = self._spans(len(data))
    if len(spans) == 1:
      self._reader.in_flight.call(
          lambda: self._check(shard, first_block, data),
          f"{self._where}: checking mapped bytes of {shard.file}")
      return
    on_read_threads(lambda span: self._check(
        shard, first_block + span[0] // self._block, data[span[0]:span[1]]),
                    spans, self._reader.in_flight)

  def _spans(self, nbytes: int) -> list[tuple[int, int]]:
    """[lo, hi) byte spans of whole blocks that split `nbytes` over the read
    threads: one per `PIECE_BYTES` at least, one for a small shard."""
    pieces = max(1, min(READ_THREADS, nbytes // PIECE_BYTES))
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
    on_read_threads(read, spans, self._reader.in_flight)

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
    whole rows of the first axis instead, where those are not mostly bytes
    that are not needed.

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
    run_bytes = run_elems * self.dtype.itemsize
    rows = (local[0][1] - local[0][0]) * strides[0]
    if runs > _MAX_RUNS and run_bytes < _SMALL_RUN and (
        run_bytes < _TINY_RUN or rows <= _MAX_WASTE * runs * run_elems):
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
