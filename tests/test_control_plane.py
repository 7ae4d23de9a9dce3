"""The control-plane simulator (benchmarks/control_plane.py) at 64
processes: every save finalizes once and every process lists the same
steps; a lost process is noticed by every survivor; and the service counts
what it is asked (figures, not timed: see docs/control_plane.md)."""

import importlib.util
import pathlib
import sys

import pytest

SIM = pathlib.Path(__file__).parent.parent / "benchmarks" / "control_plane.py"


@pytest.fixture(scope="module")
def sim():
  spec = importlib.util.spec_from_file_location("control_plane", SIM)
  module = importlib.util.module_from_spec(spec)
  sys.modules["control_plane"] = module
  spec.loader.exec_module(module)
  yield module
  sys.modules.pop("control_plane", None)


@pytest.mark.timeout(120)
def test_64_processes_finalize_every_save_once(sim, tmp_path):
  row = sim.simulate_saves(64, saves=3, directory=str(tmp_path))
  assert row["finalized"] == [1, 2, 3]  # The primary's hooks, once each.
  assert row["steps_agree"] and row["steps"] == [2, 3]  # max_to_keep=2.
  assert row["largest_barrier"] == 64
  per = row["ops_by_kind_per_save"]
  assert per["barrier"] >= 3 * 64, per  # Every phase meets every process.
  assert row["ops_per_process_per_save_max"] >= 3, row
  # Flat in N, as docs/control_plane.md says: at most 10 a save.
  assert row["ops_per_process_per_save_max"] <= 10, row
  assert 0 < row["opening"]["ops_per_process_max"] <= 10, row["opening"]


@pytest.mark.timeout(120)
def test_a_lost_process_is_noticed_by_every_survivor_of_64(sim):
  row = sim.simulate_watchers(64, poll_secs=0.2, watch_secs=1.0, lost=5)
  assert row["survivors_that_knew"] == row["survivors"] == 63, row
  assert row["secs_until_all_knew"] is not None
  assert row["live_calls_per_sec"] > 0, row


@pytest.mark.timeout(120)
def test_a_restart_is_noticed_and_its_request_to_join_seen_by_all_of_64(sim):
  """Process 5 restarts (a new incarnation): every survivor's watcher
  reports it; the relaunched process finds the job's group, regroups with
  the survivors' record and asks to join in a handful of calls, and every
  survivor's new watcher sees the request."""
  row = sim.simulate_watchers(64, poll_secs=0.2, watch_secs=1.0, lost=5,
                              fault="restart")
  assert row["survivors_that_knew"] == row["survivors"] == 63, row
  assert row["secs_until_all_saw_the_request"] is not None, row
  # joining, show_restart (2), next_group_without, the request.
  assert row["relaunched_calls"] == 5, row
  assert row["rejoin_calls_per_survivor"] < 20, row


@pytest.mark.timeout(120)
def test_64_watchers_closing_at_once_write_and_read_a_few_small_keys(sim):
  """A job's end: every watcher stops, after one recorded round (not one
  key per process, which every watcher would read: O(N^2) bytes)."""
  row = sim.simulate_watchers(64, poll_secs=0.2, watch_secs=1.0,
                              fault="close")
  assert row["stopped_at_the_round"] == 64, row
  assert row["close_kv_bytes"] < 64 * 300, row  # A key a process: 180 kB.
  assert row["calls_per_sec"] <= row["nominal_calls_per_sec"] * 1.2, row


def test_the_service_counts_and_times_out_like_the_real_one(sim):
  service = sim.Service(2)
  a, b = service.coordinators()
  a.kv_set("x/1", "one")
  assert b.kv_get("x/1", timeout_ms=100) == "one"
  assert b.kv_dir("x") == {"x/1": "one"}
  with pytest.raises(TimeoutError, match="'y'"):
    b.kv_get("y", timeout_ms=50)
  with pytest.raises(TimeoutError, match="missing \\[1\\]"):
    a.barrier("b", timeout_ms=50)
  a.kv_delete("x")
  assert b.kv_dir("x") == {}
  assert service.ops["kv_set"] == 1 and service.ops["barrier"] == 1
  assert service.by_process[1] == 4  # get, dir, the get that timed out, dir.
  assert service.reads["x/1"] == 1


