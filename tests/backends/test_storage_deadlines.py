"""Storage that stops answering: every read and write has a deadline.

A read or write that does not return within `Storage(io_timeout_secs=)`
raises `StorageTimeoutError` naming the file, the bytes and the step; the
restore fails (or `restore_newest_valid` goes on to the previous step), a
save is not finalized, and the thread stuck in the call is left behind,
never waited for. The storage here is `helpers.HangingDisk`, a fake: no
real mount can be made to stop answering on demand.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StorageTimeoutError
from flax_ckpt_plugin import Storage
from flax_ckpt_plugin.format import files
from helpers import HangingDisk
from launcher import REPO_ROOT

DEADLINE = 1.0


def _state(value: int) -> dict:
  return {"w": np.full((128, 64), value, np.float32),
          "b": np.arange(8, dtype=np.int32) + value,
          "count": np.int64(value)}


def _save_steps(directory, steps=(1, 2)) -> None:
  with CheckpointManager(directory) as manager:
    for step in steps:
      manager.save(step, _state(step))


@pytest.fixture
def hanging():
  """Makes `HangingDisk`s; lets every blocked call return at the end."""
  disks = []

  def make(**kwargs) -> HangingDisk:
    disks.append(HangingDisk(**kwargs))
    return disks[-1]

  yield make
  for disk in disks:
    disk.unblock.set()


def test_a_read_that_never_returns_raises_naming_the_file(ckpt_dir, hanging):
  _save_steps(ckpt_dir)
  disk = hanging(reads=r"/2/")
  with CheckpointManager(ckpt_dir, read_only=True, storage=Storage(
      backend=disk, io_timeout_secs=DEADLINE)) as manager:
    t0 = time.monotonic()
    with pytest.raises(StorageTimeoutError) as e:
      manager.restore(_state(0), step=2)
    secs = time.monotonic() - t0
    assert disk.hung.is_set()
    assert secs < DEADLINE + 5
    message = str(e.value)
    assert str(ckpt_dir / "2" / files.data_file(0)) in message
    assert "reading bytes [" in message and "step 2" in message
    assert isinstance(e.value, TimeoutError)
    # Step 1's files answer: the same manager restores it.
    restored = manager.restore(_state(0), step=1)
  np.testing.assert_array_equal(restored["w"], _state(1)["w"])


def test_restore_newest_valid_goes_on_to_the_previous_step(ckpt_dir,
                                                            hanging):
  _save_steps(ckpt_dir)
  disk = hanging(reads=r"/2/")
  with CheckpointManager(ckpt_dir, read_only=True, storage=Storage(
      backend=disk, io_timeout_secs=DEADLINE)) as manager:
    t0 = time.monotonic()
    step, restored = manager.restore_newest_valid(_state(0))
    assert time.monotonic() - t0 < DEADLINE + 5
    assert step == 1
    for key in ("w", "b"):
      np.testing.assert_array_equal(restored[key], _state(1)[key])
    assert restored["count"] == 1 and isinstance(restored["count"], np.int64)
    # Not answered is not damaged: step 2 is kept, not set aside.
    assert manager.all_steps() == [1, 2]


def _commit_threads() -> list[threading.Thread]:
  return [t for t in threading.enumerate()
          if t.name.startswith("flax_ckpt_plugin-commit")]


def _let_the_stuck_commit_end(disk: HangingDisk) -> None:
  """Lets the blocked call return and waits for the given-up commit's
  thread to end."""
  stuck = _commit_threads()
  disk.unblock.set()
  for thread in stuck:
    thread.join(30)
    assert not thread.is_alive()


def test_a_write_that_never_returns_fails_the_save_at_the_next_call(
    ckpt_dir, hanging):
  disk = hanging(syncs=r"^data/")  # The data file's fsync never returns.
  manager = CheckpointManager(ckpt_dir, storage=Storage(
      backend=disk, io_timeout_secs=DEADLINE))
  try:
    manager.save(1, _state(1))  # Returns: the commit runs behind.
    assert disk.hung.wait(60)
    t0 = time.monotonic()
    with pytest.raises(StorageTimeoutError) as e:
      manager.save(2, _state(2))
    assert time.monotonic() - t0 < DEADLINE + 5
    message = str(e.value)
    assert f"syncing data file {ckpt_dir}" in message
    assert files.data_file(0) in message and "step 1" in message
    assert "its step was not finalized" in "".join(e.value.__notes__)
    # The stuck call returns at last: its commit must still never finalize.
    _let_the_stuck_commit_end(disk)
    assert manager.all_steps() == []
    assert not (ckpt_dir / "1").exists()
    # The manager goes on: the next save commits.
    disk.syncs = None
    manager.save(2, _state(2))
    manager.wait_until_finished()
    assert manager.all_steps() == [2]
  finally:
    disk.unblock.set()
    manager.close()
  restored = CheckpointManager(ckpt_dir, read_only=True).restore(_state(0))
  np.testing.assert_array_equal(restored["w"], _state(2)["w"])


def test_a_hung_write_is_reported_by_wait_until_finished(ckpt_dir, hanging):
  disk = hanging(syncs=r"^data/")
  with CheckpointManager(ckpt_dir, storage=Storage(
      backend=disk, io_timeout_secs=DEADLINE)) as manager:
    manager.save(1, _state(1))
    assert disk.hung.wait(60)
    t0 = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="syncing data file"):
      manager.wait_until_finished()
    assert time.monotonic() - t0 < DEADLINE + 5
    assert manager.all_steps() == []


_EXITS = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import numpy as np
    from flax_ckpt_plugin import CheckpointManager, Storage
    from flax_ckpt_plugin import StorageTimeoutError
    from helpers import HangingDisk
    directory = {directory!r}
    with CheckpointManager(directory) as manager:
      manager.save(1, {{"w": np.ones((64, 64), np.float32)}})
    if {write!r}:
      disk = HangingDisk(syncs=r"^data/")
      manager = CheckpointManager(directory, storage=Storage(
          backend=disk, io_timeout_secs=1.0))
      manager.save(2, {{"w": np.zeros((64, 64), np.float32)}})
      disk.hung.wait(60)
      print("returning without close", flush=True)  # Its exit waits.
    else:
      disk = HangingDisk(reads="/1/")
      manager = CheckpointManager(directory, read_only=True, storage=Storage(
          backend=disk, io_timeout_secs=1.0))
      try:
        manager.restore({{"w": np.zeros((64, 64), np.float32)}})
      except StorageTimeoutError as e:
        print("timed out:", e, flush=True)
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("write", [False, True])
def test_a_process_with_a_stuck_call_still_exits(tmp_path, write):
  """The stuck thread is a daemon that nothing joins: a process whose read
  timed out exits at once; one that returns while its commit is stuck
  exits once the deadline passed, with status 1 and the error."""
  code = _EXITS.format(tests=str(REPO_ROOT / "tests"),
                       directory=str(tmp_path / "ckpt"), write=write)
  t0 = time.monotonic()
  run = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120, cwd=REPO_ROOT)
  secs = time.monotonic() - t0
  if write:
    assert run.returncode == 1, run.stderr
    assert "syncing data file" in run.stderr and "step 2" in run.stderr
  else:
    assert run.returncode == 0, run.stderr
    assert "timed out: reading bytes [" in run.stdout
  assert secs < 60, (secs, run.stderr)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_hung_read_on_one_of_two_processes_ends_both(tmp_path):
  """`restore_together` on 2 processes whose second one never gets an
  answer from storage: both end with an error within the deadline plus the
  barrier timeout; the stuck one's names the file."""
  from launcher import run_workers  # pylint: disable=g-import-not-at-top
  deadline, barrier = 2.0, 10.0
  results = run_workers("hung_read", 2, args=[
      tmp_path / "ckpt", "1", str(deadline), str(barrier), "together"],
                        timeout=150)
  stuck, other = results[1].json, results[0].json
  assert stuck["hung"], stuck
  assert stuck["error"]["type"] == "StorageTimeoutError", stuck
  assert "reading bytes [" in stuck["error"]["message"], stuck
  assert str(tmp_path / "ckpt" / "1") in stuck["error"]["message"], stuck
  # Told at once that the step cannot be read there (`restore_newest_valid`
  # then skips it on every process, and keeps it).
  assert other["error"]["type"] == "Unsuitable", other
  assert "StorageTimeoutError" in other["error"]["message"], other
  for r in (stuck, other):
    assert r["secs"] < deadline + barrier + 5, r


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_restore_newest_valid_on_two_processes_skips_the_unanswered_step(
    tmp_path):
  """The same with `restore_newest_valid`: the newest step, unanswered on
  one process, is skipped on both, and both restore the one before."""
  from launcher import run_workers  # pylint: disable=g-import-not-at-top
  deadline, barrier = 2.0, 10.0
  results = run_workers("hung_read", 2, args=[
      tmp_path / "ckpt", "1", str(deadline), str(barrier), "newest"],
                        timeout=150)
  for r in results:
    o = r.json
    assert "error" not in o, o
    assert o["step"] == 1 and o["a0"] == 1.0, o
    assert o["secs"] < deadline + barrier + 5, o
  assert results[1].json["hung"]


