"""The benchmark runs end to end in tiny configurations (not timed tests)."""

import collections
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

BENCH = pathlib.Path(__file__).parent.parent / "benchmarks" / "bench.py"


def _bench(tmp_path, *args):
  """Runs bench.py with `args`, its checkpoints and JSON under tmp_path."""
  out = tmp_path / "bench.json"
  proc = subprocess.run(
      [sys.executable, str(BENCH), *args, "--dir", str(tmp_path), "--json",
       str(out)], capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  assert "ours/Orbax" in proc.stdout  # The table was printed.
  # Checkpoints went under --dir and were cleaned up.
  assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]
  return proc.stdout, json.loads(out.read_text())


@pytest.mark.multiprocess
def test_tiny_benchmark_runs_both_systems_and_reports_every_figure(tmp_path):
  stdout, result = _bench(
      tmp_path, "--layers", "2", "--width", "128", "--batch", "4", "--steps",
      "4", "--every", "2", "--repeats", "1", "--rounds", "2", "--ab", "1")
  summary = result["summary"]
  for system in ("ours", "orbax"):
    figures = summary[system]
    assert figures["restore_bit_identical"], system
    for key in ("loop_overhead", "loop_overhead_steady", "blocking_secs",
                "isolated_save_secs",
                "raw_write_fsync_gbps", "warm_restore_secs",
                "step_after_restore_secs", "step_secs", "rss_mb_peak",
                "restore_cpu_secs", "restore_page_faults",
                "warm_restore_vs_floor", "fresh_restore_secs",
                "fresh_restore_cold_secs",
                "fresh_restore_vs_parallel_floor", "restore_after_save_secs",
                "restore_after_save_vs_parallel_floor", "direct_write_gbps"):
      assert figures[key] == figures[key], (system, key)  # Not NaN.
    run = result["runs"][system][0]
    assert len(run["blocking_secs"]) == 4  # Steps 2 and 4, in 2 rounds.
    # Each of the 4 loops with saves sits between 2 of the 5 without.
    assert len(run["loop_secs_no_saves"]) == 5
    assert len(run["loop_overhead_rounds"]) == 2
    assert len(run["loop_overhead_steady_rounds"]) == 2
    assert len(run["warm_restore_secs"]) == 3
    assert len(run["step_after_restore_secs"]) == 3
    assert len(run["restore_cpu_secs"]) == 3
    assert len(run["restore_page_faults"]) == 3
    assert run["touch_secs_per_gb"] > 0 and run["unlink_raw_secs"] >= 0
    assert run["restore_floor_secs"] > 0 and run["restore_floor_thp_secs"] > 0
    assert 0 <= run["restore_floor_thp_huge_share"] <= 1
  assert summary["machine"]["touch_secs_per_gb"] > 0
  assert summary["machine"]["unlink_raw_secs"] >= 0
  assert summary["machine"]["restore_floor_secs"] > 0
  assert summary["machine"]["restore_floor_thp_secs"] > 0
  assert set(summary["ratios"]) == {"loop_overhead", "loop_overhead_steady",
                                    "blocking",
                                    "isolated_save", "warm_restore",
                                    "restore_after_save",
                                    "fresh_restore", "fresh_restore_cold",
                                    "rss_peak"}
  # The lever A/B ran and reported every mode.
  assert set(summary["lever_ab"]) == {"pin", "host_copy", "enqueued_copy",
                                      "save_page_cache", "save_direct"}
  for mode, ab in summary["lever_ab"].items():
    assert ab["blocking_secs"] >= 0 and ab["cost_per_save_secs"] == ab[
        "cost_per_save_secs"], mode
  assert "machine: touching new memory takes" in stdout
  assert "restore floor" in stdout
  assert "levers, one process of ours" in stdout


