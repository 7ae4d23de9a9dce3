"""Two jobs writing one directory: the newest claim wins, the older job gets
`ConcurrentWriterError` and neither corrupts the other's steps; a read-only
evaluation job disturbs nothing.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import ConcurrentWriterError
from flax_ckpt_plugin.save import writer
from helpers import all_entries as _entries
from helpers import restore_read_only as _restore
from launcher import run_workers

DATA = "data/process_00000.bin"
# One run of real worker processes: jax starts in ~3 s per process on this
# 2-core machine; the rest is a few tiny saves and restores.
RUN_TIMEOUT = 120


def _job_state(seed: int) -> dict[str, Any]:
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.standard_normal((16, 8), dtype=np.float32)),
          "step": seed}


def _job_target() -> dict[str, Any]:
  return {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32), "step": 0}


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.multiprocess
def test_second_job_takes_over_and_the_first_gets_concurrent_writer_error(
    ckpt_dir, assert_trees_equal, host_copy):
  """Job A writes; job B (another process) opens the same directory.

  B's claim wins: `_WRITER` records B. A's next save is not finalized and
  its error (ConcurrentWriterError, naming B's host and pid) comes from A's
  next call; A's retention (max_to_keep=1) deletes nothing of B's, nor its
  own older step. Every finalized step restores bit for bit.
  """
  a = CheckpointManager(ckpt_dir, max_to_keep=1)
  a_claim = json.loads((ckpt_dir / atomicity.WRITER_FILE).read_text())
  assert a_claim["pid"] == os.getpid()
  state_1 = _job_state(1)
  expected_1 = host_copy(state_1)
  a.save(1, state_1)
  a.wait_until_finished()

  (b,) = run_workers("second_writer", 1, args=[ckpt_dir, 2, 7],
                     timeout=RUN_TIMEOUT)
  b_out = b.json
  assert b_out["pid"] != os.getpid()
  assert b_out["all_steps"] == [1, 2]
  claim = json.loads((ckpt_dir / atomicity.WRITER_FILE).read_text())
  assert sorted(claim) == ["host", "opened", "pid", "process_count", "token"]
  assert claim["pid"] == b_out["pid"] and claim["host"] == b_out["host"]
  assert claim["process_count"] == 1
  assert re.fullmatch(r"[0-9a-f]{32}", claim["token"])
  assert claim["token"] != a_claim["token"]

  a.save(3, _job_state(3))  # Returns: the commit fails behind it.
  with pytest.raises(ConcurrentWriterError) as info:
    a.save(4, _job_state(4))  # A's next call.
  message = str(info.value)
  assert f"'pid': {b_out['pid']}" in message, message
  assert f"'host': '{b_out['host']}'" in message, message
  assert "step 3 was not finalized" in message, message
  # A's later saves fail the same way; nothing of A's is finalized after B.
  a.save(5, _job_state(5))
  with pytest.raises(ConcurrentWriterError):
    a.close()
  assert _entries(ckpt_dir) == ["1", "2", "_WRITER"]

  assert_trees_equal(_restore(ckpt_dir, _job_target(), 1), expected_1)
  restored_2 = _restore(ckpt_dir, _job_target(), 2)
  assert np.asarray(restored_2["w"]).tobytes().hex() == b_out["w_hex"]
  assert restored_2["step"] == 2


def test_older_job_never_deletes_after_a_takeover_at_the_worst_moment(
    ckpt_dir, monkeypatch, assert_trees_equal, host_copy):
  """B claims the directory between A's finalize and A's retention.

  Injected fault: A's `AtomicRenamePath.finalize` is wrapped so that, right
  after step 2 is finalized, another job claims the directory (exactly what
  opening a `CheckpointManager` there does first). A's retention
  (max_to_keep=1) would now delete step 1; it must not, and A's close (or
  next deleting save: the delete runs in the background) raises
  ConcurrentWriterError saying so.
  """
  a = CheckpointManager(ckpt_dir, max_to_keep=1)
  states = {1: _job_state(1), 2: _job_state(2)}
  expected = {s: host_copy(t) for s, t in states.items()}
  a.save(1, states[1])
  a.wait_until_finished()
  real_finalize = atomicity.AtomicRenamePath.finalize

  def finalize_then_taken_over(self):
    real_finalize(self)
    if self.step == 2:
      directory_lib.claim_directory(self.final.parent, 1)

  monkeypatch.setattr(atomicity.AtomicRenamePath, "finalize",
                      finalize_then_taken_over)
  a.save(2, states[2])
  a.wait_until_finished()  # The delete, in the background, refused.
  with pytest.raises(ConcurrentWriterError,
                     match=r"steps \[1\] were not deleted"):
    a.close()
  assert _entries(ckpt_dir) == ["1", "2", "_WRITER"]
  for step in (1, 2):
    assert_trees_equal(_restore(ckpt_dir, _job_target(), step),
                       expected[step])


class _Gates:
  """Holds the n-th data write open until `release[n]` is set.

  Injected fault: wraps `writer.write_process_files` so that each write,
  once its data file is written, sets `entered[n]` and waits on `release[n]`
  (n counts writes from 0). Lets a test interleave two saves exactly.
  """

  def __init__(self, monkeypatch, count: int):
    self.entered = [threading.Event() for _ in range(count)]
    self.release = [threading.Event() for _ in range(count)]
    self._next = 0
    self._lock = threading.Lock()
    real_write = writer.write_process_files

    def gated_write(step_dir, leaves, process_index, **kwargs):
      nbytes = real_write(step_dir, leaves, process_index, **kwargs)
      with self._lock:
        n, self._next = self._next, self._next + 1
      if n < count:
        self.entered[n].set()
        if not self.release[n].wait(60):
          raise TimeoutError(f"the test never released gated write {n}")
      return nbytes

    monkeypatch.setattr(writer, "write_process_files", gated_write)

  def release_all(self) -> None:
    for event in self.release:
      event.set()


@pytest.mark.timeout(120)
def test_restart_while_the_old_job_still_runs_keeps_the_new_jobs_save(
    ckpt_dir, monkeypatch, assert_trees_equal, host_copy):
  """A restart while the old job is mid-save, both saving the same step.

  Injected fault: writes are held open (`_Gates`), so that job A is in the
  middle of writing step 2 when job B (its restart, same schedule) opens the
  directory and starts writing its own step 2. A's save then fails with
  ConcurrentWriterError; cleaning up after itself, it must not remove B's
  `2.partial`, and B's step 2 must finalize and restore bit for bit.
  """
  gates = _Gates(monkeypatch, 2)
  try:
    a = CheckpointManager(ckpt_dir, max_to_keep=None)
    a.save(2, _job_state(2))
    assert gates.entered[0].wait(60), "A's write never started"

    b = CheckpointManager(ckpt_dir, max_to_keep=None)  # Claims the dir.
    b_state = _job_state(20)
    expected = host_copy(b_state)
    b.save(2, b_state)
    assert gates.entered[1].wait(60), "B's write never started"

    gates.release[0].set()  # A goes on: its finalize sees B's claim.
    with pytest.raises(ConcurrentWriterError):
      a.close()
    gates.release[1].set()
    b.close()
  finally:
    gates.release_all()
  assert _entries(ckpt_dir) == ["2", "_WRITER"]
  assert_trees_equal(_restore(ckpt_dir, _job_target(), 2), expected)


@pytest.mark.timeout(120)
def test_read_only_manager_never_disturbs_a_save_in_progress(
    ckpt_dir, monkeypatch, assert_trees_equal, host_copy):
  """An evaluation job opens a training directory while a save is running.

  Injected fault: step 2's write is held open once its data file is written
  (`_Gates`: `writer.write_process_files` waits on a threading.Event),
  leaving a `2.partial` on disk. A read-only manager opened then lists only
  step 1, restores it, refuses to save, and neither removes `2.partial` nor
  writes or changes `_WRITER`. Released, the save finalizes.
  """
  fresh = ckpt_dir.parent / "never_opened_for_writing"
  with CheckpointManager(fresh, read_only=True) as reader:
    assert reader.all_steps() == []
  assert not fresh.exists()  # Not even created.

  writer = CheckpointManager(ckpt_dir, max_to_keep=None)
  states = {1: _job_state(1), 2: _job_state(2)}
  expected = {s: host_copy(t) for s, t in states.items()}
  writer.save(1, states[1])
  writer.wait_until_finished()

  gates = _Gates(monkeypatch, 1)
  claim_path = ckpt_dir / atomicity.WRITER_FILE
  try:
    writer.save(2, states[2])
    assert gates.entered[0].wait(60), "step 2's write never started"
    partial = ckpt_dir / ("2" + atomicity.TMP_SUFFIX)
    before = (claim_path.read_bytes(), os.stat(claim_path),
              sorted(str(p.relative_to(ckpt_dir))
                     for p in ckpt_dir.rglob("*")))

    with CheckpointManager(ckpt_dir, read_only=True) as reader:
      assert reader.all_steps() == [1]
      assert_trees_equal(reader.restore(_job_target()), expected[1])
      with pytest.raises(PermissionError, match="read-only"):
        reader.save(3, states[2])

    after = (claim_path.read_bytes(), os.stat(claim_path),
             sorted(str(p.relative_to(ckpt_dir))
                    for p in ckpt_dir.rglob("*")))
    assert after[0] == before[0]
    assert (after[1].st_ino, after[1].st_mtime_ns) == (
        before[1].st_ino, before[1].st_mtime_ns)
    assert after[2] == before[2]
    assert (partial / DATA).is_file()
  finally:
    gates.release_all()
  writer.close()
  assert _entries(ckpt_dir) == ["1", "2", "_WRITER"]
  assert_trees_equal(_restore(ckpt_dir, _job_target(), 2), expected[2])
