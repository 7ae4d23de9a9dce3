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
  """One background commit at a time; errors re-raised on the caller's thread."""

  def __init__(self, name: str):
    self._name = name
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._lock = threading.Lock()

  def start(self, fn: Callable[[], None], *, description: str) -> None:
    """Waits for the previous commit (raising its error), then runs `fn`."""
    self.wait()

    def run():
      _lower_priority()
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
        with self._lock:
          self._error = e

    self._thread = threading.Thread(target=run, name=self._name, daemon=True)
    self._thread.start()

  @property
  def is_running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def check(self) -> None:
    """Raises the error of a finished background commit, once."""
    with self._lock:
      error, self._error = self._error, None
    if error is not None:
      raise error

  def wait(self) -> None:
    """Blocks until the running commit is done, then raises its error."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    self.check()
