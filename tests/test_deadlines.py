"""The deadlines of blocking calls (`flax_ckpt_plugin.deadlines`): the
pools of daemon threads, the record of storage operations in flight, and
the waits on them."""

from __future__ import annotations

import threading
import time

import pytest

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin import StorageTimeoutError


def _threads(name: str) -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == name]


def test_a_pool_runs_as_many_jobs_at_once_as_it_has_workers():
  """A burst of jobs after a quiet spell starts the workers it needs (all
  four meet at a barrier that only four at once can pass)."""
  pool = deadlines.Pool(4, "test-pool-burst")
  deadlines.wait_all([pool.submit(lambda: 1)],
                     in_flight=deadlines.InFlight())  # One worker, idle.
  meet = threading.Barrier(4, timeout=20)
  results = deadlines.wait_all([pool.submit(meet.wait) for _ in range(4)],
                               in_flight=deadlines.InFlight())
  assert sorted(results) == [0, 1, 2, 3]
  assert len(_threads("test-pool-burst")) <= 4


def test_idle_workers_end_and_a_pool_starts_again():
  pool = deadlines.Pool(2, "test-pool-idle")
  pool.IDLE_SECS = 0.2
  assert deadlines.wait_all([pool.submit(lambda: 7)],
                            in_flight=deadlines.InFlight()) == [7]
  for thread in _threads("test-pool-idle"):
    thread.join(10)
  assert not _threads("test-pool-idle")
  assert deadlines.wait_all([pool.submit(lambda: 8)],
                            in_flight=deadlines.InFlight()) == [8]


def test_a_stuck_worker_is_replaced_and_its_record_given_up():
  pool = deadlines.Pool(1, "test-pool-stuck")
  io = deadlines.InFlight(0.3, "a test")
  release = threading.Event()

  def stuck():
    with io.doing("reading bytes [0, 8) of f"):
      release.wait(30)

  t0 = time.monotonic()
  with pytest.raises(StorageTimeoutError, match=r"reading bytes \[0, 8\) of f"
                     r" \(a test\): no answer"):
    deadlines.wait_all([pool.submit(stuck)], in_flight=io, pool=pool)
  assert time.monotonic() - t0 < 5
  assert io.given_up
  with pytest.raises(StorageTimeoutError, match="not begun"):
    with io.doing("the next read"):
      pass
  # The only worker is stuck: a new one takes the next job.
  assert deadlines.wait_all([pool.submit(lambda: 5)],
                            in_flight=deadlines.InFlight()) == [5]
  release.set()


def test_wait_all_cancels_what_has_not_begun_after_a_first_error():
  pool = deadlines.Pool(1, "test-pool-first-error")
  ran = []

  def fail():
    raise ValueError("the first")

  futures = [pool.submit(fail)] + [pool.submit(ran.append, i)
                                   for i in range(3)]
  with pytest.raises(ValueError, match="the first"):
    deadlines.wait_all(futures, in_flight=deadlines.InFlight(),
                       first_error=True)
  assert len(ran) < 3


def test_a_call_off_the_pools_runs_with_the_deadline():
  io = deadlines.InFlight(0.3)
  release = threading.Event()
  t0 = time.monotonic()
  with pytest.raises(StorageTimeoutError, match="opening f"):
    io.call(lambda: release.wait(30), "opening f")
  assert time.monotonic() - t0 < 5
  release.set()
  assert deadlines.InFlight(5).call(lambda: 3, "x") == 3
