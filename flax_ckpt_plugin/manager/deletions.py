"""Retention's deletes, off the save's path: one background queue per
directory.

On an object store, deleting a step is a request per file (a job of many
processes leaves thousands), so a save that deleted the old steps inline
held the commit thread, and the next save waited for it. Here the commit
ends at finalization: retention only queues the steps it chose, and a
thread of the primary host deletes them, oldest first, one step after the
other (so a directory's deletes never interleave), while the loop trains
and saves on. While a save is taken and committed they hold off, between
parts of a step's delete (`hold_off`, `go_on`): the save's requests and
writes go first, and it is durable as soon as without retention.

A backend whose deletes must be done before the next save begins
(`Backend.deletes_in_background` False: a file system in memory, whose
deleted data file the next snapshot reuses) has them run at once, on the
commit thread, as part of the save.

A step leaves the list before its files go (`Backend.delete_step`: a
rename to `<step>.deleting`, or the commit marker removed first), so a
crash half way leaves an unfinished entry, never a step, and the next
writer cleans it up.

An error of a delete is logged at once and kept, with its type (an
`OSError`, a `ConcurrentWriterError`...) and a note naming the steps: it
is raised, once, by the retention of a later save, at the meeting where
the primary queues that save's deletes, so that every process learns it
(the others raise a `RuntimeError` naming it), or by the primary's
`close`.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable
import weakref

from etils import epath

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin import exits
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.logs import log


_live: "weakref.WeakSet[Deletions]" = weakref.WeakSet()
_DONE = object()  # The end of a delete's parts.


def _finish_at_exit() -> None:
  """Waits for every queue's deletes, once the main thread returned."""
  for deletions in list(_live):
    deletions.finish_at_exit()



