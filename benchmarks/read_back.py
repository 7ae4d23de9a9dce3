"""Reading a saved step back into the page cache against a save's writes.

    python benchmarks/read_back.py --dir /path/on/the/disk --gb 3

A file of `--gb` GiB written with direct I/O and dropped from the page cache is
read back by `handles.read_ahead`, bounded as the package does it (at most
32 MB asked for and not read), at 64 MB, and unbounded (as fast as the
kernel takes the asking); for each, twice: the time the asking takes and
until the whole file is read; then, 0.3 s into another reading back, a
direct write of `--write-gb` GiB (a save) begins and stops it: the write's
time, beside the same write alone. The directory must take O_DIRECT writes (not tmpfs).
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
  finally:
    for path in (saved, other):
      if os.path.exists(path):
        os.unlink(path)


if __name__ == "__main__":
  main()