SCALING_FIGURES = (
    "first_save_blocking_secs", "first_save_durable_secs",
    "later_save_blocking_secs", "later_save_durable_secs",
    "fresh_restore_secs", "warm_restore_secs",
    "peak_rss_above_loop_per_state_byte", "rss_growth")


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape_args", [
    ("--shape", "many", "--leaves", "200", "--state-mb", "4"),
    ("--shape", "transformer", "--d-model", "64", "--unscanned-layers", "2",
     "--scanned-layers", "2", "--vocab", "256"),
    ("--shape", "large", "--state-mb", "8"),
], ids=lambda a: a[1])
def test_tiny_scaling_benchmark_reports_every_figure(tmp_path, shape_args):
  stdout, result = _bench(tmp_path, *shape_args, "--saves", "4",
                          "--repeats", "1")
  summary = result["summary"]
  for system in ("ours", "orbax"):
    figures = summary[system]
    assert figures["restore_bit_identical"], system
    for key in SCALING_FIGURES:
      assert not math.isnan(figures[key]), (system, key)
    run = result["runs"][system][0]
    assert run["system"] == system and run["peak_rss_reset"]
    assert len(run["save_blocking_secs"]) == 4
    assert len(run["save_durable_secs"]) == 4
    assert len(run["warm_restore_secs"]) == 3
    assert run["fresh_restore_secs"] > 0 and run["state_bytes"] > 0
  assert set(summary["ratios"]) == set(SCALING_FIGURES)
  assert "restore in a fresh process" in stdout
  assert "restores bit-identical: ours True, Orbax True" in stdout


def test_many_shape_has_the_leaves_bytes_and_mix_asked_for():
  sys.path.insert(0, str(BENCH.parent))
  try:
    import shapes  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  args = types.SimpleNamespace(shape="many", leaves=1000, state_mb=200,
                               seed=0)
  leaves = jax.tree.leaves(shapes.initial_spec(args))
  assert len(leaves) == 1000
  sizes = [math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in leaves]
  assert abs(sum(sizes) - 200e6) < 2e6
  assert min(sizes) <= 8 and max(sizes) >= 10e6
  assert any(s.shape == () for s in leaves)
  dtypes = collections.Counter(str(s.dtype) for s in leaves)
  assert set(dtypes) == {"float32", "bfloat16", "int8", "int32"}
  assert dtypes["float32"] > len(leaves) / 2
  assert len({(s.shape, str(s.dtype)) for s in leaves}) == 30


TIERS = BENCH.parent / "tiers.py"