@pytest.mark.timeout(120)
def test_63_survivors_agree_with_a_few_small_calls_each(sim):
  """The survivors' agreements of an elastic job: the newest local step
  they all hold, and the step that takes a relaunched process back, each
  the same on every survivor, for a few calls and a few hundred bytes of
  key-value traffic a survivor (the first member reads every one's)."""
  row = sim.simulate_elastic(64)
  assert list(row["common_step"]["result"]) == [5, None]
  assert list(row["vote"]["result"]) == [5, [63]]  # Last noticed at 3, + 2.
  for name in ("common_step", "vote"):
    figures = row[name]
    assert figures["ops_per_process_max"] <= 8, (name, figures)
    assert figures["kv_bytes_per_process"] < 300, (name, figures)


def test_a_survivor_past_the_agreed_step_is_told(sim):
  """A loop that skipped calls of the callback finds itself past the step
  the survivors agreed on: an error saying so, not a silent mismatch."""
  from flax_ckpt_plugin.tolerance import generations  # pylint: disable=g-import-not-at-top
  coords = sim.Service(2).coordinators()
  group = generations.Group((0, 1), 1, 0)
  assert generations.vote(coords[1], "v", group, 10, 12, [2]) is None
  assert generations.vote(coords[0], "v", group, 10, 12, [2]) is None
  assert generations.vote(coords[0], "v", group, 11, None, [2]) is None
  with pytest.raises(RuntimeError, match="at step 13: the loop must call"):
    generations.vote(coords[1], "v", group, 13, None, [2])
  assert generations.vote(coords[0], "v", group, 12, None, [2]) == (12, [2])


@pytest.mark.timeout(120)
def test_63_survivors_learn_who_writes_what_without_each_others_lists(
    sim, tmp_path):
  """The survivors' save after a loss: every shard of their local step
  written once, by its lowest holder (the first survivor, where all hold
  everything), and each other survivor asks the service a few small
  things, not every survivor's list of shards."""
  row = sim.simulate_shares(64, leaves=50, directory=str(tmp_path))
  assert row["writers"] == [0] and row["shards_written"] == 50, row
  assert row["ops_per_process_of_the_others"] <= 15, row
  assert row["kv_bytes_per_process"] < 1000, row


@pytest.mark.timeout(120)
def test_a_restore_made_together_at_64_processes_shares_and_balances(sim):
  """The plan of a restore made together (`read_plan`) on a (data, model)
  mesh of 64 processes x 8 devices: kernels replicated over data and the
  replicated norm scales are shared (2 of every 5 leaves), and the small
  ones are read whole by the processes in turn, each by one."""
  row = sim.time_read_plan(64, 1000)
  assert row["shared_leaves"] == 400, row
  readers = row["read_whole_by"]
  assert sum(readers.values()) == 200 and len(readers) == 64, readers
  assert max(readers.values()) - min(readers.values()) <= 1, readers


def test_the_partner_plan_of_512_processes_balances_and_leaves_each_host(sim):
  """8 processes a host, FSDP: every copy leaves its sender's host and
  every process receives the same bytes, with one and two replicas; the
  processes learn each other's domains in a few operations each."""
  for replicas in (1, 2):
    row = sim.time_partners(512, replicas=replicas, per_host=8)
    assert row["received_max_over_mean"] == row["received_min_over_mean"] == 1
    assert row["copies_in_own_domain"] == 0
    # Their only coordination: the domains, shared once at open.
    assert row["domains_ops_per_process_at_open"] <= 4, row
