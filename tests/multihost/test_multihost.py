"""Multi-process checkpointing with real JAX processes on 127.0.0.1.

Every test starts 2 processes with 2 CPU devices each (a 4-device mesh that
spans both), through `launcher.run_workers`; the workers live in
`tests/mp_workers/` and print their results as JSON. Each run has a deadline:
a hung worker fails the test with every worker's output instead of blocking.
"""

from __future__ import annotations

import os
import re

import pytest

from helpers import assert_only_finalized_steps
from helpers import sorted_entries
from launcher import WorkerGroup
from launcher import run_workers

pytestmark = pytest.mark.multiprocess

# Deadlines for one run of the workers: jax starts in ~3 s per process on
# this 2-core machine; the rest is training, saving and restoring tiny states.
RUN_TIMEOUT = 120


_HANG_ON_PROCESS_1 = """
import os, time
print("alive: process", os.environ["PROCESS_ID"], flush=True)
if os.environ["PROCESS_ID"] == "1":
  time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_launcher_kills_hung_workers_and_fails_with_every_log():
  """The launcher's own contract: a hang fails the test, it never blocks."""
  with WorkerGroup(_HANG_ON_PROCESS_1, 2) as group:
    hung_pid = group.pid(1)
    with pytest.raises(pytest.fail.Exception) as info:
      group.wait(timeout=3)
  message = str(info.value)
  assert "workers [1] still running after 3s" in message
  assert "alive: process 0" in message and "alive: process 1" in message
  with pytest.raises(ProcessLookupError):
    os.kill(hung_pid, 0)  # Killed and reaped.

  # A worker that exits non-zero fails the test too, with its peers' logs.
  exits_3 = _HANG_ON_PROCESS_1.replace("time.sleep(600)", "raise SystemExit(3)")
  with pytest.raises(pytest.fail.Exception) as info:
    run_workers(exits_3, 2, timeout=30)
  message = str(info.value)
  assert "workers [1] exited non-zero" in message
  assert "returncode 3" in message and "alive: process 0" in message


@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
def test_sharded_train_state_saved_and_restored_bit_exact(tmp_path):
  """A TrainState sharded across 2 processes survives save and restore.

  Saved through `CheckpointCallback` during training (a jitted step that
  donates its input), then restored (i) by the same processes into an
  abstract target with shardings, and (ii) by a fresh pair of processes, also
  into a partitioning the writer never used. Values are compared by sha256 of
  each leaf's full global array.
  """
  ckpt = tmp_path / "ckpt"
  saving = [r.json for r in run_workers(
      "save_restore", 2, args=["save", ckpt], timeout=RUN_TIMEOUT)]

  # Both processes see the same global values.
  assert saving[0]["saved"] == saving[1]["saved"]
  saved = saving[0]["saved"]
  assert sorted(saved, key=int) == ["2", "4", "6"]
  # Training changed every parameter, so equal digests below mean something.
  for leaf, digest in saved["4"].items():
    if leaf.startswith(".params"):
      assert saved["6"][leaf] != digest, leaf
  latest = saved["6"]

  # (i) Restored in the same processes, on the target's shardings.
  for p, out in enumerate(saving):
    assert out["all_steps"] == [4, 6], p  # max_to_keep=2 pruned step 2.
    assert out["restored_type"] == "TrainState", p
    assert out["restored_on_target_shardings"], p
    assert out["restored"] == latest, p

  # On disk: only finalized steps; one data file per process, whose sizes
  # add up to every global array's bytes exactly once (replicated leaves are
  # written by one process only).
  assert_only_finalized_steps(ckpt, [4, 6])
  total = saving[0]["total_array_bytes"]
  for step in (4, 6):
    data = ckpt / str(step) / "data"
    assert sorted_entries(data) == ["process_00000.bin", "process_00001.bin"]
    sizes = [(data / f"process_{p:05d}.bin").stat().st_size for p in (0, 1)]
    assert sizes == [saving[0]["owned_bytes"], saving[1]["owned_bytes"]]
    assert all(sizes), sizes  # Both processes own shards of this state.
    assert sum(sizes) == total

  # (ii) Restored by a fresh pair of processes.
  fresh = [r.json for r in run_workers(
      "save_restore", 2, args=["restore", ckpt], timeout=RUN_TIMEOUT)]
  for p, out in enumerate(fresh):
    assert out["restored_step"] == 6, p
    assert out["is_train_state"], (p, out["restored_type"])
    assert out["restored_on_target_shardings"], p
    assert out["restored"] == latest, p
    assert out["alt_on_target_shardings"], p
    assert out["alt_restored"] == latest, p
    assert out["step_after_training"] == 7, p
  assert_only_finalized_steps(ckpt, [4, 6])


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("primary_kv_latency_secs", [0.0, 0.5],
                         ids=["fast_coordinator", "slow_coordinator_reads"])
