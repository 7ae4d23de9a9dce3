"""Blocking calls with a deadline of this process's own.

A call to the coordination service can hang (its process 0 hung, a peer
that a barrier waits for is gone), and so can a wait for the runtime's
copies (`arrays.pinned.wait_ready`). `Deadlines.call` runs it on a helper
thread and waits for it with a deadline, and optionally an `abort` check
that ends the wait early (a lost peer, see `liveness`): the caller is never
stuck, and an abandoned call's thread, a daemon, exits if the call returns.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class NoAnswer(Exception):
  """The coordination service did not answer within this process's deadline."""


class _Job:
  """One call, run on a helper thread; the caller waits on `done`."""

  __slots__ = ("fn", "done", "result", "error")

  def __init__(self, fn: Callable[[], Any]):
    self.fn = fn
    self.done = threading.Event()
    self.result: Any = None
    self.error: BaseException | None = None

  def run(self) -> None:
    try:
      self.result = self.fn()
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e
    self.done.set()


class _Helper:
  """A daemon thread that runs jobs, one at a time, until retired."""

  def __init__(self):
    self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
    threading.Thread(target=self._loop, daemon=True,
                     name="flax_ckpt_plugin-coordination").start()

  def _loop(self) -> None:
    while (job := self._jobs.get()) is not None:
      job.run()
      del job

  def submit(self, job: _Job) -> None:
    self._jobs.put(job)

  def retire(self) -> None:
    """Lets the thread exit once its current job (if any) returns."""
    self._jobs.put(None)


class Deadlines:
  """Runs blocking calls on helper threads and waits for each with a deadline.

  An idle helper is reused (a call costs two thread hand-offs, not a thread
  start); concurrent calls (the train loop's and the commit thread's) each
  get their own. A helper whose call missed its deadline is abandoned: the
  call may never return, and the thread, a daemon, exits if it does.
  """

  def __init__(self):
    self._idle: list[_Helper] = []
    self._lock = threading.Lock()
    # A forked child has none of the parent's threads: forget their helpers.
    os.register_at_fork(after_in_child=self._forget)

  def _forget(self) -> None:
    self._idle = []
    self._lock = threading.Lock()

  def call(self, fn: Callable[[], T], deadline_secs: float,
           abort: Callable[[], None] | None = None) -> T:
    """`fn()`, or `NoAnswer` if it did not return within `deadline_secs`.

    `abort`, called every 0.1 s while waiting, ends the wait by raising.
    """
    with self._lock:
      helper = self._idle.pop() if self._idle else None
    if helper is None:
      helper = _Helper()
    job = _Job(fn)
    helper.submit(job)
    end = time.monotonic() + deadline_secs
    try:
      while not (answered := job.done.wait(
          deadline_secs if abort is None
          else max(0.0, min(0.1, end - time.monotonic())))):
        if abort is None or time.monotonic() >= end:
          break
        abort()
    except BaseException:  # KeyboardInterrupt: the helper may still be busy.
      helper.retire()
      raise
    if not answered:
      helper.retire()
      raise NoAnswer
    with self._lock:
      self._idle.append(helper)
    if job.error is not None:
      raise job.error
    return job.result


DEADLINES = Deadlines()