def test_a_hung_read_of_a_large_shard_split_over_the_read_threads(
    ckpt_dir, hanging):
  """A shard of 48 MB is read by several threads at once; their reads
  never return: the restore raises in time, and the read threads that
  took their places serve the next restore."""
  big = {"w": np.arange(12 << 20, dtype=np.float32)}  # 48 MiB.
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, big)
    manager.save(2, {"w": big["w"] + 1})
  disk = hanging(reads=r"/2/")
  with CheckpointManager(ckpt_dir, read_only=True, storage=Storage(
      backend=disk, io_timeout_secs=DEADLINE)) as manager:
    t0 = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="reading bytes"):
      manager.restore({"w": np.zeros_like(big["w"])}, step=2)
    assert time.monotonic() - t0 < DEADLINE + 5
    restored = manager.restore({"w": np.zeros_like(big["w"])}, step=1)
  np.testing.assert_array_equal(restored["w"], big["w"])


def test_a_mapping_whose_pages_never_come(ckpt_dir, hanging):
  """A local disk maps what it restores; a mount that never serves the
  pages: the restore raises naming the mapped bytes."""
  _save_steps(ckpt_dir)
  disk = hanging(reads=r"/2/", maps=True)
  with CheckpointManager(ckpt_dir, read_only=True, storage=Storage(
      backend=disk, io_timeout_secs=DEADLINE)) as manager:
    t0 = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="bytes"):
      manager.restore(_state(0), step=2)
    assert time.monotonic() - t0 < DEADLINE + 5
    assert disk.hung.is_set()