def test_write_failure_on_one_process_fails_the_save_everywhere(
    tmp_path, primary_kv_latency_secs):
  """A background write error on process 1 reaches both processes promptly.

  Injected faults: process 1's `writer.write_process_files` raises OSError
  (ENOSPC) for step 4 (a full disk cannot be produced on demand); in the
  `slow_coordinator_reads` case, process 0's key-value reads from the
  coordination service also answer 0.5 s late (a local coordinator is never
  slow), which changes only the order in which the processes see each
  other's progress.
  """
  ckpt = tmp_path / "ckpt"
  results = run_workers(
      "write_failure", 2, args=[ckpt], timeout=RUN_TIMEOUT,
      process_env={0: {"KV_LATENCY_SECS": str(primary_kv_latency_secs)},
                   1: {"FAIL_AT_STEP": "4"}})
  p0, p1 = (r.json for r in results)
  logs = "\n" + "\n".join(r.log() for r in results)

  # Each gets an exception from its next call into the library: the failing
  # process its own OSError, the other a SaveFailedError naming the cause.
  assert p1["error"] is not None, logs
  assert p1["error"]["type"] == "OSError", f"{p1['error']}{logs}"
  assert "injected by the test" in p1["error"]["message"]
  assert p0["error"] is not None, logs
  assert p0["error"]["type"] == "SaveFailedError", f"{p0['error']}{logs}"
  assert "RuntimeError" in p0["error"]["mro"]
  assert "step 4" in p0["error"]["message"]
  assert "No space left on device" in p0["error"]["message"]
  for p, out in enumerate((p0, p1)):
    notes = " ".join(out["error"]["notes"])
    assert "ASYNCHRONOUSLY" in notes and "step 4" in notes, (p, notes)
    # Promptly: not by waiting out a barrier.
    assert out["error_secs"] < out["barrier_timeout_secs"] / 4, f"{p}{logs}"
    # The previous step is still the newest, and it restores bit for bit.
    assert out["latest_step"] == 2, p
    assert out["all_steps"] == [2], p
    assert out["restored_digests"] == out["saved_digests"]["2"], p

  # Step 4 was never finalized and nothing of it is left.
  assert_only_finalized_steps(ckpt, [2])


EVERY_SECS = 3.5  # As in mp_workers/every_secs.py.
NUM_STEPS = 12
CLOCK_RATES = {0: 1.0, 1: 0.5}  # Fake seconds per step, per process.


def _saves_by_own_clock(rate: float) -> list[int]:
  """The steps one process would save at if it decided alone.

  Mirrors the callback's rule: save when `every_secs` passed since the last
  save (or since the callback was made, at fake time 0).
  """
  last, steps = 0.0, []
  for step in range(1, NUM_STEPS + 1):
    if rate * step - last >= EVERY_SECS:
      steps.append(step)
      last = rate * step
  return steps


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_every_secs_is_decided_by_the_primary_host(tmp_path):
  """Processes whose clocks disagree still save at the same steps.

  The clock is injected per process (`triggers.monotonic`): process 1's runs at half the
  speed of process 0's, so on its own it would save at other steps.
  """
  primary_steps = _saves_by_own_clock(CLOCK_RATES[0])
  alone_steps = _saves_by_own_clock(CLOCK_RATES[1])
  assert primary_steps == [4, 8, 12]
  assert alone_steps == [7]  # Process 1 alone would disagree both ways.

  ckpt = tmp_path / "ckpt"
  p0, p1 = (r.json for r in run_workers(
      "every_secs", 2, args=[ckpt], timeout=RUN_TIMEOUT,
      process_env={p: {"CLOCK_RATE": str(rate)}
                   for p, rate in CLOCK_RATES.items()}))
  assert p0["saved"] == p1["saved"] == primary_steps
  assert p0["all_steps"] == p1["all_steps"] == primary_steps
  assert_only_finalized_steps(ckpt, primary_steps)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_barrier_timeout_names_the_barrier_key(tmp_path):
  """A process that never calls `save` makes the other's save time out.

  Process 0 saves with `barrier_timeout_secs=2`; process 1 opens the same
  manager but never saves, and waits (up to 60 s) for process 0 to report
  before closing, so it is alive but absent.
  """
  ckpt = tmp_path / "ckpt"
  p0, p1 = (r.json for r in run_workers(
      "barrier_timeout", 2, args=[ckpt], timeout=RUN_TIMEOUT))
  assert "error" not in p1
  error = p0["error"]
  assert error is not None and error["is_timeout"], error
  match = re.search(r"barrier '([^']+)'", error["message"])
  assert match, error["message"]
  key = match.group(1)
  # The key carries the manager's prefix and the step being saved.
  assert key.startswith(p0["manager_name"] + "/"), key
  assert "step1" in key, key
  # Raised once the timeout passed, not long after.
  timeout = p0["barrier_timeout_secs"]
  assert 0.9 * timeout <= p0["error_secs"] < timeout + 5, p0["error_secs"]
  # The step was never finalized, and the primary host removed what it began.
  assert p0["all_steps"] == []
  assert sorted_entries(ckpt) == []


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_commit_hooks_run_on_the_primary_and_their_errors_reach_everyone(
    tmp_path):
  ckpt = tmp_path / "ckpt"
  p0, p1 = (r.json for r in run_workers("commit_hooks", 2, args=[ckpt],
                                        timeout=RUN_TIMEOUT))
  assert p0["is_primary"] and not p1["is_primary"]
  assert p1["calls"] == []  # Only the primary runs hooks.
  assert [c["step"] for c in p0["calls"]] == [1, 2]
  for call in p0["calls"]:  # A hook sees a finalized, complete step.
    assert call["marker"] and call["path"] == str(ckpt / str(call["step"]))
    assert call["total_bytes"] == p0["state_bytes"]
  for result in (p0, p1):
    assert "commit hook" in result["error"] and "step 2" in result["error"]
    assert "evaluation launcher is down" in result["error"]
    assert result["all_steps"] == [1, 2]  # The step itself is durable.
    assert result["all_steps_after"] == [1, 2, 3]
  assert p0["calls_after"] == [1, 2, 3] and p1["calls_after"] == []
  assert_only_finalized_steps(ckpt, [1, 2, 3])


