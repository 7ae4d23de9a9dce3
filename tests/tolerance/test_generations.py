"""A relaunched process's side of rejoining an elastic group.

Threads share a fake coordinator's key-value store (`fake_coordinator`):
the plan that the survivors record and a relaunched process reads, and a
plan that never comes, which no real service can be made to withhold on
demand. `test_elastic.py` rejoins real processes.
"""

from __future__ import annotations

import threading
import time

import pytest

from fake_coordinator import FakeCluster
from flax_ckpt_plugin.tolerance import generations
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings

SURVIVORS = generations.Group((0, 1, 2), 1, 0)  # Process 3 was lost.
KEY = "job/group"


def _requests(coord) -> dict[str, str]:
  """The requests to join that the survivors' watcher reads."""
  return coord.kv_dir(f"{generations.watch_key(KEY, SURVIVORS.gen)}/join")


def test_a_relaunched_process_reads_the_plan_its_survivors_record():
  cluster = FakeCluster(4)
  first, relaunched = cluster.coordinators()[0], cluster.coordinators()[3]
  asked = generations.ask_to_join(relaunched, KEY, SURVIVORS)
  assert list(_requests(first)) == [asked]
  generations.record_plan(first, f"{KEY}/1", 12, [0, 1, 2], [0, 1, 2, 3])
  assert generations.read_plan(
      meetings.Meeting(relaunched, f"{KEY}/1", 1000), asked
  ) == (12, [0, 1, 2], [0, 1, 2, 3])


def test_a_relaunched_process_that_gets_no_plan_withdraws_its_request():
  """The survivors never record a plan (they ended, say): the relaunched
  process's wait times out, and its request is gone, so that no later
  reading of the survivors' records plans to take back a process that
  gave up (they would wait out their barriers for it, then refuse every
  request to their group)."""
  cluster = FakeCluster(4)
  first, relaunched = cluster.coordinators()[0], cluster.coordinators()[3]
  asked = generations.ask_to_join(relaunched, KEY, SURVIVORS)
  assert list(_requests(first)) == [asked]
  with pytest.raises(TimeoutError, match="plan"):
    generations.read_plan(meetings.Meeting(relaunched, f"{KEY}/1", 50), asked)
  assert _requests(first) == {}


def test_a_failed_withdrawal_leaves_the_wait_s_error(monkeypatch):
  """Where the service itself failed, withdrawing the request fails too:
  the caller still gets the wait's error, not the withdrawal's."""
  cluster = FakeCluster(4)
  relaunched = cluster.coordinators()[3]
  asked = generations.ask_to_join(relaunched, KEY, SURVIVORS)

  def gone(key):
    raise ConnectionError(f"the service is gone ({key})")

  monkeypatch.setattr(relaunched, "kv_delete", gone)
  with pytest.raises(TimeoutError, match="plan"):
    generations.read_plan(meetings.Meeting(relaunched, f"{KEY}/1", 50), asked)


def test_a_relaunched_process_stops_its_poll_once_the_loss_is_recorded():
  """The relaunched process polls with the old group just as the
  survivors' watcher records the loss (and stops polling that way): its
  poll would wait out its whole deadline, while the survivors train on
  and may end before it asks to join (seen in CI: a 30 s poll against
  26 s of steps left). It stops waiting once the record is there. The
  fake's poll waits for survivors that never come, which no real service
  can be made to do at a chosen moment."""
  cluster = FakeCluster(4)
  survivor, relaunched = cluster.coordinators()[0], cluster.coordinators()[2]
  group = generations.Group((0, 1, 2, 3), 0, 0)
  polled = threading.Event()

  def live_processes(process_ids, timeout_secs):  # Nobody else polls.
    polled.set()
    time.sleep(timeout_secs)
    raise TimeoutError("the live processes timed out")

  relaunched.live_processes = live_processes
  threading.Timer(0.3, lambda: survivor.kv_set(
      keys.Generation(KEY, 0).lost, "[2]")).start()
  start = time.monotonic()
  generations.show_restart(relaunched, KEY, group, poll_secs=20.0,
                           look_secs=0.05)
  assert polled.is_set()
  assert time.monotonic() - start < 5.0


def test_a_relaunched_process_waits_for_its_poll_while_no_loss_is_recorded():
  """Until the survivors record the loss, the poll is waited for: its
  answer (or its deadline) ends the wait."""
  cluster = FakeCluster(4)
  relaunched = cluster.coordinators()[2]
  calls = []

  def live_processes(process_ids, timeout_secs):
    calls.append(sorted(process_ids))
    time.sleep(0.5)
    return {p: p for p in process_ids}

  relaunched.live_processes = live_processes
  start = time.monotonic()
  generations.show_restart(relaunched, KEY, generations.Group(
      (0, 1, 2, 3), 0, 0), poll_secs=20.0, look_secs=0.05)
  assert calls == [[0, 1, 2, 3]]
  assert time.monotonic() - start >= 0.5
