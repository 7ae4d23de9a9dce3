"""The liveness watcher against a coordinator whose answers the test sets.

The live-process answers are scripted (a fake coordinator): a real
coordination service cannot be made to report a restarted incarnation or
to stop answering on demand. `test_peer_lost.py` kills real processes.
"""

from __future__ import annotations

import threading
import time

import pytest

from flax_ckpt_plugin import PeerLostError
from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.tolerance import liveness


class ScriptedCoordinator:
  """Answers `live_processes` from `answers` (the last one repeats)."""

  def __init__(self, answers, count=3, me=0):
    self.answers = list(answers)
    self.process_count, self.process_index = count, me
    self.kv: dict[str, str] = {}
    self.polls = 0
    self.rounds = keys.Rounds()

  def live_processes(self, process_ids=None):
    self.polls += 1
    self.asked = process_ids
    answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
    if isinstance(answer, Exception):
      raise answer
    return dict(answer)

  def kv_set(self, key, value):
    self.kv[key] = value

  def kv_dir(self, prefix):
    return {k: v for k, v in self.kv.items() if k.startswith(prefix + "/")}


  abort = None

  def abort_when(self, check, *, replacing=None):
    if replacing is None or self.abort == replacing:
      self.abort = check


def _wait_for(predicate, secs=10.0):
  end = time.monotonic() + secs
  while not predicate() and time.monotonic() < end:
    time.sleep(0.01)
  return predicate()


ALL = {0: 10, 1: 11, 2: 12}


def test_all_live_raises_nothing():
  coord = ScriptedCoordinator([ALL])
  w = liveness.watch(coord, "run", poll_secs=0.01)
  assert _wait_for(lambda: coord.polls >= 5)
  w.check()
  assert w.lost == {}
  assert coord.asked == [0, 1, 2]
  w.close()


def test_survivors_poll_themselves_and_read_who_asks_to_join():
  """The survivors of process 2 poll 0 and 1 only (a relaunched process 2
  that does not poll must not hold their polls up), and report process 2
  once it asks to join under the watch's key; a member's request is
  ignored."""
  coord = ScriptedCoordinator([{0: 10, 1: 11}])
  w = liveness.watch(coord, "run", poll_secs=0.01, members=[0, 1],
                     key="group/1/watch", joins=True)
  assert _wait_for(lambda: coord.polls >= 3)
  assert coord.asked == [0, 1] and w.joining == frozenset()
  coord.kv_set(liveness.join_record("group/1/watch", 1), "1")
  coord.kv_set(liveness.join_record("group/1/watch", 2), "1")
  assert coord.kv == {"group/1/watch/join/1": "1",
                      "group/1/watch/join/2": "1"}
  assert _wait_for(lambda: w.joining == frozenset({2}))
  w.check()
  w.close()


@pytest.mark.parametrize("answer,why", [
    ({0: 10, 1: 11}, "is gone (it stopped sending heartbeats)"),
    ({0: 10, 1: 11, 2: 99}, "restarted (it has a new incarnation)"),
])
def test_a_missing_or_restarted_peer_is_lost(answer, why):
  coord = ScriptedCoordinator([ALL, ALL, answer])
  w = liveness.watch(coord, "run", poll_secs=0.01)
  assert _wait_for(lambda: w.lost)
  assert w.lost == {2: why}
  with pytest.raises(PeerLostError, match=f"process 2 {why.split()[0]}") as e:
    w.check()
  assert e.value.lost == {2: why}
  assert "noticed on process 0 of 3" in str(e.value)


def test_a_peer_that_closed_is_not_lost_and_all_stop_after_its_last_poll():
  """Process 2 closed after round 0: it recorded that every watcher stops
  after round 2 (it polls rounds 1 and 2, then stops). Gone at round 2, it
  is not lost, and this watcher stops after round 2 too, so that no poll
  waits for a process that stopped polling."""
  coord = ScriptedCoordinator([ALL, ALL, {0: 10, 1: 11}])
  coord.kv_set("flax_ckpt_plugin/liveness/run/0/stop/2", "")
  w = liveness.watch(coord, "run", poll_secs=0.01)
  assert _wait_for(lambda: coord.polls >= 2)
  time.sleep(0.2)
  assert coord.polls == 2
  assert w.lost == {}
  w.check()
  w.close()  # It knows the round already: nothing more to record.
  assert list(coord.kv) == ["flax_ckpt_plugin/liveness/run/0/stop/2"]