@pytest.fixture(scope="module")
def one_sided_run(tmp_path_factory):
  """Two saves, each by a new manager whose commit hook (on the primary host
  alone) opens a read-only manager of the same directory."""
  directory = tmp_path_factory.mktemp("one_sided")
  out = [r.json for r in run_workers(
      "lifecycle", 2, args=["one_sided", directory], timeout=RUN_TIMEOUT)]
  return directory, out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_manager_opened_on_one_process_only_breaks_no_later_save(
    one_sided_run):
  """Barrier names do not count the managers each process opened: a
  read-only manager opened in a commit hook (on the primary host alone)
  leaves the next manager's barriers the same on both processes, and its
  save does not time out."""
  directory, (p0, p1) = one_sided_run
  assert p0["all_steps"] == p1["all_steps"] == [1, 2]
  assert (p0["hook_saw"], p1["hook_saw"]) == ([1, 2], [])
  assert_only_finalized_steps(directory / "run", [1, 2])


@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
def test_any_restore_error_on_one_process_reaches_the_other_at_once(
    one_sided_run):
  """The restore fallback votes on every error, not only on damage: a
  permission error on process 1 makes both processes raise at once,
  rather than leaving process 0 at the vote for the whole barrier timeout,
  and the good steps stay."""
  directory, _ = one_sided_run
  p0, p1 = (r.json for r in run_workers(
      "lifecycle", 2, args=["restore_error", directory], timeout=RUN_TIMEOUT))
  assert p1["error"].startswith("PermissionError")
  assert p0["error"].startswith("RestoreFailedError")
  assert "process 1: PermissionError" in p0["error"]
  for o in (p0, p1):
    assert o["secs"] < o["barrier_timeout_secs"] / 3, o
    # Not set aside as damaged.
    assert o["steps_left"] == ["1", "2", "_WRITER"]


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_every_secs_does_not_make_a_blocking_call_at_every_step(tmp_path):
  """A non-primary process reads the primary's decision at a few steps per
  interval, not with a blocking call to the coordination service at every
  one of the 200 steps (saves still at the same steps)."""
  p0, p1 = (r.json for r in run_workers(
      "lifecycle", 2, args=["every_secs_calls", tmp_path],
      timeout=RUN_TIMEOUT))
  assert p0["saved"] == p1["saved"] == [50, 100, 150, 200]
  # Saves read a few keys of their own (identity, writer token).
  assert p1["blocking_gets"] < 200 / 4, p1


@pytest.mark.timeout(RUN_TIMEOUT * 2)
def test_restore_together_reads_a_replicated_state_once(tmp_path):
  """2 processes hold the same state (split within each, replicated across
  them). `restore` on each reads all of it, 2x in all, and says once that
  `restore_together` would not; `restore_together` with no step restores
  the newest step and reads it once in all."""
  results = run_workers("restore_reads", 2, args=[tmp_path / "ckpt"],
                        timeout=RUN_TIMEOUT)
  out = [r.json for r in results]
  total = out[0]["total"]
  assert [o["same"] for o in out] == [True, True], [r.log() for r in results]
  assert [o["alone_step"] for o in out] == [2, 2]
  assert [o["together_step"] for o in out] == [2, 2]
  assert sum(o["alone"] for o in out) == 2 * total, out
  # `b` (256 bytes) is under read_plan.MIN_SHARED_BYTES: cheaper to read
  # on each process than to share; `w` is read once in all.
  assert sum(o["together"] for o in out) == total + 256, out
  for o in out:  # Once per manager, though restore ran twice.
    assert len(o["hints"]) == 1, o["hints"]
    assert "restore() on each process reads all of them" in o["hints"][0]