@pytest.mark.multiprocess
def test_tiny_tiers_benchmark_restores_from_every_tier(tmp_path):
  out = tmp_path / "tiers.json"
  local = tmp_path / "local"
  local.mkdir()
  proc = subprocess.run(
      [sys.executable, str(TIERS), "--layers", "2", "--width", "128",
       "--batch", "4", "--local-every", "2", "--pairs", "3",
       "--restores", "1", "--dir", str(tmp_path), "--local-dir", str(local),
       "--json", str(out)],
      capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  one = result["one_process"]
  assert one["local_restore_read_persistent"] is False
  for key in ("local_restore_secs", "persistent_restore_secs",
              "orbax_restore_secs"):
    assert len(one[key]) == 1 and one[key][0] == one[key][0], key
  for key in ("loop_secs_with_saves", "loop_secs_without",
              "loop_overhead_pairs"):
    assert len(one[key]) == 3, key
  assert one["loop_overhead"] > -1 and len(one["loop_overhead_quartiles"]) == 3
  assert set(result["processes_summary"]) == {"local", "peer", "persistent"}
  assert len(result["processes"]) == 2
  # Everything it wrote is gone.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "tiers.json"]
  assert not list(local.iterdir())


PARTNERS = BENCH.parent / "partners.py"


@pytest.mark.multiprocess
def test_tiny_partners_benchmark_reports_every_figure(tmp_path):
  """2 processes, replicas=1: every process sends exactly its unique
  share once per save, and every figure is there."""
  out = tmp_path / "partners.json"
  local = tmp_path / "local"
  local.mkdir()
  proc = subprocess.run(
      [sys.executable, str(PARTNERS), "--processes", "2", "--layers", "1",
       "--width", "64", "--local-every", "2", "--pairs", "1", "--dir",
       str(tmp_path), "--local-dir", str(local), "--json", str(out)],
      capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  summary = json.loads(out.read_text())["summary"]
  assert summary["sent_over_replicas_x_share"] == [1.0, 1.0], summary
  for key in ("overhead_replicas0", "overhead_partners",
              "save_call_ms_replicas0", "save_call_ms_partners"):
    assert summary[key] == summary[key] and summary[key] > -1, key
  assert sorted(p.name for p in tmp_path.iterdir()) == ["local",
                                                        "partners.json"]
  assert not list(local.iterdir())


SCALEOUT = BENCH.parent / "scaleout.py"


def _run_script(script, tmp_path, *args):
  """Runs a benchmark script with `args`, writing under tmp_path; its
  stdout and its JSON."""
  out = tmp_path / f"{script.stem}.json"
  proc = subprocess.run(
      [sys.executable, str(script), *args, "--dir", str(tmp_path), "--json",
       str(out)], capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  return proc.stdout, json.loads(out.read_text())


@pytest.mark.multiprocess
def test_tiny_scaleout_benchmark_spreads_the_writes(tmp_path):
  stdout, result = _run_script(
      SCALEOUT, tmp_path, "--mb", "4", "--mbps", "50", "--processes", "1,2",
      "--layouts", "data_parallel")
  assert "SIMULATED per-process links of 50 MB/s" in stdout
  runs = result["runs"]
  assert sorted(runs) == ["data_parallel_1", "data_parallel_2"]
  two = runs["data_parallel_2"]
  total = two[0]["state_bytes"]
  assert [o["written"] for o in runs["data_parallel_1"]] == [total]
  assert sum(o["written"] for o in two) == total
  # Small kernels: each written whole, by the process with fewer bytes.
  assert max(o["written"] for o in two) <= 0.6 * total, two
  assert all(o["bit_identical"] for r in runs.values() for o in r)
  assert all(o["orbax_written"] > 0 for o in two)
  # Everything it wrote is gone.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["scaleout.json"]


TRAVEL = BENCH.parent / "travel.py"


@pytest.mark.multiprocess
def test_tiny_travel_benchmark_reports_cast_and_export_memory(tmp_path):
  stdout, result = _run_script(TRAVEL, tmp_path, "--cast-mb", "8",
                               "--export-mb", "8")
  assert "x the restored state (limit 1.10)" in stdout
  assert "peak RSS" in stdout and "(limit 600 MB)" in stdout
  assert result["plain"]["exact"]
  assert result["plain"]["restored_bytes"] == result["cast_save"][
      "saved_bytes"]
  for key in ("cast", "cast_warm"):
    cast = result[key]
    assert cast["exact"], key
    assert cast["restored_bytes"] * 2 == result["cast_save"]["saved_bytes"]
    assert cast["peak_above_before"] > 0 and cast["secs"] > 0, key
  assert result["cast_peak_over_restored"] > 0
  assert result["cast_warm_peak_over_restored"] > 0
  for fmt in ("safetensors", "npz"):
    assert result[fmt]["exported_bytes"] == result["export_save"][
        "saved_bytes"], fmt
    assert result[fmt]["file_bytes"] > result[fmt]["exported_bytes"], fmt
    assert result[fmt]["peak_rss"] > 0 and not result[fmt]["jax_imported"]
  # Everything it wrote is gone.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["travel.json"]


ACCEL = BENCH.parent / "accel.py"


@pytest.mark.multiprocess
def test_tiny_accelerator_benchmark_reports_every_figure(tmp_path):
  """accel.py on the CPU, whose devices take the accelerator path through
  the test suite's switch: every system, every figure, every save
  restored bit for bit, and nothing left under --dir."""
  out = tmp_path / "accel.json"
  proc = subprocess.run(
      # --gb: the state's size, here 2 layers of 128 x 128 with Adam.
      [sys.executable, str(ACCEL), "--gb", "0.0004", "--width", "128",
       "--batch", "4", "--repeats", "1", "--first-after-secs", "0.1",
       "--loop-saves", "1", "--later-restores", "1", "--cold", "--dir",
       str(tmp_path), "--json", str(out)],
      capture_output=True, text=True, timeout=300, check=False,
      env={**os.environ, "FLAX_CKPT_PLUGIN_PINNED_CPU": "1"})
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  assert [p.name for p in tmp_path.iterdir()] == ["accel.json"]
  result = json.loads(out.read_text())["0.0004GB"]
  assert 0.3e6 < result["runs"]["ours"][0]["state_bytes"] < 0.5e6
  assert "ours/orbax" in proc.stdout and "machine: " in proc.stdout
  assert "the disk's direct-write rate" in proc.stdout
  for system in ("ours", "ours_page_cache", "orbax"):
    run = result["runs"][system][0]
    for key in ("first_save_blocking_secs", "isolated_save_durable_secs",
                "first_restore_secs", "cold_first_restore_secs",
                "peak_rss_gb"):
      assert run[key] == run[key] and run[key] >= 0, (system, key)
    # A difference of two loops' times: a few ms below 0 on a tiny state.
    assert math.isfinite(run["synced_overhead_per_save_secs"]), system
    assert len(run["later_save_blocking_secs"]) == 2  # One per loop.
    stages = ["trained", "first_saved", "restored_after_save", "closed"]
    assert run["restore_after_save_identical"] is True, system
    assert run["restore_after_save_secs"] > 0, system
    if system != "orbax":
      assert run["pinned_path"] is True
      assert run["saves_bit_identical"] == [True] * 4, system
      # From the pinned snapshot the save still held, not from the disk.
      assert (0.9 * run["state_bytes"]
              <= run["restore_after_save_from_memory_bytes"]
              <= run["state_bytes"]), system
      stages.insert(1, "warmed_up")
    assert list(run["rss_gb_at"]) == stages, system
    assert list(run["restore_rss_gb_at"]) == ["opened", "restored",
                                              "peak_first"], system
    # (The kernel's counts of resident pages and of its peak are each
    # summed lazily over threads: they differ by a fraction of a percent.)
    assert all(0 < gb <= 1.02 * run["peak_rss_gb"]
               for gb in run["rss_gb_at"].values()), system
  for key in ("d2h_pinned_gbps", "h2d_pinned_gbps", "d2h_pageable_gbps",
              "disk_read_gbps", "page_cache_read_gbps",
              "disk_write_direct_gbps"):
    assert result["rates"][key] > 0, key


def test_tiny_save_call_benchmark_reports_every_call(tmp_path):
  """save_call.py, tiny: every save's call and its CPU time, both shapes,
  and nothing left under --dir."""
  script = pathlib.Path(__file__).parent.parent / "benchmarks" / "save_call.py"
  for args, calls in ((["--layers", "2", "--width", "128", "--managers", "2",
                        "--saves", "2"], 4),
                      (["--shape", "many", "--leaves", "100", "--state-mb",
                        "2", "--saves", "2"], 2)):
    out = tmp_path / "save_call.json"
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--dir", str(tmp_path),
         "--json", str(out)], capture_output=True, text=True, timeout=300,
        check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["calls"]) == calls, result
    assert all(wall > 0 and cpu >= 0 for *_, wall, cpu in result["calls"])
    assert f"median of {calls}" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["save_call.json"]
    out.unlink()


@pytest.mark.multiprocess
def test_tiny_deletes_benchmark_reports_both_configurations(tmp_path):
  """deletes.py, tiny: a GCS emulator behind the delay proxy, both
  configurations, every save's call and time to durable."""
  script = pathlib.Path(__file__).parent.parent / "benchmarks" / "deletes.py"
  out = tmp_path / "deletes.json"
  proc = subprocess.run(
      [sys.executable, str(script), "--files", "20", "--saves", "3",
       "--every-secs", "0.2", "--delay-ms", "5", "--elements", "64",
       "--json", str(out)], capture_output=True, text=True, timeout=300,
      check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert [r["max_to_keep"] for r in result["results"]] == [None, 2]
  for r in result["results"]:
    assert len(r["save_call_secs"]) == len(r["durable_secs"]) == 3
    assert 0 < r["save_call_median"] <= r["durable_median"]
  assert "max_to_keep=2: save call median" in proc.stdout
