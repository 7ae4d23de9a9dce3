"""Retention's deletes run off the save's path (`manager.deletions`).

What a user sees: a save that neither waits for the deletes of the
previous save nor finalizes later because of them; deletes in order, one
step after the other; `wait_for_deletes` bounding what is on disk; `close`
waiting for the deletes (or, when leaving, not starting more); a failed
delete logged at once and raised later, naming the steps; a step number
saved again while its old files are being deleted.

A slow store is injected by a backend whose `delete_step` waits for the
test to open a gate (a real disk deletes a small step too fast to watch
a save go on meanwhile); it records what it does, in order.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import Retention
from flax_ckpt_plugin import Storage
from flax_ckpt_plugin.backends import registry as backend_lib

GATE_TIMEOUT = 30.0  # Never waited out when things work.


class GatedDeletes(backend_lib.LocalBackend):
  """A local disk whose background deletes wait for `gate` (a slow store,
  injected) and whose events are recorded in `events`. Deletes on other
  threads (`discard`) go through at once."""

  def __init__(self, *, gate_open: bool = False, fail: bool = False):
    super().__init__()
    self.gate = threading.Event()
    if gate_open:
      self.gate.set()
    self.fail = fail
    self.events: list[tuple[str, int]] = []
    self.deleting = threading.Event()  # Set once a delete waits at the gate.

  def delete_step(self, directory, step):
    if not threading.current_thread().name.startswith(
        "flax_ckpt_plugin-delete-"):
      return super().delete_step(directory, step)
    self.events.append(("delete", step))
    self.deleting.set()
    assert self.gate.wait(GATE_TIMEOUT), "the test never opened the gate"
    if self.fail:
      raise PermissionError(f"cannot delete step {step} (injected)")
    super().delete_step(directory, step)
    self.events.append(("deleted", step))

  def step_writer(self, step_dir, identity, data_dir):
    self.events.append(("write", int(step_dir.name.split(".")[0])))
    return super().step_writer(step_dir, identity, data_dir)


def _state(step: int) -> dict:
  return {"w": np.full(4, step, np.float32)}


def _entries(directory) -> list[str]:
  return sorted(os.listdir(directory))


def _finalized_hook():
  """A commit hook, and a dict of an event per step, set once it is final."""
  final: dict[int, threading.Event] = {}

  def hook(stats):
    final.setdefault(stats.step, threading.Event()).set()

  def wait(step):
    assert final.setdefault(step, threading.Event()).wait(GATE_TIMEOUT)

  return hook, wait


def test_a_save_finalizes_while_the_previous_deletes_are_still_running(
    tmp_path):
  backend = GatedDeletes()
  hook, wait_final = _finalized_hook()
  mgr = CheckpointManager(tmp_path, max_to_keep=1, hooks=[hook],
                          storage=Storage(backend=backend))
  mgr.save(1, _state(1))
  mgr.save(2, _state(2))  # Its retention queues the delete of step 1.
  assert backend.deleting.wait(GATE_TIMEOUT)
  mgr.save(3, _state(3))  # Does not wait for that delete...
  wait_final(3)  # ...and neither does its commit.
  assert not backend.gate.is_set()
  assert mgr.all_steps() == [3]
  # Still at the delete of step 1, which began before step 3 was written.
  assert backend.events[-2:] == [("delete", 1), ("write", 3)]
  backend.gate.set()
  mgr.close()  # Waits for the deletes of steps 1 and 2.
  assert backend.events == [("write", 1), ("write", 2), ("delete", 1),
                            ("write", 3), ("deleted", 1), ("delete", 2),
                            ("deleted", 2)]
  assert _entries(tmp_path) == ["3", "_WRITER"]
  with CheckpointManager(tmp_path, read_only=True) as reader:
    restored = reader.restore(_state(0))
  np.testing.assert_array_equal(restored["w"], _state(3)["w"])


def test_deletes_go_in_order_one_step_after_another(tmp_path):
  backend = GatedDeletes(gate_open=True)
  with CheckpointManager(tmp_path, max_to_keep=2,
                         storage=Storage(backend=backend)) as mgr:
    for step in range(1, 8):
      mgr.save(step, _state(step))
  deletes = [e for e in backend.events if e[0] != "write"]
  # Each step's delete ends before the next begins, oldest first.
  assert deletes == [(kind, s) for s in range(1, 6)
                     for kind in ("delete", "deleted")]
  assert _entries(tmp_path) == ["6", "7", "_WRITER"]


def test_wait_for_deletes_bounds_the_steps_on_disk(tmp_path):
  backend = GatedDeletes()
  on_disk = []

  def count_steps(stats):  # Once each step is final, before retention.
    on_disk.append((stats.step, sorted(
        n for n in os.listdir(tmp_path) if n[0].isdigit())))

  with CheckpointManager(
      tmp_path, retention=Retention(max_to_keep=1, wait_for_deletes=True),
      storage=Storage(backend=backend), hooks=[count_steps]) as mgr:
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))  # Queues the delete of step 1 (at the gate).
    assert backend.deleting.wait(GATE_TIMEOUT)
    opener = threading.Timer(0.3, backend.gate.set)  # While step 3 waits.
    opener.start()
    for step in range(3, 6):
      mgr.save(step, _state(step))
  opener.join()
  # The kept step and the one just written: never more.
  assert on_disk == [(1, ["1"]), (2, ["1", "2"]), (3, ["2", "3"]),
                     (4, ["3", "4"]), (5, ["4", "5"])]
  for step in range(1, 4):  # Each delete done before the next step writes.
    events = backend.events
    assert events.index(("deleted", step)) < events.index(("write", step + 2))


def test_close_waits_for_the_deletes(tmp_path):
  backend = GatedDeletes()
  mgr = CheckpointManager(tmp_path, max_to_keep=1,
                          storage=Storage(backend=backend))
  mgr.save(1, _state(1))
  mgr.save(2, _state(2))
  assert backend.deleting.wait(GATE_TIMEOUT)
  opener = threading.Timer(0.3, backend.gate.set)  # While close waits.
  opener.start()
  mgr.close()
  opener.join()
  assert _entries(tmp_path) == ["2", "_WRITER"]


def test_close_when_leaving_starts_no_more_deletes(tmp_path):
  backend = GatedDeletes()
  hook, wait_final = _finalized_hook()
  mgr = CheckpointManager(tmp_path, max_to_keep=1, hooks=[hook],
                          storage=Storage(backend=backend))
  for step in (1, 2, 3):  # Deletes of 1 (at the gate), then of 2, queued.
    mgr.save(step, _state(step))
    wait_final(step)
  assert backend.deleting.wait(GATE_TIMEOUT)
  opener = threading.Timer(0.3, backend.gate.set)
  opener.start()
  mgr.close(leaving=True)  # A preempted machine: step 2 stays, whole.
  opener.join()
  assert _entries(tmp_path) == ["2", "3", "_WRITER"]
  with CheckpointManager(tmp_path, max_to_keep=1) as mgr:
    assert mgr.all_steps() == [2, 3]  # A later retention deletes it.
    mgr.save(4, _state(4))
  assert _entries(tmp_path) == ["4", "_WRITER"]


def test_a_failed_delete_is_logged_at_once_and_raised_by_close(
    tmp_path, caplog):
  backend = GatedDeletes(gate_open=True, fail=True)
  mgr = CheckpointManager(tmp_path, max_to_keep=1,
                          storage=Storage(backend=backend))
  with caplog.at_level(logging.ERROR, logger="flax_ckpt_plugin"):
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert mgr.wait_until_finished()  # The delete's error waits for close.
    assert "retention after step 2 failed to delete steps [1]" in caplog.text
    with pytest.raises(PermissionError, match="cannot delete step 1") as info:
      mgr.close()
  assert (f"Retention after step 2 could not delete steps [1] of {tmp_path}"
          in " ".join(info.value.__notes__))
  assert _entries(tmp_path) == ["1", "2", "_WRITER"]
  with CheckpointManager(tmp_path, max_to_keep=1) as again:
    assert again.all_steps() == [1, 2]  # Step 1 is whole: listed again.


def test_a_step_saved_again_waits_for_the_delete_of_its_old_files(tmp_path):
  backend = GatedDeletes()
  mgr = CheckpointManager(tmp_path, max_to_keep=1,
                          storage=Storage(backend=backend))
  mgr.save(1, _state(1))
  mgr.save(2, _state(2))  # Queues the delete of step 1 (at the gate).
  assert backend.deleting.wait(GATE_TIMEOUT)
  backend.gate.set()
  mgr.wait_until_finished()
  backend.gate.clear()
  backend.deleting.clear()
  mgr.discard([2])  # (Synchronous: step 2 is gone at once.)
  mgr.save(3, _state(3))
  mgr.save(4, _state(4))  # Queues the delete of step 3 (at the gate)...
  assert backend.deleting.wait(GATE_TIMEOUT)  # ...once 4 is final.
  mgr.discard([4])
  opener = threading.Timer(0.3, backend.gate.set)
  opener.start()
  mgr.save(3, {"w": np.full(4, 33, np.float32)})  # Waits for that delete.
  mgr.close()
  opener.join()
  assert _entries(tmp_path) == ["3", "_WRITER"]
  with CheckpointManager(tmp_path, read_only=True) as reader:
    restored = reader.restore(_state(0), 3)
  np.testing.assert_array_equal(restored["w"], np.full(4, 33, np.float32))


def test_a_file_system_in_memory_deletes_before_the_next_save(tmp_path):
  """The local tier's backend hands a deleted step's data file to the next
  save's snapshot: its deletes run in the commit, not in the background."""
  threads = []

  class Recorded(backend_lib.MemoryBackend):

    def delete_step(self, directory, step):
      threads.append(threading.current_thread().name)
      super().delete_step(directory, step)

  with CheckpointManager(tmp_path, max_to_keep=1,
                         storage=Storage(backend=Recorded())) as mgr:
    for step in (1, 2, 3):
      mgr.save(step, _state(step))
  assert len(threads) == 2
  assert all(t.startswith("flax_ckpt_plugin-commit-") for t in threads)
  assert _entries(tmp_path) == ["3", "_WRITER", "_spare.bin"]


