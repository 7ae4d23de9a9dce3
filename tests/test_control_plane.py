"""The control-plane simulator (benchmarks/control_plane.py) at 64
processes: every save finalizes once and every process lists the same
steps; a lost process is noticed by every survivor; and the service counts
what it is asked (figures, not timed: see docs/performance.md)."""

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


@pytest.mark.timeout(120)
def test_a_lost_process_is_noticed_by_every_survivor_of_64(sim):
  row = sim.simulate_watchers(64, poll_secs=0.2, watch_secs=1.0, lost=5)
  assert row["survivors_that_knew"] == row["survivors"] == 63, row
  assert row["secs_until_all_knew"] is not None
  assert row["live_calls_per_sec"] > 0, row


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