class _StuckFinalize(HangingDisk):
  """A disk whose sync of the checkpoint directory, after the step's
  rename, never returns (a fake, as `HangingDisk`)."""

  def __init__(self, directory):
    super().__init__()
    self.directory = directory
    self.armed = False  # (The manager's open syncs it too.)

  def fsync(self, path):
    if self.armed and str(path) == str(self.directory):
      self.block()
    super().fsync(path)


def test_a_commit_stuck_in_its_finalization_is_told_and_left_alone(ckpt_dir):
  """The rename went through, its directory's sync never returns: the
  error says the step may be visible; once the call returns, the given-up
  commit runs no hook and records nothing, and the next open lists the
  step (it is whole)."""
  ckpt_dir.mkdir()
  disk = _StuckFinalize(ckpt_dir)
  hooked = []
  manager = CheckpointManager(ckpt_dir, storage=Storage(
      backend=disk, io_timeout_secs=DEADLINE),
                              hooks=[lambda stats: hooked.append(stats.step)])
  try:
    disk.armed = True
    manager.save(1, _state(1))
    assert disk.hung.wait(60)
    with pytest.raises(StorageTimeoutError, match="finalizing") as e:
      manager.wait_until_finished()
    assert "may have made the step visible" in "".join(e.value.__notes__)
    _let_the_stuck_commit_end(disk)
    assert hooked == [] and manager.all_steps() == []
    assert manager.last_save_stats is None
  finally:
    disk.unblock.set()
    manager.close()
  with CheckpointManager(ckpt_dir, read_only=True) as reader:
    assert reader.all_steps() == [1]
    np.testing.assert_array_equal(reader.restore(_state(0))["w"],
                                  _state(1)["w"])
