"""Tests of the data file's direct-I/O writes and their layout.

Large shards go to the disk with O_DIRECT, each placed at a file offset
congruent to its memory address modulo 4096 so that its aligned middle is
written straight from the snapshot; heads, tails and small shards go
through the page cache. Whatever the layout, a reader that follows the
shard table's offsets must get every byte back.
"""

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from etils import epath
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.backends import datafile
from flax_ckpt_plugin.backends import handles
from flax_ckpt_plugin.format import records
from flax_ckpt_plugin.format import files
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin.save.leaves import LeafSnapshot
from flax_ckpt_plugin.save.leaves import ShardData
from flax_ckpt_plugin import Storage

MIB = 1 << 20


def _direct_io_dir(tmp_path: pathlib.Path) -> pathlib.Path:
  """A directory whose file system takes O_DIRECT writes.

  pytest's tmp_path first; where that is a tmpfs (which refuses O_DIRECT),
  a directory beside the tests, on the checkout's disk.
  """
  here = pathlib.Path(__file__).resolve().parents[1]
  for base in (tmp_path, here):
    d = base / f"direct_io_probe_{os.getpid()}"
    d.mkdir(exist_ok=True)
    probe = d / "probe"
    try:
      fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
      try:
        buf = np.zeros(2 * 4096, np.uint8)
        start = -buf.ctypes.data % 4096
        os.pwrite(fd, memoryview(buf)[start:start + 4096], 0)
      finally:
        os.close(fd)
    except OSError:
      probe.unlink(missing_ok=True)
      d.rmdir()
      continue
    probe.unlink()
    return d
  raise AssertionError(
      f"neither {tmp_path} nor {here} takes O_DIRECT writes: the direct path"
      " cannot be tested on this machine")


@pytest.fixture(name="direct_dir")
def direct_dir_fixture(tmp_path):
  d = _direct_io_dir(tmp_path)
  yield d
  for p in sorted(d.rglob("*"), reverse=True):
    if p.is_dir():
      p.rmdir()
    else:
      p.unlink()
  d.rmdir()


def _leaves(bufs: list[np.ndarray]) -> list[LeafSnapshot]:
  return [LeafSnapshot(f"leaf{i}", [{"dict": f"leaf{i}"}], "array", "uint8",
                       b.shape, [ShardData(((0, b.size),), b)])
          for i, b in enumerate(bufs)]


def _write(step_dir: pathlib.Path, bufs: list[np.ndarray],
           backend: backend_lib.Backend | None = None) -> dict:
  step_dir.mkdir()
  writer.write_process_files(epath.Path(step_dir), _leaves(bufs), 0,
                              backend=backend)
  return json.loads((step_dir / files.index_file(0)).read_text())


def _assert_file_holds(step_dir: pathlib.Path, table: dict,
                       bufs: list[np.ndarray]) -> None:
  data = (step_dir / files.data_file(0)).read_bytes()
  assert len(data) == table["nbytes"]
  for entry, buf in zip(table["shards"], bufs):
    got = data[entry["offset"]:entry["offset"] + entry["nbytes"]]
    assert got == buf.tobytes(), entry["path"]
    assert entry["crc32c"] == records.block_checksums(memoryview(buf))


def _spy_direct(monkeypatch) -> list[tuple[int, bool]]:
  """Records (bytes, whether direct I/O was on) for each shard written."""
  calls = []
  real = datafile.DataFile.write

  def write(self, buf, offset):
    calls.append((buf.nbytes, self.direct))
    real(self, buf, offset)
  monkeypatch.setattr(datafile.DataFile, "write", write)
  return calls