def test_watchers_that_close_together_record_one_key_per_round():
  """Every process of a job closes at its end: they record the round
  they all stop after, one key per round whoever records it (each reading
  a key per process would be O(N^2) for the service). A large job reads
  its records after every second poll, and so stops at an even round."""
  coords = [ScriptedCoordinator([ALL], me=p) for p in range(3)]
  for c in coords[1:]:
    c.kv = coords[0].kv  # One key-value store.
  ws = [liveness.watch(c, "run", poll_secs=0.01) for c in coords]
  assert _wait_for(lambda: all(w.rounds >= 3 for w in ws))
  for w in ws:
    w.close()
  stops = [k for k in coords[0].kv if "/stop/" in k]
  assert 1 <= len(stops) <= 2, stops  # Closed at rounds one apart at most.
  big = ScriptedCoordinator([{p: p for p in range(1000)}], count=1000)
  w = liveness.Watcher(big, "k", poll_secs=0.01)
  assert w.schedule.read_every == 2
  w.rounds = 3
  w.close()  # Not started: it only records.
  assert list(big.kv) == ["k/stop/6"]  # 3 + 2, to the next even round.


def test_the_stop_is_recorded_by_the_watcher_between_two_of_its_polls():
  """`close` has the watcher's thread record the stop before its next
  poll, for the first round after it: recorded from the caller's thread,
  the record could land after the peers' read of the round it names, and
  they would stop at different rounds (one poll waiting for nobody)."""
  coord = ScriptedCoordinator([ALL])
  recorded = []
  kv_set = coord.kv_set

  def recording(key, value):
    recorded.append((key, threading.current_thread().name, coord.polls))
    kv_set(key, value)

  coord.kv_set = recording
  w = liveness.watch(coord, "run", poll_secs=0.05)
  assert _wait_for(lambda: w.rounds >= 3)
  w.close()
  [(key, thread, polls)] = recorded
  assert thread == "flax_ckpt_plugin-liveness"
  stop = int(key.rsplit("/", 1)[1])
  assert stop == polls + 1  # Its next poll, a round of reads here.
  assert w.rounds == coord.polls == stop  # Its last poll was that one.


def test_no_answer_is_asked_again_until_the_service_says_who_died():
  """A poll waits while a dead peer is not yet declared dead (JAX's
  heartbeat timeout, 100 s by default, is longer than a call's deadline):
  a timeout is no loss, and the next answer names the dead peer."""
  late = TimeoutError("no answer in 36 s")
  coord = ScriptedCoordinator([ALL, late, late, {0: 10, 1: 11}])
  w = liveness.watch(coord, "run", poll_secs=0.01)
  assert _wait_for(lambda: w.lost)
  assert w.lost == {2: "is gone (it stopped sending heartbeats)"}
  assert coord.polls == 4


def test_no_answer_before_the_first_is_waited_out():
  """Processes create their callbacks at different times: the first polls
  wait for the last one to start polling, and may time out meanwhile."""
  late = TimeoutError("no answer in 32 s")
  coord = ScriptedCoordinator([late, late, ALL])
  w = liveness.watch(coord, "run", poll_secs=0.01)
  assert _wait_for(lambda: coord.polls >= 5)
  assert w.lost == {}
  w.close()


def test_no_answer_after_a_peer_closed_ends_the_watch_quietly():
  """A peer that closed stops polling, so polls block until their deadline:
  that is not a loss."""
  coord = ScriptedCoordinator([ALL, TimeoutError("no answer in 32 s")])
  coord.kv_set("flax_ckpt_plugin/liveness/run/0/stop/5", "")
  w = liveness.watch(coord, "run", poll_secs=0.01)
  assert _wait_for(lambda: coord.polls >= 2)
  time.sleep(0.1)
  assert w.lost == {}
  w.check()


