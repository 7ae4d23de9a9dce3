"""A relaunched process's side of rejoining an elastic group.

Threads share a fake coordinator's key-value store (`fake_coordinator`):
the plan that the survivors record and a relaunched process reads, and a
plan that never comes, which no real service can be made to withhold on
demand. `test_elastic.py` rejoins real processes.
"""

from __future__ import annotations

import pytest

from fake_coordinator import FakeCluster
from flax_ckpt_plugin.tolerance import generations
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