def test_large_shards_are_written_direct_and_read_back(direct_dir,
                                                       monkeypatch):
  calls = _spy_direct(monkeypatch)
  rng = np.random.default_rng(0)
  base = rng.integers(0, 256, 12 * MIB, dtype=np.uint8)
  # Views at addresses of every alignment class, sizes around the threshold.
  bufs = [base[1:3 * MIB + 7], base[3 * MIB + 100:3 * MIB + 200],
          base[4 * MIB + 4096:6 * MIB + 4096], base[7 * MIB + 513:8 * MIB + 513],
          base[9 * MIB + 17:9 * MIB + 17 + MIB - 1]]
  table = _write(direct_dir / "1", bufs)
  _assert_file_holds(direct_dir / "1", table, bufs)
  assert [d for _, d in calls] == [True] * len(bufs)
  for entry, buf in zip(table["shards"], bufs):
    if buf.nbytes >= datafile.DIRECT_MIN_BYTES:
      assert entry["offset"] % 4096 == buf.ctypes.data % 4096
  # The gaps before aligned shards are under 4 KiB each.
  assert table["nbytes"] - sum(b.nbytes for b in bufs) < 4096 * len(bufs)


@hypothesis.settings(max_examples=25, deadline=None,
                     suppress_health_check=[
                         hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(shards=st.lists(
    st.tuples(st.integers(0, 8191),  # Start within the source buffer.
              st.sampled_from([0, 1, 4095, 4096, 4097, MIB - 1, MIB,
                               MIB + 1, 2 * MIB + 12345])),
    min_size=1, max_size=5))
def test_any_layout_reads_back_bit_for_bit(direct_dir, shards):
  rng = np.random.default_rng(len(shards))
  base = rng.integers(0, 256, 3 * MIB + 8192, dtype=np.uint8)
  bufs = [base[start:start + size] for start, size in shards]
  step_dir = direct_dir / f"s{len(list(direct_dir.iterdir()))}"
  table = _write(step_dir, bufs)
  _assert_file_holds(step_dir, table, bufs)


def test_direct_write_refused_falls_back_to_the_page_cache(direct_dir,
                                                          monkeypatch):
  """Fault injected: the file system takes the O_DIRECT open but refuses the
  writes with EINVAL (as some FUSE mounts do). A real file system that does
  this cannot be had here, so `os.pwrite` on the direct descriptor is faked."""
  direct_fds = set()

  class RecordingDirect(backend_lib.LocalBackend):
    """Notes the direct descriptors its step writers open."""

    def step_writer(self, step_dir, identity, data_dir):
      writer = super().step_writer(step_dir, identity, data_dir)
      real_open = writer.open_direct

      def open_direct(name):
        fd = real_open(name)
        direct_fds.add(fd)
        return fd
      writer.open_direct = open_direct
      return writer

  real_pwrite = os.pwrite

  def pwrite(fd, data, offset):
    if fd in direct_fds:
      raise OSError(errno.EINVAL, "Invalid argument")
    return real_pwrite(fd, data, offset)
  monkeypatch.setattr(os, "pwrite", pwrite)
  calls = _spy_direct(monkeypatch)

  rng = np.random.default_rng(1)
  bufs = [rng.integers(0, 256, 2 * MIB + 3, dtype=np.uint8),
          rng.integers(0, 256, 3 * MIB, dtype=np.uint8)]
  table = _write(direct_dir / "1", bufs, RecordingDirect())
  assert direct_fds and None not in direct_fds
  # The first shard met the refusal (its direct writes run on the writing
  # threads, so the second may have been started before it was met): every
  # byte went through the page cache, and the file holds them all.
  assert calls[0][1] is True
  _assert_file_holds(direct_dir / "1", table, bufs)


def test_saved_state_restores_from_a_direct_io_disk(direct_dir, monkeypatch,
                                                    assert_trees_equal,
                                                    host_copy):
  calls = _spy_direct(monkeypatch)
  values = np.random.default_rng(2).standard_normal((1024, 700), np.float32)
  tree = {"w": jnp.asarray(values), "b": jnp.arange(5, dtype=jnp.bfloat16),
          "sharded": jax.device_put(
              jnp.asarray(values[:512]),
              jax.sharding.NamedSharding(
                  jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",)),
                  jax.sharding.PartitionSpec("x")))}
  expected = host_copy(tree)
  with CheckpointManager(direct_dir / "ckpt") as manager:
    manager.save(1, tree)
    manager.wait_until_finished()
    assert any(n >= datafile.DIRECT_MIN_BYTES and d for n, d in calls)
    assert_trees_equal(manager.restore(tree), expected)


def _resident(path: pathlib.Path, upto: int | None = None) -> float:
  """The fraction of the file's pages (of its first `upto` bytes) in the
  page cache (`mincore`), found without reading them."""
  import ctypes  # pylint: disable=g-import-not-at-top
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mmap.restype = ctypes.c_void_p
  libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                        ctypes.c_int, ctypes.c_int, ctypes.c_long]
  size = path.stat().st_size
  pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
  fd = os.open(path, os.O_RDONLY)
  try:
    addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    vec = (ctypes.c_ubyte * pages)()
    try:
      assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size),
                          vec) == 0, ctypes.get_errno()
    finally:
      libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
  finally:
    os.close(fd)
  if upto is not None:
    pages = -(-upto // os.sysconf("SC_PAGE_SIZE"))
  return sum(v & 1 for v in vec[:pages]) / pages


@pytest.mark.parametrize("direct_io,cache_saved",
                         [(True, True), (True, False), (False, True)])
def test_a_saved_step_is_in_the_page_cache_unless_turned_off(
    direct_dir, monkeypatch, direct_io, cache_saved, assert_trees_equal,
    host_copy):
  """A job restarting on the machine that saved restores from memory.

  By default the large shards go straight to the disk, and once the step is
  final the kernel reads its data file back into the page cache in the
  background. LocalBackend(cache_saved=False) leaves it on the disk only;
  LocalBackend(direct_io=False) writes every byte through the page cache.
  """
  calls = _spy_direct(monkeypatch)
  tree = {"w": jnp.asarray(np.random.default_rng(3).standard_normal(
      (2048, 1024), np.float32)), "step": np.int64(3)}
  expected = host_copy(tree)
  backend = backend_lib.LocalBackend(direct_io=direct_io,
                                     cache_saved=cache_saved)
  with CheckpointManager(direct_dir / "ckpt",
                         storage=Storage(backend=backend)) as manager:
    manager.save(1, tree)
    manager.wait_until_finished()
    (data,) = (direct_dir / "ckpt" / "1").rglob("*.bin")
    resident = _resident(data)
    if direct_io and cache_saved:  # The kernel reads it back on its own.
      deadline = time.monotonic() + 30
      while resident < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
        resident = _resident(data)
    else:  # Nothing will: a second look finds it as the save left it.
      time.sleep(0.5)
      assert _resident(data) == resident
    assert_trees_equal(manager.restore(tree), expected)
  assert calls and all(d == direct_io for _, d in calls)
  if direct_io and not cache_saved:
    assert resident < 0.1, resident
  else:
    assert resident == 1.0, resident


def test_reading_back_stops_at_the_piece_after_it_is_told(direct_dir):
  """`read_ahead` reads no more pieces once `stopped()` is true."""
  piece = 4 * MIB
  path = _dropped_file(direct_dir, 16 * piece)
  asked = []

  def stopped():
    asked.append(None)
    return len(asked) > 2  # After two pieces.

  handles.read_ahead(os.fspath(path), stopped, in_flight_bytes=piece)
  time.sleep(0.5)
  assert len(asked) == 3
  assert 2 / 16 <= _resident(path) <= 4 / 16


def test_reading_back_reads_each_piece_before_the_next(direct_dir):
  """A save that begins while a step is read back finds few reads queued
  before its writes (measured on an accelerator machine: unbounded, 1.4 GB
  were, and a 1 GB write took 2.5 times as long): `read_ahead` reads a
  piece of `in_flight_bytes` only once the pieces before it are read, and
  reads the whole file."""
  piece, pieces = 2 * MIB, 16
  path = _dropped_file(direct_dir, pieces * piece)
  before = []  # Per piece about to be read: the pieces before it, resident.

  def stopped():
    read = len(before)
    before.append(_resident(path, read * piece) if read else 1.0)
    return False

  handles.read_ahead(os.fspath(path), stopped, in_flight_bytes=piece)
  assert before == [1.0] * pieces
  assert _resident(path) == 1.0


@pytest.mark.parametrize("kernel", ["no_populate", "refuses_the_advice"])
def test_reading_back_asks_where_a_mapping_cannot_be_populated(
    direct_dir, monkeypatch, kernel):
  """Where the kernel has no `MADV_POPULATE_READ` (before Linux 5.14) or
  refuses it (a real EINVAL, for advice this kernel does not know), the
  pieces are asked for with POSIX_FADV_WILLNEED, still a bounded way
  ahead of the disk: one only once the pieces more than `in_flight_bytes`
  (at least 4 pieces) behind it are read; and the whole file is read."""
  monkeypatch.setattr(handles, "_POPULATE_READ",
                      None if kernel == "no_populate" else 0x7fff)
  piece = handles._read_ahead_bytes(os.stat(direct_dir).st_dev)  # pylint: disable=protected-access
  pieces, depth = 24, 4
  path = _dropped_file(direct_dir, pieces * piece)
  behind = []  # Per piece about to be asked for: those long read, resident.

  def stopped():
    read = len(behind) - depth - 1  # (One piece's slack: its pages may
    behind.append(_resident(path, read * piece) if read > 0 else 1.0)
    return False                    # complete out of order.)

  handles.read_ahead(os.fspath(path), stopped, in_flight_bytes=piece)
  # Refused, the first piece is asked once to be mapped, then asked for.
  assert len(behind) == pieces + (kernel == "refuses_the_advice")
  # The wait reads one byte of the oldest piece; the kernel may still be
  # finishing a few other pages of the pieces behind it (in CI, with a
  # second test worker on the cores: 0.9992 resident). A reader that did
  # not wait would find pieces long asked for still mostly on the disk.
  assert min(behind) >= 0.99, behind
  # WILLNEED's reads may leave out a few pages the kernel cannot allocate
  # at once (read-ahead allocates without retrying; in CI, with a second
  # test worker: 0.9997 of the file, 30 s later); a reader that asked for
  # less than the whole file would leave out a piece or more.
  start = time.monotonic()
  while _resident(path) < 1.0 and time.monotonic() - start < 5:
    time.sleep(0.05)
  assert _resident(path) >= 1.0 - 1 / (2 * pieces)


def _dropped_file(directory: pathlib.Path, nbytes: int) -> pathlib.Path:
  """A file of `nbytes` on the disk, none of it in the page cache."""
  path = directory / "data.bin"
  path.write_bytes(np.random.default_rng(0).integers(
      0, 256, nbytes, np.uint8).tobytes())
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)
  assert _resident(path) < 0.1
  return path


