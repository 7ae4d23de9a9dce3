"""Runs one checkpoint commit at a time on a background thread.

The train loop blocks only for the host snapshot; the commit (write, barriers,
finalize, retention) runs here. An error in the background is kept and raised
on the next call into the library, once, with the step and directory added as
a note: it is never only logged. The original exception type is kept, so
`except OSError` or `except TimeoutError` in user code still works.

A program that returns from its main thread without `close()` does not lose
its last save: before the interpreter shuts down, every running commit is
waited for. If one failed and nobody saw its error, the process prints it
and exits with status 1 instead of 0.

No wait for a commit outlasts its storage's deadline: a commit's reads and
writes are recorded (`deadlines.InFlight`), and a waiter that finds one
overdue gives up on the commit (`StorageTimeoutError`, naming the file):
its step is never finalized, and its thread, stuck in the kernel, is left
behind.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
import time
from typing import Callable
import weakref

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin import exits
from flax_ckpt_plugin.logs import log

# Exit status of a process whose last background commit failed unseen.
UNSEEN_FAILURE_EXIT_CODE = 1

_live: "weakref.WeakSet[AsyncCommitter]" = weakref.WeakSet()


def _finish_at_exit() -> None:
  """Waits for every running commit; fails the process on an unseen error.

  Runs when the main thread has returned, before the interpreter stops
  daemon threads and before `atexit` handlers (JAX's shutdown of the
  coordination service among them), so multi-process commits can still meet
  at their barriers.
  """
  failed = []
  for committer in list(_live):
    if committer.is_running:
      log.warning("the program is exiting without close(): waiting for the"
                  " background commit of %s", committer.description)
      committer.join()
    error = committer.unseen_error()
    if error is not None:
      failed.append(error)
  if not failed:
    return
  for error in failed:
    notes = "".join(f"\n{n}" for n in getattr(error, "__notes__", ()))
    print(f"flax_ckpt_plugin: a background commit failed and the program"
          f" exited without calling close() or wait_until_finished():"
          f" {type(error).__name__}: {error}{notes}", file=sys.stderr)
  # No way but `_exit` sets the status from here; it skips the `atexit`
  # handlers, so the logs are flushed first.
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(UNSEEN_FAILURE_EXIT_CODE)  # pylint: disable=protected-access



def _lower_priority() -> None:
  """Lets the train step's threads go first when the cores are busy.

  On Linux a thread is a task with its own nice value: the commit (copies
  into the page cache, checksums) then runs mostly in the gaps the train
  step leaves, and simply takes longer when there are none.
  """
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                   min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
  except (AttributeError, OSError):
    pass  # Not Linux, or not permitted: run at normal priority.


def _without_frames(error: BaseException) -> None:
  """Turns the traceback of `error` (and of the errors it chains) into
  text, a note on `error`, and drops the frames. Kept for the next call,
  the frames would keep alive what the commit held (its snapshot: on an
  accelerator, a pinned copy of the state, which the next snapshot would
  then need twice); a frame keeps its function, and so a closure's
  variables, even once cleared."""
  notes = error.__dict__.pop("__notes__", None)  # Said once, after.
  text = "".join(traceback.format_exception(error)).rstrip()
  if notes is not None:
    error.__notes__ = notes
  seen, todo = set(), [error]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    e.__traceback__ = None
    todo += [e.__cause__, e.__context__]
  error.add_note(f"Where it failed in the background:\n{text}")


class AsyncCommitter:
  """One background commit at a time; errors re-raised on the caller's thread.

  Commits run on one long-lived thread, so that starting one is a
  notification rather than a thread start (which, with every core busy
  with the train step, can take the loop tens of milliseconds, and 3-5 ms
  with them idle). The thread exits after `IDLE_EXIT_SECS` without work
  (long enough for the saves of a train loop, which come minutes apart),
  or on `close`, and is started again by the next save (`prepare`).
  """

  IDLE_EXIT_SECS = 900.0

  def __init__(self, name: str):
    self._name = name
    self._cond = threading.Condition()
    self._job: tuple[Callable[[], None], str] | None = None
    self._busy = False  # A job is queued or running.
    # The storage operations of the job queued or running.
    self._in_flight: deadlines.InFlight | None = None
    self._closing = False
    self._worker: threading.Thread | None = None
    self._error: BaseException | None = None
    self.description = ""  # Of the running or last commit.
    _live.add(self)
    exits.once_before_exit(_finish_at_exit)

  def prepare(self) -> None:
    """Starts the commit thread now if it is not running, so that `start`
    only notifies it: a save calls this before its snapshot, while the
    cores are idle. Started after it, the thread waited for a core that the
    runtime's copies held (measured: 10-20 ms of a save call on 2 cores)."""
    with self._cond:
      self._closing = False
      self._start_worker()

  def _start_worker(self) -> None:
    if self._worker is None:
      self._worker = threading.Thread(target=self._loop, name=self._name,
                                      daemon=True)
      self._worker.start()

  def start(self, fn: Callable[[], None], *, description: str,
            in_flight: deadlines.InFlight | None = None) -> None:
    """Waits for the previous commit (raising its error), then runs `fn`,
    whose storage operations are recorded in `in_flight` (their deadline
    bounds every wait for it)."""
    self.wait()
    with self._cond:
      self._job = (fn, description)
      self._in_flight = in_flight
      self.description = description
      self._busy = True
      self._closing = False
      if self._worker is None:
        self._start_worker()
      else:
        self._cond.notify_all()

  def _loop(self) -> None:
    _lower_priority()
    me = threading.current_thread()
    while True:
      with self._cond:
        while self._job is None:
          if self._closing or (
              not self._cond.wait(self.IDLE_EXIT_SECS)
              and self._job is None):
            if self._worker is me:
              self._worker = None
            return
        fn, description = self._job
        self._job = None
      error = self._run(fn, description)
      del fn  # Nothing of a finished commit stays referenced.
      with self._cond:
        if self._worker is not me:
          return  # Given up on (`_give_up_if_late`): its place is taken.
        if error is not None:
          self._error = error
        self._busy = False
        self._in_flight = None
        self._cond.notify_all()

  @staticmethod
  def _run(fn: Callable[[], None], description: str) -> BaseException | None:
    try:
      fn()
    except BaseException as e:  # pylint: disable=broad-except
      _without_frames(e)
      # The job's own notes say whether its step was finalized.
      e.add_note(
          f"This error occurred ASYNCHRONOUSLY in the background commit of"
          f" {description}; it is raised on the next call into"
          " flax_ckpt_plugin.")
      log.error("background commit of %s failed: %r", description, e)
      return e
    return None

  def _give_up_if_late(self) -> None:
    """Gives up on the running commit if one of its storage operations is
    overdue: its error (naming the operation) is kept for the caller, its
    later operations are refused (so its step is never finalized), and a
    new thread takes the next commit. Called with the lock held."""
    io = self._in_flight
    late = [] if not self._busy or io is None else io.give_up_if_overdue()
    if not late:
      return
    op = late[0]
    error = io.error(op)
    state = ("its finalization was under way and may have made the step"
             " visible (the next open lists it if so)"
             if op.what.startswith("finalizing") else "its step was not"
             " finalized")
    error.add_note(
        f"This error occurred ASYNCHRONOUSLY in the background commit of"
        f" {self.description}: {state}. It is raised on the next call into"
        " flax_ckpt_plugin.")
    log.error("background commit of %s given up: %s", self.description,
              error)
    self._error = error
    self._busy = False
    self._in_flight = None
    self._worker = None  # The stuck thread exits if its call returns.
    self._cond.notify_all()

  @property
  def is_running(self) -> bool:
    return self._busy

  def check(self) -> None:
    """Raises the error of a finished background commit, or of one given
    up on (a storage operation overdue), once."""
    with self._cond:
      self._give_up_if_late()
      error, self._error = self._error, None
    if error is not None:
      raise error

  def unseen_error(self) -> BaseException | None:
    """The error of a finished commit that nobody raised yet (not cleared)."""
    with self._cond:
      return self._error

  def refuse_on_commit_thread(self) -> None:
    """Raises if called on the commit thread, where waiting is a deadlock.

    Commit hooks run on the commit thread; one that waits for the commit
    (`save`, `wait_until_finished`, `close`) would wait for itself forever.

    Raises:
      RuntimeError: this is the commit thread; names the commit.
    """
    if threading.current_thread() is self._worker:
      raise RuntimeError(
          "save(), wait_until_finished() or close() of a checkpoint manager"
          " was called from a commit hook, on the commit thread of"
          f" {self.description}: it waits for that commit, so it would wait"
          " for itself forever. Call it from the training loop instead (a"
          " hook runs after its step is finalized).")

  def join(self, timeout: float | None = None) -> bool:
    """Waits until no commit runs, without raising; False on timeout.

    Never longer than the running commit's storage deadline: a commit with
    an overdue operation is given up on (see `_give_up_if_late`; `check`
    raises its error).
    """
    self.refuse_on_commit_thread()
    end = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while self._busy:
        self._give_up_if_late()
        left = deadlines.POLL_SECS if end is None else min(
            deadlines.POLL_SECS, end - time.monotonic())
        if not self._busy:
          break
        if left <= 0:
          return False
        self._cond.wait(left)
      return True

  def wait(self) -> None:
    """Blocks until the running commit is done, then raises its error."""
    self.join()
    self.check()

  def close(self) -> None:
    """Lets the thread exit once the running commit (if any) is done."""
    with self._cond:
      self._closing = True
      self._cond.notify_all()
