"""Blocking calls with a deadline of this process's own.

A call to the coordination service can hang (its process 0 hung, a peer
that a barrier waits for is gone), so can a wait for the runtime's copies
(`arrays.pinned.wait_ready`), and so can a read or write of storage (a
network file system or FUSE mount that stops answering, an object store's
connection that stalls). Nothing here waits without a deadline:

* `Deadlines.call` runs one call on a helper thread and waits for it with
  a deadline, and optionally an `abort` check that ends the wait early (a
  lost peer, see `liveness`);
* `InFlight` records the storage operations that threads are in, each with
  when it began, so that whoever waits for those threads (`wait_all`, the
  commit's waiters) can tell one that is overdue and name it;
* `Pool` runs work on daemon threads; a worker stuck in a call is replaced
  (`Pool.abandon`) and never joined.

The caller is never stuck, and an abandoned call's thread, a daemon, exits
if the call returns.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator, NamedTuple, TypeVar

T = TypeVar("T")

# How long a read or write of storage may take before it counts as lost
# (`Storage(io_timeout_secs=)`): minutes, far above any one request's time
# (a read or write call moves at most 64 MB).
IO_TIMEOUT_SECS = 300.0
# How often a waiter looks at the operations in flight.
POLL_SECS = 0.5


class StorageTimeoutError(TimeoutError):
  """A read or write of storage did not return within its deadline
  (`Storage(io_timeout_secs=)`). The message names the file (or object),
  the bytes and the step. The call that was waited for may still be stuck
  in the kernel: its thread is left behind, never waited for again.
  """


class NoAnswer(Exception):
  """A call did not return within this process's deadline (`Deadlines`)."""


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
                     name="flax_ckpt_plugin-deadline").start()

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


class Operation(NamedTuple):
  """A storage operation in flight (`InFlight`)."""
  what: str  # "reading bytes [0, 4096) of /ckpt/7/data/p0.bin", say.
  thread: int  # `threading.get_ident()` of the thread doing it.
  began: float  # `time.monotonic()`.


class InFlight:
  """The storage operations that threads are in, each with its start time.

  Threads doing I/O for one save or one restore record each call
  (`doing`); whoever waits for them asks for an overdue one and raises,
  naming it, once it took longer than the deadline (`check`): a thread
  stuck in the kernel can never say so itself. Giving up is final: every
  later operation raises at once, so that what a stuck thread would do
  once its call returns (finalize a step, read on into a buffer handed
  on) never begins. A record costs a lock and a dict insert and delete.
  """

  def __init__(self, timeout_secs: float = IO_TIMEOUT_SECS, where: str = ""):
    self.timeout_secs = timeout_secs
    self.where = where  # "step 7 in /ckpt", for messages.
    self._lock = threading.Lock()
    self._ops: dict[int, Operation] = {}
    self._ids = itertools.count()
    self.given_up = False

  @contextlib.contextmanager
  def doing(self, what: str) -> Iterator[None]:
    """Records that this thread is in operation `what` until the context
    ends.

    Raises:
      StorageTimeoutError: once given up on, at once (nothing is begun).
    """
    with self._lock:
      if self.given_up:
        where = f" ({self.where})" if self.where else ""
        raise StorageTimeoutError(
            f"{what}{where}: not begun, since an earlier operation missed"
            f" its deadline of {self.timeout_secs:g} s")
      key = next(self._ids)
      self._ops[key] = Operation(what, threading.get_ident(),
                                 time.monotonic())
    try:
      yield
    finally:
      with self._lock:
        del self._ops[key]

  def overdue(self, now: float | None = None) -> list[Operation]:
    """The operations in flight for longer than the deadline, oldest
    first."""
    now = time.monotonic() if now is None else now
    with self._lock:
      late = [op for op in self._ops.values()
              if now - op.began > self.timeout_secs]
    return sorted(late, key=lambda op: op.began)

  def give_up_if_overdue(self) -> list[Operation]:
    """Gives up (see the class doc) if an operation is overdue; returns
    the overdue ones, oldest first (none: nothing given up)."""
    now = time.monotonic()
    with self._lock:
      late = sorted((op for op in self._ops.values()
                     if now - op.began > self.timeout_secs),
                    key=lambda op: op.began)
      if late:
        self.given_up = True
    return late

  def give_up(self) -> None:
    """Gives up at once (a waiter that raised for another reason)."""
    with self._lock:
      self.given_up = True

  def error(self, op: Operation) -> StorageTimeoutError:
    """The error that names an overdue `op`."""
    where = f" ({self.where})" if self.where else ""
    return StorageTimeoutError(
        f"{op.what}{where}: no answer from storage in"
        f" {time.monotonic() - op.began:.1f} s, over the deadline of"
        f" {self.timeout_secs:g} s (Storage(io_timeout_secs=)). The thread"
        " that made the call is left behind; check the file system or the"
        " connection to the store.")

  def check(self, pool: "Pool | None" = None) -> None:
    """Raises `StorageTimeoutError` for the oldest overdue operation, once
    given up; the places of the threads in overdue ones go to new workers
    of `pool` (if given)."""
    late = self.give_up_if_overdue()
    if not late:
      return
    if pool is not None:
      for op in late:
        pool.abandon(op.thread)
    raise self.error(late[0])

  def call(self, fn: Callable[[], T], what: str) -> T:
    """`fn()`, recorded as operation `what`: on this thread where a waiter
    of this record watches it (a `Pool` job submitted with `watcher=`
    this), else on a helper thread, waited for with the deadline (the
    caller is never stuck in it; the record is then given up on)."""
    if getattr(_watched, "by", None) is self:
      with self.doing(what):
        return fn()
    with self.doing(what):  # (Refused at once once given up.)
      pass
    began = time.monotonic()
    try:
      return DEADLINES.call(fn, self.timeout_secs)
    except NoAnswer:
      self.give_up()
      raise self.error(Operation(what, 0, began)) from None