def test_a_save_beginning_drops_the_reading_back_of_an_older_step(
    direct_dir):
  """Saves that follow each other closely are not slowed by reading back
  steps they make stale: the read waits for a quiet spell, and a save that
  begins meanwhile in the same directory (its writer opened) drops it."""
  path = _dropped_file(direct_dir, 32 * MIB)
  directory = epath.Path(direct_dir)
  backend = backend_lib.LocalBackend()
  backend.prefetch(directory, epath.Path(path), quiet_secs=30)
  (direct_dir / "2").mkdir()
  backend.step_writer(directory / "2", None, "d").close()
  backend.close_directory(directory, wrote=True)  # Nothing left to read.
  time.sleep(0.5)
  assert _resident(path) < 0.1


def test_a_closing_writer_has_its_newest_step_read_back_at_once(direct_dir):
  """A save in another directory (the local tier's, say) leaves the read
  pending, a read-only manager's close does not start it, and the writer's
  close starts it at once, not after the quiet spell, and returns once the
  step is read (`test_a_normal_close_waits_for_the_read_back_within_its_
  bound`: no longer than its bound)."""
  path = _dropped_file(direct_dir, 32 * MIB)
  directory = epath.Path(direct_dir)
  other = direct_dir / "other"
  (other / "1").mkdir(parents=True)
  backend = backend_lib.LocalBackend()
  backend.prefetch(directory, epath.Path(path), quiet_secs=300)
  backend.step_writer(epath.Path(other / "1"), None, "d").close()
  backend.close_directory(directory)  # A reader: wrote=False.
  time.sleep(0.5)
  assert _resident(path) < 0.1
  backend.close_directory(directory, wrote=True)
  assert _resident(path) == 1.0


