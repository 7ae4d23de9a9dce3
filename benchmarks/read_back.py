"""Reading a saved step back into the page cache against a save's writes.

    python benchmarks/read_back.py --dir /path/on/the/disk --gb 3

A file of `--gb` GiB written with direct I/O and dropped from the page cache is
read back by `handles.read_ahead`, bounded as the package does it (pieces
of 32 MB, each read before the next is asked for), at 64 MB, and
unbounded (as fast as the kernel takes the asking); for each, twice: the
time the asking takes and until the whole file is read; then, 0.3 s into
another reading back, a direct write of `--write-gb` GiB (a save) begins
and stops it: the write's time, beside the same write alone.

Then what a restore pays for the file's pages, as each way of reading it
back left them: `read_ahead` (pieces mapped and populated), its fallback
(POSIX_FADV_WILLNEED, `handles._ask_ahead`) and plain `read`s; for each,
twice, on one thread: mapping the whole file (populated at once), copying
it out into memory already touched, unmapping it; and reading it with
`preadv` into that memory. The directory must take O_DIRECT writes (not
tmpfs).
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time

from flax_ckpt_plugin.backends import handles

CHUNK = 64 << 20


def _write(path: str, nbytes: int, buf: mmap.mmap) -> float:
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
  t = time.perf_counter()
  for i in range(nbytes // CHUNK):
    os.pwrite(fd, buf, i * CHUNK)
  os.fsync(fd)
  os.close(fd)
  return time.perf_counter() - t


def _drop(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  os.close(fd)


def _read_all(path: str) -> float:
  """Reads the file through (page cache or disk): seconds."""
  t = time.perf_counter()
  with open(path, "rb", buffering=0) as f:
    view = memoryview(bytearray(CHUNK))
    while f.readinto(view):
      pass
  return time.perf_counter() - t


def _restore_costs(path: str, out: memoryview) -> str:
  """Seconds to map, copy out of and unmap the cached file, and to read
  it with `preadv`, into `out` (a chunk, reused)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    size = os.fstat(fd).st_size
    t = time.perf_counter()
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ,
                  flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE)
    mapped = time.perf_counter()
    view = memoryview(m)
    for offset in range(0, size, CHUNK):
      n = min(CHUNK, size - offset)
      out[:n] = view[offset:offset + n]
    copied = time.perf_counter()
    view.release()
    m.close()
    unmapped = time.perf_counter()
    offset = 0
    while offset < size:
      offset += os.preadv(fd, [out[:min(CHUNK, size - offset)]], offset)
    preadv = time.perf_counter() - unmapped
  finally:
    os.close(fd)
  return (f"map {mapped - t:.3f} s, copy {copied - mapped:.3f} s, unmap"
          f" {unmapped - copied:.3f} s; preadv {preadv:.3f} s")


def _ask(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    handles._ask_ahead(fd, 0, os.fstat(fd).st_size, lambda: False,  # pylint: disable=protected-access
                       handles.READ_AHEAD_IN_FLIGHT_BYTES)
  finally:
    os.close(fd)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dir", required=True)
  parser.add_argument("--gb", type=float, default=3.0)
  parser.add_argument("--write-gb", type=float, default=1.0)
  args = parser.parse_args()
  nbytes = max(CHUNK, int(args.gb * (1 << 30)) // CHUNK * CHUNK)
  write = max(CHUNK, int(args.write_gb * (1 << 30)) // CHUNK * CHUNK)
  buf = mmap.mmap(-1, CHUNK)
  buf.write(os.urandom(CHUNK))
  saved = os.path.join(args.dir, "read_back_saved.bin")
  other = os.path.join(args.dir, "read_back_save.bin")
  try:
    _write(saved, nbytes, buf)
    _drop(saved)
    print(f"piece {handles._read_ahead_bytes(os.stat(saved).st_dev)}"  # pylint: disable=protected-access
          f" bytes; file {nbytes / 1e9:.2f} GB", flush=True)
    print(f"direct write of {write / 1e9:.2f} GB alone:"
          f" {_write(other, write, buf):.3f} s", flush=True)
    os.unlink(other)
    bounds = (("unbounded", 1 << 50), ("32 MB", 32 << 20), ("64 MB", 64 << 20))
    for name, bound in bounds * 2:
      _drop(saved)
      t = time.perf_counter()
      handles.read_ahead(saved, in_flight_bytes=bound)
      asked = time.perf_counter() - t
      _read_all(saved)
      print(f"{name}: asked in {asked:.3f} s, all read in"
            f" {time.perf_counter() - t:.3f} s", flush=True)
      _drop(saved)
      stop = threading.Event()
      reading = threading.Thread(target=handles.read_ahead,
                                 args=(saved, stop.is_set, bound))
      reading.start()
      time.sleep(0.3)
      stop.set()
      secs = _write(other, write, buf)
      reading.join()
      os.unlink(other)
      print(f"{name}: a direct write of {write / 1e9:.2f} GB beginning 0.3 s"
            f" into the reading back: {secs:.3f} s", flush=True)
    out = memoryview(bytearray(CHUNK))
    ways = (("read_ahead", handles.read_ahead), ("POSIX_FADV_WILLNEED", _ask),
            ("read", _read_all))
    for name, way in ways * 2:
      _drop(saved)
      way(saved)
      _read_all(saved)  # Whatever the kernel had left to read.
      print(f"after {name}: {_restore_costs(saved, out)}", flush=True)
  finally:
    for path in (saved, other):
      if os.path.exists(path):
        os.unlink(path)


if __name__ == "__main__":
  main()
