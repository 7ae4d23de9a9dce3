"""Memory figures of the benchmark process, and the machine's restore floor.

A restore that creates its arrays writes every byte of the state into
memory that is new to the process, so the kernel first faults in every page
of it. `fill_floor_secs` times exactly that with nothing else: one thread
fills a fresh private anonymous mapping of the state's size, and the time
is divided by the cores this process may use (the best a restore spread
over all of them can do). It is measured with 4 KiB pages, which the
runtime's allocator gets unless huge pages are on for all memory, and
with transparent huge pages, which a program can ask for but a library
cannot. Each is the better of 2 fills.

`parallel_fill_secs` measures what that division assumes: every core
filling its share of new memory at once. On a virtual machine the kernel's
page faults need not scale with cores (the host backs the guest's pages
too): here 2 threads filling 0.5 GB each took 1.3-1.9x one thread's 1 GB
halved. That is the floor a restore spread over all cores can reach.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import resource
import threading
import time

HUGE_PAGE = 2 << 20


def rss_bytes() -> int:
  """Current resident set size (not the peak), from /proc/self/statm."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
  """Peak resident set size (ru_maxrss) since start or `reset_peak_rss`."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
  """Sets the peak RSS to the current RSS (Linux); False where it cannot.

  Without it, the peak of building the state would hide what came after.
  """
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _anon_huge_bytes() -> int:
  try:
    with open("/proc/self/smaps_rollup") as f:
      for line in f:
        if line.startswith("AnonHugePages:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def fill_floor_secs(nbytes: int, huge: bool) -> tuple[float, float]:
  """Seconds to fill `nbytes` of new memory, per core; and the huge share.

  The better of 2 fills, each into a new mapping: a floor is a lower bound.

  Args:
    nbytes: the size to fill, the state's.
    huge: advise transparent huge pages (the mapping aligned to 2 MiB)
      instead of forbidding them.

  Returns:
    One thread's time to fill a fresh anonymous mapping with a constant,
    divided by the cores this process may use; and the fraction of it the
    kernel backed with huge pages.
  """
  return min(_fill_once(nbytes, huge) for _ in range(2))


def _fill_once(nbytes: int, huge: bool) -> tuple[float, float]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  align = HUGE_PAGE if huge else mmap.PAGESIZE
  size = -(-nbytes // align) * align
  # Private, as the allocator's memory is (a shared one would be shmem).
  buf = mmap.mmap(-1, size + (align if huge else 0),
                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  whole = np.frombuffer(buf, np.uint8)
  start = -whole.ctypes.data % align
  advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
  if advice is not None:
    buf.madvise(advice, start, size)
  view = whole[start:start + size]
  before = _anon_huge_bytes()
  t = time.perf_counter()
  view[:] = 1
  secs = time.perf_counter() - t
  huge_share = (_anon_huge_bytes() - before) / size
  del view, whole
  buf.close()
  return secs / len(os.sched_getaffinity(0)), huge_share


def parallel_fill_secs(nbytes: int) -> float:
  """Seconds for all cores to fill `nbytes` of new memory together.

  Each of the cores this process may use fills its share of a fresh
  private anonymous mapping (4 KiB pages) at once; the wall time of the
  slowest, the better of 2 rounds.
  """
  cores = len(os.sched_getaffinity(0))
  share = -(-nbytes // cores)
  best = float("inf")
  for _ in range(2):
    secs = [0.0] * cores

    def fill(i):
      secs[i] = _fill_once(share, huge=False)[0] * cores

    threads = [threading.Thread(target=fill, args=(i,)) for i in range(cores)]
    t = time.perf_counter()
    for th in threads:
      th.start()
    for th in threads:
      th.join()
    best = min(best, time.perf_counter() - t)
  return best


def direct_write_gbps(path: str, nbytes: int) -> float | None:
  """GB/s of the disk's sustained direct write: 8 threads writing 64 MB
  pieces with direct I/O from page-aligned memory, then fsync (the rate a
  save to durable is held to); None where the file system takes no
  direct I/O."""
  piece = 64 << 20
  nbytes = max(piece, nbytes // piece * piece)
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
  except OSError:
    return None
  buf = mmap.mmap(-1, piece)  # Page-aligned, as direct I/O needs.
  buf.write(b"\x01" * piece)
  view = memoryview(buf)
  try:
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      list(pool.map(lambda lo: os.pwrite(fd, view, lo),
                    range(0, nbytes, piece)))
    os.fsync(fd)
    return nbytes / 1e9 / (time.perf_counter() - t)
  except OSError:
    return None
  finally:
    view.release()
    buf.close()
    os.close(fd)
    os.unlink(path)