class Deletions:
  """The queue of steps to delete from one directory, and its thread.

  Used on the primary host only (the others never delete). The thread
  starts with the first `submit` and exits when the queue is empty; at the
  interpreter's exit what is queued is deleted first (see `exits`).

  Each part of a delete has the storage's deadline: a waiter that finds
  one overdue gives up on the thread (its error, naming the step, is kept
  for `check`; the steps still queued stay on disk, whole, and a writer's
  next open lists them again), and the next `submit` starts a new one.
  """

  def __init__(self, directory: epath.Path, backend: interface.Backend,
               name: str, io_timeout_secs: float = deadlines.IO_TIMEOUT_SECS):
    self.directory, self.backend, self._name = directory, backend, name
    self._io_timeout_secs = io_timeout_secs
    self._in_flight = self._new_in_flight()
    self._cond = threading.Condition()
    # Each job: the steps, oldest first, the step whose retention chose
    # them, and the writer's check.
    self._queue: collections.deque[
        tuple[list[int], int, Callable[[str], None] | None]
    ] = collections.deque()
    self._pending: set[int] = set()  # Queued or being deleted.
    # Clear while a save is taken and committed: the deletes wait between
    # their parts, so that the save's requests never queue behind them.
    self._quiet = threading.Event()
    self._quiet.set()
    self._worker: threading.Thread | None = None
    self._stopping = False
    self._error: BaseException | None = None
    _live.add(self)
    exits.once_before_exit(_finish_at_exit)

  @property
  def pending(self) -> set[int]:
    """The steps queued or being deleted."""
    with self._cond:
      return set(self._pending)

  def submit(self, steps: list[int], after: int,
             still_writer: Callable[[str], None] | None) -> None:
    """Queues `steps` for deletion; returns at once (where the backend
    deletes in the background: otherwise deletes them, and raises).

    Args:
      steps: the steps to delete.
      after: the step whose retention chose them (for messages).
      still_writer: `still_writer(consequence)` (the manager's
        `check_still_writer`), run on the thread before the steps' first
        request.
    """
    if not steps:
      return
    if not self.backend.deletes_in_background:  # Now, on this thread.
      error = self._delete(sorted(steps), after, still_writer)
      if error is not None:
        raise error
      self.check()
      return
    with self._cond:
      self._queue.append((sorted(steps), after, still_writer))
      self._pending.update(steps)
      self._stopping = False
      if self._worker is None:
        self._worker = threading.Thread(target=self._loop, name=self._name,
                                        daemon=True)
        self._worker.start()
      self._cond.notify_all()

  def _new_in_flight(self) -> deadlines.InFlight:
    return deadlines.InFlight(self._io_timeout_secs,
                              f"retention's deletes in {self.directory}")

  def _loop(self) -> None:
    me = threading.current_thread()
    while True:
      with self._cond:
        if self._worker is not me:
          return  # Given up on (`_give_up_if_late`).
        if self._stopping:  # The rest stay whole steps.
          self._queue.clear()
          self._pending.clear()
        if not self._queue:
          self._worker = None
          self._cond.notify_all()
          return
        steps, after, still_writer = self._queue[0]
        in_flight = self._in_flight
      error = self._delete(steps, after, still_writer, in_flight)
      with self._cond:
        if self._worker is not me:
          return
        if error is not None and self._error is None:
          self._error = error  # The first: later ones follow from it.
        self._queue.popleft()
        self._pending.difference_update(steps)
        self._cond.notify_all()

  def _give_up_if_late(self) -> None:
    """Gives up on the thread if a part of its delete is overdue: its error
    is kept, the queue dropped (those steps stay on disk, whole or out of
    the list, for a later retention or writer). Called with the lock."""
    late = ([] if self._worker is None
            else self._in_flight.give_up_if_overdue())
    if not late:
      return
    error = self._in_flight.error(late[0])
    log.error("retention's deletes in %s given up: %s", self.directory, error)
    if self._error is None:
      self._error = error
    self._queue.clear()
    self._pending.clear()
    self._worker = None  # The stuck thread exits if its call returns.
    self._in_flight = self._new_in_flight()
    self._cond.notify_all()

  def _delete(self, steps: list[int], after: int,
              still_writer: Callable[[str], None] | None,
              in_flight: deadlines.InFlight | None = None
              ) -> BaseException | None:
    """Deletes `steps`; returns the error that ended it, if any (logged,
    with a note naming the steps left)."""
    done = []
    in_flight = in_flight or self._new_in_flight()
    try:
      if still_writer is not None:
        still_writer(f"steps {steps} were not deleted")
      for step in steps:
        if self._stopping:  # The rest stay whole steps.
          return
        parts = iter(self.backend.delete_step_in_parts(self.directory, step))
        while True:
          with in_flight.doing(f"deleting step {step} of {self.directory}"):
            more = next(parts, _DONE) is not _DONE
          if not more:
            break
          self._wait_for_quiet()
        done.append(step)
        log.info("retention deleted step %d from %s", step, self.directory)
    except Exception as e:  # pylint: disable=broad-except
      if in_flight.given_up:  # Given up on: its error was raised already.
        return None
      left = [s for s in steps if s not in done]
      where = (" (in the background)" if self.backend.deletes_in_background
               else "")
      e.add_note(
          f"Retention after step {after} could not delete steps {left} of"
          f" {self.directory}{where}. They are no longer"
          " listed; what is left of them is removed when a writer next"
          " opens the directory (unfinished), or by a later retention"
          " (still whole steps).")
      log.error("retention after step %d failed to delete steps %s of %s:"
                " %r", after, left, self.directory, e, exc_info=True)
      e.__traceback__ = None  # Kept for later: no frames kept alive.
      return e
    return None

  def hold_off(self) -> None:
    """A save begins: the deletes wait, between parts of a step's delete
    (`Backend.delete_step_in_parts`: on object stores, 100 objects), until
    `go_on`. A step already out of the list stays out."""
    self._quiet.clear()

  def go_on(self) -> None:
    """The save is final (or failed): the deletes go on."""
    self._quiet.set()

  def _wait_for_quiet(self) -> None:
    # As long as the save's commit lasts, which its own deadlines bound.
    while not self._quiet.wait(1.0):
      if self._stopping:
        return

  def take_error(self) -> BaseException | None:
    """The error of a finished delete, or of one given up on, once (later
    ones while it was kept were logged only)."""
    with self._cond:
      self._give_up_if_late()
      error, self._error = self._error, None
    return error

  def check(self) -> None:
    """Raises the error of a finished delete, once."""
    error = self.take_error()
    if error is not None:
      raise error

  def wait(self, timeout: float | None = None) -> bool:
    """Waits until nothing is queued (the deletes go on first, if a save
    held them off); False if still deleting after `timeout` seconds.
    Never longer than a part's deadline (the thread is then given up on).
    Raises nothing (see `check`)."""
    self.go_on()
    end = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while self._worker is not None:
        self._give_up_if_late()
        left = deadlines.POLL_SECS if end is None else min(
            deadlines.POLL_SECS, end - time.monotonic())
        if self._worker is None:
          break
        if left <= 0:
          return False
        self._cond.wait(left)
      return True

  def stop(self) -> None:
    """Deletes nothing more than the step being deleted (a process about
    to go away): the rest stay whole steps on disk, which a later
    retention deletes. A later `submit` starts again."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()

  def finish_at_exit(self) -> None:
    """Deletes what is queued before the interpreter stops the thread."""
    if self._worker is not None:
      log.warning("the program is exiting: waiting for retention to delete"
                  " steps %s of %s", sorted(self.pending), self.directory)
      self.wait()