def test_read_back_benchmark_reports_every_bound(direct_dir):
  """benchmarks/read_back.py, tiny: each bound's reading back and the write
  against it, twice, and nothing left behind."""
  script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "read_back.py"
  proc = subprocess.run(
      [sys.executable, str(script), "--dir", str(direct_dir), "--gb", "0.0625",
       "--write-gb", "0.0625"], capture_output=True, text=True, timeout=120,
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for bound in ("unbounded", "32 MB", "64 MB"):
    assert proc.stdout.count(f"{bound}: asked in ") == 2, proc.stdout
    assert proc.stdout.count(f"{bound}: a direct write of ") == 2, proc.stdout
  assert list(direct_dir.iterdir()) == []


def _stalled(read) -> float:
  """The share of the time `read()` took on another thread that the
  calling thread, running Python all along as a train loop dispatching its
  steps would, spent without the interpreter (in gaps over 1 ms)."""
  thread = threading.Thread(target=read, name="test-read-back")
  stalled, start = 0.0, time.perf_counter()
  last = start
  thread.start()
  while thread.is_alive():
    now = time.perf_counter()
    if now - last > 0.001:
      stalled += now - last
    last = now
  thread.join()
  return stalled / (time.perf_counter() - start)


def _preadv_whole(path: pathlib.Path, piece: int) -> None:
  buf = memoryview(bytearray(piece))
  fd = os.open(path, os.O_RDONLY)
  try:
    offset = 0
    while n := os.preadv(fd, [buf], offset):
      offset += n
  finally:
    os.close(fd)


def _drop(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)
  assert _resident(path) < 0.1


def test_reading_back_leaves_the_loop_s_thread_running(direct_dir):
  """While a cold step is read back (32 MB pieces, as after a save), the
  loop's thread is stopped no more of the time than while `os.preadv`,
  which lets go of the interpreter's lock, reads the same file: the
  kernel's reads run without the lock. (Before, the populating
  `mmap.madvise` kept it: here 50-63% of the read-back's time stalled,
  against 10-19% for `os.preadv`, and 0% now.)"""
  piece = 32 * MIB
  path = _dropped_file(direct_dir, 4 * piece)
  stalled = {"read_ahead": [], "preadv": []}
  for _ in range(2):  # Alternated: the disk and the cores are shared.
    _drop(path)
    stalled["read_ahead"].append(_stalled(
        lambda: handles.read_ahead(os.fspath(path), in_flight_bytes=piece)))
    assert _resident(path) == 1.0
    _drop(path)
    stalled["preadv"].append(_stalled(lambda: _preadv_whole(path, piece)))
  assert min(stalled["read_ahead"]) <= max(stalled["preadv"]) + 0.05, stalled


class _SlowReadBack:
  """`handles.read_ahead` as on a disk that takes `secs` to read the step
  back (a 13 GB state at 2 GB/s takes 6.5 s), in pieces that look at
  `stopped()` as the real one does; records when it began and ended."""

  def __init__(self, secs: float):
    self.secs = secs
    self.began, self.ended = threading.Event(), threading.Event()
    self.stopped_early = False

  def __call__(self, path, stopped=lambda: False, in_flight_bytes=0):
    del path, in_flight_bytes
    self.began.set()
    end = time.monotonic() + self.secs
    try:
      while time.monotonic() < end:
        if stopped():
          self.stopped_early = True
          return
        time.sleep(0.02)
    finally:
      self.ended.set()


def _closed_in(close) -> float:
  start = time.monotonic()
  close()
  return time.monotonic() - start


@pytest.mark.parametrize("how", ["preempted", "error"])
def test_a_leaving_close_reads_nothing_back_and_stops_what_reads(
    direct_dir, monkeypatch, how):
  """A close after a preemption stop (SIGTERM: `should_stop`), or leaving
  the callback's `with` block by an error, returns within 0.5 s while the
  step's read-back would take 20 s, and stops that read-back: the grace
  period is not spent filling a page cache that goes with the machine."""
  from flax_ckpt_plugin.backends import local  # pylint: disable=g-import-not-at-top
  slow = _SlowReadBack(20.0)
  monkeypatch.setattr(handles, "read_ahead", slow)
  monkeypatch.setattr(local, "READ_BACK_WAIT_SECS", 30.0)
  previous = signal.signal(signal.SIGTERM, lambda *_: None)
  state = {"w": jnp.arange(1 << 20, dtype=jnp.float32)}
  try:
    cb = CheckpointCallback(direct_dir / "ckpt", every_steps=1)
    if how == "preempted":
      os.kill(os.getpid(), signal.SIGTERM)
      assert cb(1, state) and cb.should_stop  # Saved, durable, stopping.
      assert slow.began.wait(10)  # After the commit's quiet spell.
      secs = _closed_in(cb.close)
    else:
      with pytest.raises(ValueError, match="the loop failed"):
        with cb:
          assert cb(1, state)
          cb.wait_until_finished()
          assert slow.began.wait(10)
          raised = time.monotonic()
          raise ValueError("the loop failed")
      secs = time.monotonic() - raised
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert secs < 0.5, secs
  assert slow.ended.wait(0.5) and slow.stopped_early
  with CheckpointManager(direct_dir / "ckpt", read_only=True) as manager:
    assert manager.all_steps() == [1]


def test_a_normal_close_waits_for_the_read_back_within_its_bound(
    direct_dir, monkeypatch):
  """A writer that closes normally waits for its newest step's read-back
  (a job restarting here restores from memory), but no longer than
  `READ_BACK_WAIT_SECS`, even on a disk that would take 20 s."""
  from flax_ckpt_plugin.backends import local  # pylint: disable=g-import-not-at-top
  slow = _SlowReadBack(20.0)
  monkeypatch.setattr(handles, "read_ahead", slow)
  monkeypatch.setattr(local, "READ_BACK_WAIT_SECS", 1.0)
  manager = CheckpointManager(direct_dir / "ckpt")
  manager.save(1, {"w": jnp.arange(1 << 20, dtype=jnp.float32)})
  manager.wait_until_finished()
  secs = _closed_in(manager.close)
  assert 0.9 <= secs < 2.0, secs
  assert slow.began.is_set() and not slow.ended.is_set()


_EXIT_SCRIPT = """
import atexit, sys, time
import jax.numpy as jnp
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.backends import handles, local

def slow(path, stopped=lambda: False, in_flight_bytes=0):  # A slow disk.
  end = time.monotonic() + 60
  while time.monotonic() < end and not stopped():
    time.sleep(0.02)

handles.read_ahead, local.READ_BACK_WAIT_SECS = slow, 60.0
manager = CheckpointManager(sys.argv[1])
manager.save(1, {"w": jnp.arange(1 << 20, dtype=jnp.float32)})
manager.wait_until_finished()
atexit.register(lambda: print(f"closed {time.monotonic() - t:.2f}"))
atexit.register(manager.close)  # (Handlers run last registered first.)
t = time.monotonic()
"""


@pytest.mark.multiprocess
def test_a_close_at_interpreter_exit_reads_nothing_back(direct_dir):
  """A program whose `close()` runs at the interpreter's exit (an
  `atexit` handler) does not wait for its step's read-back: it is exiting,
  maybe because its machine is being taken away."""
  proc = subprocess.run(
      [sys.executable, "-c", _EXIT_SCRIPT, str(direct_dir / "ckpt")],
      capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  secs = float(proc.stdout.split("closed ")[1])
  assert secs < 0.5, proc.stdout
