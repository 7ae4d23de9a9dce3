"""Runs one checkpoint commit at a time on a background thread.

The train loop blocks only for the host snapshot; the commit (write, barriers,
finalize, retention) runs here. An error in the background is kept and raised
on the next call into the library, once, with the step and directory added as
a note: it is never only logged. The original exception type is kept, so
`except OSError` or `except TimeoutError` in user code still works.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

from flax_ckpt_plugin.errors import CommitHookError
from flax_ckpt_plugin.multihost import log


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


class AsyncCommitter:
  """One background commit at a time; errors re-raised on the caller's thread.

  Commits run on one long-lived thread, so that starting one is a
  notification rather than a thread start (which, with every core busy
  with the train step, can take the loop tens of milliseconds). The thread
  exits after `IDLE_EXIT_SECS` without work, or on `close`, and is started
  again by the next commit.
  """

  IDLE_EXIT_SECS = 60.0

  def __init__(self, name: str):
    self._name = name
    self._cond = threading.Condition()
    self._job: tuple[Callable[[], None], str] | None = None
    self._busy = False  # A job is queued or running.
    self._closing = False
    self._worker: threading.Thread | None = None
    self._error: BaseException | None = None

  def start(self, fn: Callable[[], None], *, description: str) -> None:
    """Waits for the previous commit (raising its error), then runs `fn`."""
    self.wait()
    with self._cond:
      self._job = (fn, description)
      self._busy = True
      self._closing = False
      if self._worker is None:
        self._worker = threading.Thread(target=self._loop, name=self._name,
                                        daemon=True)
        self._worker.start()
      else:
        self._cond.notify_all()

  def _loop(self) -> None:
    _lower_priority()
    while True:
      with self._cond:
        while self._job is None:
          if self._closing or (
              not self._cond.wait(self.IDLE_EXIT_SECS)
              and self._job is None):
            self._worker = None
            return
        fn, description = self._job
        self._job = None
      self._run(fn, description)
      del fn  # Nothing of a finished commit stays referenced.
      with self._cond:
        self._busy = False
        self._cond.notify_all()

  def _run(self, fn: Callable[[], None], description: str) -> None:
    try:
      fn()
    except BaseException as e:  # pylint: disable=broad-except
      # A commit hook fails after its step was finalized.
      outcome = ("That step is finalized." if isinstance(e, CommitHookError)
                 else "That step was not finalized.")
      e.add_note(
          f"This error occurred ASYNCHRONOUSLY in the background commit of"
          f" {description}; it is raised on the next call into"
          f" flax_ckpt_plugin. {outcome}")
      log.error("background commit of %s failed: %r", description, e)
      with self._cond:
        self._error = e

  @property
  def is_running(self) -> bool:
    return self._busy

  def check(self) -> None:
    """Raises the error of a finished background commit, once."""
    with self._cond:
      error, self._error = self._error, None
    if error is not None:
      raise error

  def join(self, timeout: float | None = None) -> bool:
    """Waits until no commit runs, without raising; False on timeout."""
    with self._cond:
      return self._cond.wait_for(lambda: not self._busy, timeout)

  def wait(self) -> None:
    """Blocks until the running commit is done, then raises its error."""
    self.join()
    self.check()

  def close(self) -> None:
    """Lets the thread exit once the running commit (if any) is done."""
    with self._cond:
      self._closing = True
      self._cond.notify_all()
