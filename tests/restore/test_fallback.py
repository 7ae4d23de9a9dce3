"""`restore_or_initialize` falls back to the newest good step, with every
process agreeing on which; a target that does not match is never taken for a
damaged step.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import StructureMismatchError
from helpers import flip_byte as _flip_byte
from launcher import run_workers

DATA = "data/process_00000.bin"
# One run of real worker processes: jax starts in ~3 s per process on this
# 2-core machine; the rest is a few tiny saves and restores.
RUN_TIMEOUT = 120


def _saved_train_states(ckpt_dir, make_state, train_step, host_copy):
  """Steps 1, 2, 3 of a trained TrainState; their expected host values."""
  expected = {}
  state = make_state()
  with CheckpointCallback(ckpt_dir, every_steps=1, max_to_keep=None) as cb:
    for step in (1, 2, 3):
      state = train_step(state)
      assert cb(step, state, extra={"step": step})
      expected[step] = host_copy(state)
      cb.wait_until_finished()
  return expected


def _flip_middle(step_dir: pathlib.Path, name: str = DATA) -> None:
  _flip_byte(step_dir / name, os.path.getsize(step_dir / name) // 2)


def _target_state(make_state, train_step):
  # Trained once, so that `step` is a jax array as in the saved states.
  return train_step(make_state(seed=9))


def test_restore_or_initialize_skips_a_damaged_newest_step(
    ckpt_dir, make_state, train_step, host_copy, assert_trees_equal, caplog):
  """The newest step has a flipped byte: step 2 is restored, with a warning."""
  expected = _saved_train_states(ckpt_dir, make_state, train_step, host_copy)
  _flip_middle(ckpt_dir / "3")
  with caplog.at_level(logging.WARNING, logger="flax_ckpt_plugin"):
    with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
      restored = cb.restore_or_initialize(
          _target_state(make_state, train_step))
      assert cb.restored_step == 2
      assert cb.restored_extra == {"step": 2}
  assert_trees_equal(restored, expected[2])
  warnings = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING]
  assert any("skipping step 3" in w and "checksum mismatch" in w
             for w in warnings), warnings
  # The damaged step is kept for a person to look at, out of the way.
  assert (ckpt_dir / "3.damaged" / "_COMMITTED").exists()
  assert not (ckpt_dir / "3").exists()
  assert any("damaged step 3 of" in w and "3.damaged" in w
             for w in warnings), warnings

  # Training from step 2 saves step 3 anew, and a new job restores it.
  state = train_step(jax.device_put(expected[2]))
  with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
    assert cb(3, state)
  with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
    restored = cb.restore_or_initialize(_target_state(make_state, train_step))
    assert cb.restored_step == 3
  assert_trees_equal(restored, expected[3])
  assert sorted(set(os.listdir(ckpt_dir)) - {"_WRITER"}) == [
      "1", "2", "3", "3.damaged"]


def test_restore_or_initialize_with_every_step_damaged_lists_them(
    ckpt_dir, make_state, train_step, host_copy):
  _saved_train_states(ckpt_dir, make_state, train_step, host_copy)
  for step in (1, 2, 3):
    _flip_middle(ckpt_dir / str(step))
  with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
    with pytest.raises(CheckpointCorruptedError) as info:
      cb.restore_or_initialize(_target_state(make_state, train_step))
    assert cb.restored_step is None
  message = str(info.value)
  for step in (1, 2, 3):
    assert f"step {step}: " in message, message


def test_structure_mismatch_is_not_swallowed_by_the_fallback(
    ckpt_dir, make_state, train_step, host_copy):
  """A target that does not match is the caller's bug, not a damaged step.

  An older step would not match either, so falling back (or starting from
  scratch) would hide it. Even with the newest step damaged, the mismatch is
  what is raised.
  """
  _saved_train_states(ckpt_dir, make_state, train_step, host_copy)
  _flip_middle(ckpt_dir / "3")
  wrong = {"params": {"kernel": jnp.zeros((3, 3))}}
  with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
    with pytest.raises(StructureMismatchError):
      cb.restore_or_initialize(wrong)
    assert cb.restored_step is None


@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
@pytest.mark.multiprocess
def test_processes_agree_on_the_fallback_step(tmp_path):
  """Only process 1 can see that step 2 is damaged; both restore step 1.

  2 processes x 2 devices, the state sharded across both. The test flips a
  byte in step 2's `data/process_00001.bin`, which only process 1 reads:
  process 0 alone restores step 2 without error (the worker shows it). The
  fallback lets all processes vote on each step, so both skip step 2 and
  restore step 1, bit for bit, each logging a warning; process 0's names
  the file process 1 found damaged.
  """
  ckpt = tmp_path / "ckpt"
  saved = [r.json for r in run_workers("fallback_agreement", 2,
                                       args=["save", ckpt],
                                       timeout=RUN_TIMEOUT)]
  assert saved[0] == saved[1]
  assert sorted(os.listdir(ckpt / "2" / "data")) == [
      "process_00000.bin", "process_00001.bin"]
  _flip_middle(ckpt / "2", "data/process_00001.bin")

  results = run_workers("fallback_agreement", 2, args=["restore", ckpt],
                        timeout=RUN_TIMEOUT)
  logs = "\n" + "\n".join(r.log() for r in results)
  p0, p1 = (r.json for r in results)
  assert p0["step2_alone"] == "ok", logs
  assert "checksum mismatch in data/process_00001.bin" in p1["step2_alone"]
  for p, out in enumerate((p0, p1)):
    assert out["restored_step"] == 1, f"process {p}{logs}"
    assert out["restored"] == saved[0]["saved"]["1"], f"process {p}"
    assert re.search(r"WARNING .*skipping step 2 of", results[p].stderr), (
        f"process {p}{logs}")
  # Process 0 says why, from process 1's report.
  assert re.search(r"WARNING .*skipping step 2 of .*damaged(?: or missing)?"
                   r" on other processes: process 1: .*"
                   r"checksum mismatch in data/process_00001\.bin",
                   results[0].stderr), logs
  # The primary set the damaged step aside, once, for both processes.
  assert (ckpt / "2.damaged" / "_COMMITTED").exists() and not (
      ckpt / "2").exists()
