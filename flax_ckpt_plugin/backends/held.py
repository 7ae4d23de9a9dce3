"""A step's data file as this process still holds it in host memory.

A save writes its data file from a host snapshot: on the CPU the staging
copies (`save.staging`), on accelerators the pinned buffers
(`arrays.pinned`). That memory stays allocated after the commit until
the next save takes it over. A restore of that step in the same process
(an eval of the saved step, an elastic recovery, the local tier's
restore, a test) reads its bytes from there, at memory speed, instead of
from the disk, where direct I/O left nothing in the page cache.

`HeldFile` is the file as written: spans of its bytes, each a view of a
snapshot's buffer; a range it does not hold (a hole before an aligned
shard) is read from the file itself. `HeldStep` is a manager's record of
the newest step so held and of who reads it: the next save drops it
(waiting for a restore that reads it to end) before its snapshot reuses
the memory. The reader checks every block's CRC-32C against the
manifest as it does for bytes from a disk, so held bytes are trusted no
more than a file's.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

from etils import epath
import numpy as np

from flax_ckpt_plugin.backends.interface import Backend
from flax_ckpt_plugin.backends.interface import RangedFile
from flax_ckpt_plugin.logs import log

T = TypeVar("T")


class Span(NamedTuple):
  """`nbytes` bytes of the file from `offset`, as `view()` gives them: a
  uint8 array, valid while the step is held. `array`: the snapshot's
  buffer itself where it is a `jax.Array` in pinned host memory of exactly
  these bytes (see `HeldFile.pinned_array`), else None."""
  offset: int
  nbytes: int
  view: Callable[[], np.ndarray]
  array: Any = None


class HeldFile(RangedFile):
  """A data file's bytes from host memory where held, else from the file
  (opened by `open_file` the first time a range is not held)."""

  def __init__(self, size: int, spans: list[Span],
               open_file: Callable[[], RangedFile]):
    self.size = size
    self._spans = sorted((s for s in spans if s.nbytes),
                         key=lambda s: s.offset)
    self._starts = [s.offset for s in self._spans]
    self._open_file = open_file
    self._file: RangedFile | None = None
    self._lock = threading.Lock()
    self._served: list[tuple[int, int]] = []  # Ranges from memory, merged.

  @property
  def held_bytes(self) -> int:
    """Bytes of the file served from memory, each counted once (a
    checksum block at the edge of two regions is read for both)."""
    with self._lock:
      return sum(hi - lo for lo, hi in self._served)

  def _count(self, lo: int, hi: int) -> None:
    with self._lock:
      merged, placed = [], False
      for a, b in self._served:
        if b < lo or a > hi:
          merged.append((a, b))
        else:
          lo, hi = min(a, lo), max(b, hi)
      for i, (a, _) in enumerate(merged):
        if a > hi:
          merged.insert(i, (lo, hi))
          placed = True
          break
      if not placed:
        merged.append((lo, hi))
      self._served = merged

  def _span(self, offset: int, size: int) -> Span | None:
    """The span that holds all of [offset, offset + size), if one does."""
    i = bisect.bisect_right(self._starts, offset) - 1
    if i < 0:
      return None
    span = self._spans[i]
    return span if offset + size <= span.offset + span.nbytes else None

  def _real(self) -> RangedFile:
    with self._lock:
      if self._file is None:
        self._file = self._open_file()
      return self._file

  def read_into(self, offset: int, out: memoryview) -> int:
    # Several shards at once (a coalesced read of small ones): each from
    # its span, if they hold every byte; else the file's.
    end, pos, parts = offset + len(out), offset, []
    i = max(0, bisect.bisect_right(self._starts, offset) - 1)
    while pos < end and i < len(self._spans):
      span = self._spans[i]
      if span.offset > pos:
        break  # A hole.
      if span.offset + span.nbytes > pos:
        hi = min(end, span.offset + span.nbytes)
        parts.append((span, pos, hi))
        pos = hi
      i += 1
    if pos < end:
      return self._real().read_into(offset, out)
    for span, lo, hi in parts:
      src = span.view()
      out[lo - offset:hi - offset] = memoryview(
          src[lo - span.offset:hi - span.offset])
      del src
    self._count(offset, end)
    return len(out)

  def pinned_array(self, offset: int, size: int) -> Any:
    span = self._span(offset, size)
    if span is None or (span.offset, span.nbytes) != (offset, size):
      return None
    return span.array

  @contextlib.contextmanager
  def mapped(self, offset: int, size: int) -> Iterator[memoryview | None]:
    span = self._span(offset, size)
    if span is None:
      with self._real().mapped(offset, size) as view:
        yield view
      return
    src = span.view()
    view = memoryview(src[offset - span.offset:offset - span.offset + size])
    view = view.toreadonly()
    self._count(offset, offset + size)
    try:
      yield view
    finally:
      view.release()
      del src

  def close(self) -> None:
    self._spans, self._starts = [], []
    if self._file is not None:
      self._file.close()
      self._file = None


class HeldStorage:
  """A backend's files of one step directory, with the data file this
  process wrote served from memory (`HeldFile`). What a restore's
  `ByteReader` takes in place of the backend (`data_files.Storage`); the
  backend's other calls (the manifest's read) go to the backend."""

  def __init__(self, backend: Backend, step_dir: epath.Path,
               files: dict[str, tuple[int, list[Span]]]):
    self.reads_are_requests = backend.reads_are_requests
    self._backend, self._step_dir, self._files = backend, step_dir, files
    self.opened: list[HeldFile] = []
    self._counted = 0  # Bytes from the files closed.

  def open_ranged(self, path: epath.Path, within: epath.Path) -> RangedFile:
    held = next((h for name, h in self._files.items()
                 if path == self._step_dir / name), None)
    if held is None:
      return self._backend.open_ranged(path, within)
    size, spans = held
    f = HeldFile(size, spans,
                 lambda: self._backend.open_ranged(path, within))
    self.opened.append(f)
    return f

  def __getattr__(self, name: str):
    return getattr(self._backend, name)

  @property
  def held_bytes(self) -> int:
    """Bytes the restore took from memory."""
    return self._counted + sum(f.held_bytes for f in self.opened)

  def close(self) -> None:
    """Lets go of the snapshot: an error that keeps this storage alive
    (in its traceback) keeps none of the memory."""
    self._counted = self.held_bytes
    for f in self.opened:
      f.close()
    self.opened, self._files = [], {}


class HeldStep:
  """The newest step whose snapshot this process still holds, if any.

  Set by the commit thread once a step is final (`hold`). The next save
  drops it before its snapshot reuses the memory (`drop`: it waits for
  readers on other threads, and refuses a save made inside a read); a
  restore lets it go once read, or at once if it reads another step
  (`release`). Readers go through `reading`, which yields None where the
  step asked for is not the one held, and `read`, which reads the files
  instead where the held bytes fail their checks.
  """

  def __init__(self):
    self._cond = threading.Condition()
    self._step: int | None = None
    self._step_dir: epath.Path | None = None
    self._files: dict[str, tuple[int, list[Span]]] = {}
    self._readers: dict[int, int] = {}  # Thread id: reads open on it.

  @property
  def step(self) -> int | None:
    return self._step

  def hold(self, step: int, step_dir: epath.Path, name: str, size: int,
           spans: list[Span]) -> None:
    """Records that `step`'s data file `name` (relative to `step_dir`, the
    finalized step's directory; `size` bytes) is held in memory as
    `spans`."""
    with self._cond:
      self._step, self._step_dir = step, step_dir
      self._files = {name: (size, spans)}

  def drop(self, timeout_secs: float) -> None:
    """Forgets the held step once no other thread reads it (a save, whose
    snapshot reuses the memory, calls it first), waiting at most
    `timeout_secs` for the readers to end.

    Raises:
      RuntimeError: this thread reads the held step (a save made inside
        `reading` would overwrite what it reads).
      TimeoutError: another thread still reads it after `timeout_secs`;
        nothing is forgotten, so the caller must not reuse the memory (a
        save fails, and the next one waits again).
    """
    me = threading.get_ident()
    with self._cond:
      if self._readers.get(me):
        raise RuntimeError(
            f"a save while this thread reads the held snapshot of step"
            f" {self._step}: its memory would be reused under the read")
      if not self._cond.wait_for(lambda: not self._readers, timeout_secs):
        raise TimeoutError(
            f"a save waited {timeout_secs:g} s for the restore that reads the"
            f" snapshot of step {self._step} held in memory (on threads"
            f" {sorted(self._readers)}) to end: the save would reuse that"
            " memory under the read, so it was not taken")
      self._forget()

  def release(self) -> None:
    """Forgets the held step, as `drop`, where no thread reads it (a
    restore done with it); otherwise leaves it to the next save."""
    with self._cond:
      if not self._readers:
        self._forget()

  def _forget(self) -> None:
    self._step, self._step_dir, self._files = None, None, {}

  @contextlib.contextmanager
  def reading(self, step: int, step_dir: epath.Path, backend: Backend
              ) -> Iterator[HeldStorage | None]:
    """A storage for restoring `step` from `step_dir` that serves its held
    bytes from memory, kept held until the context ends; None if `step`
    is not held."""
    me = threading.get_ident()
    with self._cond:
      if self._step != step or self._step_dir != step_dir:
        storage = None
      else:
        storage = HeldStorage(backend, step_dir, self._files)
        self._readers[me] = self._readers.get(me, 0) + 1
    try:
      yield storage
    finally:
      if storage is not None:
        storage.close()  # Nothing of the snapshot outlives the read.
        with self._cond:
          self._readers[me] -= 1
          if not self._readers[me]:
            del self._readers[me]
          self._cond.notify_all()

  def read(self, step: int, step_dir: epath.Path, backend: Backend,
           fn: Callable[[Backend | HeldStorage], T],
           damaged: type[BaseException], where: str) -> tuple[T, int]:
    """`fn(storage)`, with `step`'s held bytes from memory where they are
    held; returns its result and the bytes it took from memory.

    Where the held bytes fail the reader's checks (`damaged`: memory went
    bad after the save), the held step is dropped and `fn` runs again on
    the backend's files, which are then what counts: a good step on the
    disk is never taken for a damaged one because of this process's
    memory.
    """
    with self.reading(step, step_dir, backend) as held:
      if held is None:
        return fn(backend), 0
      try:
        return fn(held), held.held_bytes
      except damaged as e:
        error = e
    log.warning("%s: the snapshot of step %d held in memory failed its"
                " checks (%s); reading the step from its files instead",
                where, step, error)
    self.release()
    return fn(backend), 0