class PartedDeletes(backend_lib.LocalBackend):
  """A store that deletes a step in parts (as object stores do, 100 objects
  a request), recording each part and each step write in order. After its
  first part, step 1's delete waits for `parts` (a slow request,
  injected); step 3's write waits for `writing` (a slow upload), so that
  the test sees which parts run while step 3 commits."""

  def __init__(self):
    super().__init__()
    self.events: list[tuple[str, int]] = []
    self.parts, self.writing = threading.Event(), threading.Event()
    self.write_started, self.second_part = (threading.Event(),
                                            threading.Event())

  def delete_step_in_parts(self, directory, step):
    for part in range(3):
      self.events.append((f"part {part}", step))
      if part == 0:
        super().delete_step(directory, step)
        if step == 1:
          assert self.parts.wait(GATE_TIMEOUT), "the test never let it go on"
      if part == 1:
        self.second_part.set()
      yield

  def step_writer(self, step_dir, identity, data_dir):
    step = int(step_dir.name.split(".")[0])
    if step == 3:
      self.write_started.set()
      assert self.writing.wait(GATE_TIMEOUT), "the test never let it write"
    self.events.append(("write", step))
    return super().step_writer(step_dir, identity, data_dir)


def test_deletes_hold_off_between_parts_while_a_save_commits(tmp_path):
  """The save's own requests go first: a delete under way when a save
  begins sends no further part until that save is final."""
  backend = PartedDeletes()
  hook, wait_final = _finalized_hook()
  with CheckpointManager(tmp_path, max_to_keep=1, hooks=[hook],
                         storage=Storage(backend=backend)) as mgr:
    mgr.save(1, _state(1))
    mgr.wait_until_finished()
    mgr.save(2, _state(2))  # Its retention queues the delete of step 1.
    wait_final(2)
    mgr.save(3, _state(3))
    assert backend.write_started.wait(GATE_TIMEOUT)
    backend.parts.set()  # Step 1's first part is done: the next may go...
    # ...but not while step 3 commits. (Bounded: a wrong library would
    # send it within milliseconds.)
    assert not backend.second_part.wait(1.0)
    backend.writing.set()
    wait_final(3)
  parts = [e for e in backend.events if e[0].startswith("part")]
  assert parts == [(f"part {p}", s) for s in (1, 2) for p in range(3)]
  written = backend.events.index(("write", 3))
  assert backend.events.index(("part 1", 1)) > written
  assert _entries(tmp_path) == ["3", "_WRITER"]