# On a `Pool`'s thread, during a job: the `InFlight` its waiter watches.
_watched = threading.local()


class Pool:
  """A pool of daemon threads, each started when the work needs it, each
  ending after `IDLE_SECS` without work.

  Unlike `concurrent.futures.ThreadPoolExecutor`, nothing waits for its
  threads: neither the interpreter at exit nor a shutdown. A worker stuck
  in a call (a read that never returns) is `abandon`ed: a new worker takes
  its place, and the stuck one exits if its call ever returns.
  """

  IDLE_SECS = 60.0

  def __init__(self, workers: int, name: str):
    self._max = max(1, workers)
    self._name = name
    self._forget()
    os.register_at_fork(after_in_child=self._forget)

  def _forget(self) -> None:
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._workers: set[int] = set()  # Idents of live, not abandoned ones.
    self._idle = 0  # Workers waiting for a job.
    self._starting = 0  # Workers started, not yet waiting.
    self._queued = 0  # Jobs not yet taken.

  def submit(self, fn: Callable[..., T], *args: Any,
             watcher: InFlight | None = None
             ) -> "concurrent.futures.Future[T]":
    """Runs `fn(*args)` on a worker; `watcher`: the record its waiter
    watches (see `InFlight.call`)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      self._queued += 1
      start = (self._queued > self._idle + self._starting
               and len(self._workers) + self._starting < self._max)
      if start:
        self._starting += 1
    self._jobs.put((future, fn, args, watcher))
    if start:
      self._start()
    return future

  def _start(self) -> None:
    try:
      threading.Thread(target=self._work, daemon=True,
                       name=self._name).start()
    except BaseException:  # No thread to be had: the others take the job.
      with self._lock:
        self._starting -= 1
      raise

  def _work(self) -> None:
    me = threading.get_ident()
    with self._lock:
      self._starting -= 1
      self._workers.add(me)
      self._idle += 1
    while True:
      try:
        job = self._jobs.get(timeout=self.IDLE_SECS)
      except queue.Empty:
        with self._lock:
          if self._queued > 0 and me in self._workers:
            continue  # A job is being put: take it.
          self._idle -= 1
          self._workers.discard(me)
          return
      with self._lock:
        self._idle -= 1
        self._queued -= 1
      future, fn, args, watcher = job
      del job
      if future.set_running_or_notify_cancel():
        _watched.by = watcher
        try:
          future.set_result(fn(*args))
        except BaseException as e:  # pylint: disable=broad-except
          future.set_exception(e)
        finally:
          _watched.by = None
      del future, fn, args, watcher
      with self._lock:
        if me not in self._workers:
          return  # Abandoned while in its call: replaced already.
        self._idle += 1

  def abandon(self, thread: int) -> None:
    """Gives the place of worker `thread`, stuck in a call, to a new one."""
    with self._lock:
      if thread not in self._workers:
        return
      self._workers.discard(thread)
      self._starting += 1
    self._start()


def wait_all(futures: Iterable["concurrent.futures.Future[T]"], *,
             in_flight: InFlight, pool: Pool | None = None,
             first_error: bool = False) -> list[T]:
  """The futures' results, in order, once every one is done; then the
  first error (in order) is raised. With `first_error`, the first error
  that happens cancels the futures not yet begun, and is raised once the
  running ones are done.

  Raises:
    StorageTimeoutError: an operation of `in_flight` took longer than its
      deadline; its worker in `pool` is replaced, the futures not begun
      are cancelled, and nothing waits for the others.
  """
  futures = list(futures)
  pending = set(futures)
  when = (concurrent.futures.FIRST_EXCEPTION if first_error
          else concurrent.futures.ALL_COMPLETED)
  while pending:
    done, pending = concurrent.futures.wait(pending, POLL_SECS, when)
    if first_error and any(not f.cancelled() and f.exception() is not None
                           for f in done):
      for f in pending:
        f.cancel()
      when = concurrent.futures.ALL_COMPLETED
    if pending:
      try:
        in_flight.check(pool)
      except StorageTimeoutError:
        for f in pending:
          f.cancel()
        raise
  for f in futures:
    if not f.cancelled() and f.exception() is not None:
      raise f.exception()
  return [f.result() for f in futures]