def test_a_watcher_obeyed_by_the_coordinator_until_it_closes():
  coord = ScriptedCoordinator([ALL])
  first = liveness.watch(coord, "a", poll_secs=0.01)
  assert coord.abort == first.check
  second = liveness.watch(coord, "b", poll_secs=0.01)
  assert coord.abort == second.check
  first.close()  # Not its check any more: left in place.
  assert coord.abort == second.check
  second.close()
  assert coord.abort is None


def test_a_lost_peer_found_after_close_is_not_reported():
  coord = ScriptedCoordinator([ALL])
  w = liveness.watch(coord, "run", poll_secs=0.01)
  w.close()
  coord.answers = [{0: 10}]
  time.sleep(0.1)
  assert w.lost == {}


def test_a_wait_ends_at_once_when_the_abort_check_raises():
  """A call stuck on a dead peer returns within 0.1 s of the loss."""
  release = threading.Event()
  lost = threading.Event()

  def abort():
    if lost.is_set():
      raise PeerLostError({1: "is gone"}, 0, 2)

  threading.Timer(0.3, lost.set).start()
  start = time.monotonic()
  with pytest.raises(PeerLostError):
    deadlines.DEADLINES.call(release.wait, 60, abort)
  assert time.monotonic() - start < 5
  release.set()


def test_a_wait_without_abort_still_has_its_deadline():
  release = threading.Event()
  with pytest.raises(deadlines.NoAnswer):
    deadlines.DEADLINES.call(release.wait, 0.2)
  release.set()
  assert deadlines.DEADLINES.call(lambda: 7, 5, lambda: None) == 7


def test_a_large_job_polls_less_often_so_its_calls_stay_bounded():
  """Up to 200 processes poll at the period asked for, and read the
  watch's records after each poll; above, they read after every second
  poll and the period grows so that the job calls the service at most
  `JOB_CALLS_PER_SEC` times a second (the simulator measures it at 4,096:
  benchmarks/control_plane.py)."""
  assert liveness.schedule(0.5, 2) == (0.5, 1)
  assert liveness.schedule(0.5, 200) == (0.5, 1)
  assert liveness.schedule(0.5, 201) == (0.5, 2)
  at_4096 = liveness.schedule(0.5, 4096)
  assert at_4096 == (pytest.approx(7.68), 2)
  # The job's calls stay under JOB_CALLS_PER_SEC: about 1 per 5 processes.
  assert at_4096.calls_per_sec(4096) <= 4096 / 5
  assert at_4096.period < 10  # A loss known within 10 s of it declared.
  assert liveness.schedule(10.0, 4096) == (10.0, 2)  # A longer one is kept.
  big = ScriptedCoordinator([{p: p for p in range(1000)}], count=1000)
  watcher = liveness.Watcher(big, "k", poll_secs=0.5).start()
  try:
    assert _wait_for(lambda: big.polls >= 1)
    time.sleep(0.5)
    assert big.polls == 1  # The next poll comes after 1.875 s.
  finally:
    watcher.close()


def test_watchers_that_poll_differently_are_named_when_the_watch_starts():
  """Processes 1 and 3 of 4 were given another `watch_poll_secs` (their
  rounds would drift from the others'): every process's watch ends at its
  start with one error naming both and what they have; alike, all start."""
  from fake_coordinator import run_threads  # pylint: disable=g-import-not-at-top

  def start(coord, polls):
    try:
      liveness.agree_on_settings(
          meetings.Meeting(coord, "w", 10_000),
          poll_secs=polls[coord.process_index],
          members=None)
    except ValueError as e:
      return str(e)
    return None

  errors = run_threads(4, lambda c: start(c, [0.5, 1.0, 0.5, 2.0]))
  assert len(set(errors)) == 1 and errors[0] is not None
  assert ("process 0 has watch_poll_secs=0.5 over processes [0, 1, 2, 3]"
          in errors[0])
  assert "process 1 has watch_poll_secs=1" in errors[0]
  assert "process 3 has watch_poll_secs=2" in errors[0]
  assert "process 2 has" not in errors[0]
  assert run_threads(4, lambda c: start(c, [0.5] * 4)) == [None] * 4