class HangingDeletes(backend_lib.LocalBackend):
  """A store whose delete of a step never answers after taking it out of
  the list (a request that stalls, injected), until `unblock` is set."""

  def __init__(self):
    super().__init__()
    self.unblock, self.hung = threading.Event(), threading.Event()

  def delete_step_in_parts(self, directory, step):
    super().delete_step(directory, step)  # Out of the list, files gone.
    yield
    self.hung.set()
    self.unblock.wait()
    yield


def test_a_delete_that_never_returns_is_given_up_on_and_raised(tmp_path):
  """A stuck delete holds no wait past its deadline: `wait_until_finished`
  returns, and the next save whose retention deletes raises its error
  (naming the step), its own step finalized."""
  backend = HangingDeletes()
  with CheckpointManager(tmp_path, max_to_keep=1, storage=Storage(
      backend=backend, io_timeout_secs=1.0)) as mgr:
    try:
      for step in (1, 2):
        mgr.save(step, {"w": np.full(4, step, np.float32)})
      assert backend.hung.wait(GATE_TIMEOUT)
      assert mgr.wait_until_finished(timeout=10)  # The delete given up on.
      mgr.save(3, {"w": np.full(4, 3, np.float32)})
      with pytest.raises(TimeoutError, match="deleting step 1 of"):
        mgr.wait_until_finished(deletes=False)
      assert mgr.all_steps() == [3]
    finally:
      backend.unblock.set()
