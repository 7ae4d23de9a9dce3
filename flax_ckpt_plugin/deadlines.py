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


class Operation(NamedTuple):
  """A storage operation in flight (`InFlight`)."""
  what: str  # "reading bytes [0, 4096) of /ckpt/7/data/p0.bin", say.
  thread: int  # `threading.get_ident()` of the thread doing it.
  began: float  # `time.monotonic()`.


class InFlight:
  """The storage operations that threads are in, each with its start time.

  Threads doing I/O for one save or one restore record each call
  (`doing`); whoever waits for them asks for the oldest one (`overdue`)
  and raises, naming it, once it took longer than the deadline: a thread
  stuck in the kernel can never say so itself. A record costs a dict
  insert and delete.
  """

  def __init__(self, timeout_secs: float = IO_TIMEOUT_SECS, where: str = ""):
    self.timeout_secs = timeout_secs
    self.where = where  # "step 7 in /ckpt", for messages.
    self._ops: dict[int, Operation] = {}
    self._ids = itertools.count()
    self.given_up = False

  def give_up(self) -> None:
    """Every later operation raises at once (`doing`): a waiter raised the
    error of an overdue one, and what the stuck thread would do once its
    call returns (finalize a step) must not happen."""
    self.given_up = True

  @contextlib.contextmanager
  def doing(self, what: str) -> Iterator[None]:
    """Records that this thread is in operation `what` until the context
    ends.

    Raises:
      StorageTimeoutError: after `give_up`, at once (nothing is begun).
    """
    if self.given_up:
      where = f" ({self.where})" if self.where else ""
      raise StorageTimeoutError(
          f"{what}{where}: not begun, since an earlier operation missed its"
          f" deadline of {self.timeout_secs:g} s")
    key = next(self._ids)  # (`count` is atomic under the GIL.)
    self._ops[key] = Operation(what, threading.get_ident(), time.monotonic())
    try:
      yield
    finally:
      del self._ops[key]

  def overdue(self, now: float | None = None) -> Operation | None:
    """The oldest operation in flight for longer than the deadline; None
    if none is."""
    now = time.monotonic() if now is None else now
    late = [op for op in list(self._ops.values())
            if now - op.began > self.timeout_secs]
    return min(late, key=lambda op: op.began) if late else None

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
    """Raises `StorageTimeoutError` for an overdue operation; its thread's
    place in `pool` (if given) goes to a new worker first."""
    op = self.overdue()
    if op is None:
      return
    if pool is not None:
      pool.abandon(op.thread)
    raise self.error(op)

  def call(self, fn: Callable[[], T], what: str) -> T:
    """`fn()`, recorded as operation `what`, on this thread where a waiter
    watches it (a `Pool`'s worker), else on a helper thread, waited for
    with the deadline: the caller is never stuck in it."""
    if getattr(_watched, "yes", False):
      with self.doing(what):
        return fn()
    began = time.monotonic()
    try:
      return DEADLINES.call(fn, self.timeout_secs)
    except NoAnswer:
      raise self.error(Operation(what, 0, began)) from None


# Set on the threads of `Pool`s: their waiters watch their operations.
_watched = threading.local()


class Pool:
  """A pool of daemon threads, each started when the work needs it.

  Unlike `concurrent.futures.ThreadPoolExecutor`, nothing waits for its
  threads: neither the interpreter at exit nor `shutdown`. A worker stuck
  in a call (a read that never returns) is `abandon`ed: a new worker takes
  its place, and the stuck one exits if its call ever returns.
  """

  def __init__(self, workers: int, name: str):
    self._max = max(1, workers)
    self._name = name
    self._lock = threading.Lock()
    self._forget()
    os.register_at_fork(after_in_child=self._forget)

  def _forget(self) -> None:
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._workers: set[int] = set()  # Idents of live, not abandoned ones.
    self._idle = 0
    self._starting = 0

  def submit(self, fn: Callable[..., T], *args: Any
             ) -> "concurrent.futures.Future[T]":
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._jobs.put((future, fn, args))
    with self._lock:
      start = (self._idle + self._starting == 0
               and len(self._workers) + self._starting < self._max)
      if start:
        self._starting += 1
    if start:
      threading.Thread(target=self._work, daemon=True,
                       name=f"{self._name}").start()
    return future

  def _work(self) -> None:
    me = threading.get_ident()
    _watched.yes = True
    with self._lock:
      self._starting -= 1
      self._workers.add(me)
    while True:
      with self._lock:
        if me not in self._workers:
          return  # Abandoned while in its call: replaced already.
        self._idle += 1
      job = self._jobs.get()
      with self._lock:
        self._idle -= 1
      future, fn, args = job
      del job
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as e:  # pylint: disable=broad-except
          future.set_exception(e)
      del future, fn, args

  def abandon(self, thread: int) -> None:
    """Gives the place of worker `thread`, stuck in a call, to a new one."""
    with self._lock:
      if thread not in self._workers:
        return
      self._workers.discard(thread)
      self._starting += 1
    threading.Thread(target=self._work, daemon=True,
                     name=f"{self._name}").start()


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
