"""Per-process data state on one process: stored as bytes or JSON with the
step, checked, handed back to the data iterator at restore, in both tiers."""

import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import FaultTolerance
from flax_ckpt_plugin.tools import cli
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import DataStateMismatchError
from flax_ckpt_plugin.tolerance import generations


class Batches:
  """A toy data iterator: batch i is a function of its position."""

  def __init__(self, as_bytes=False):
    self.pos, self.as_bytes, self.set_calls = 0, as_bytes, 0

  def __next__(self):
    self.pos += 1
    return np.full((4,), self.pos * 0.5, np.float32)

  def get_state(self):
    if self.as_bytes:
      return f"pos={self.pos}".encode()
    return {"pos": np.int64(self.pos), "epoch": 0}

  def set_state(self, state):
    self.set_calls += 1
    self.pos = (int(state.decode().split("=")[1]) if self.as_bytes
                else state["pos"])


def _loop(cb, steps, data, iterator=None):
  """A loop whose state is the sum of the batches it has seen; `iterator`
  goes to `restore_or_initialize`."""
  state = cb.restore_or_initialize({"w": jnp.zeros(4)},
                                   data_iterator=iterator)
  start = cb.restored_step or 0
  seen = []
  for step in range(start + 1, steps + 1):
    batch = next(data)
    seen.append(float(batch[0]))
    state = {"w": state["w"] + batch}
    cb(step, state)
  cb.close()
  return state, seen


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_resumed_loop_sees_the_batches_of_the_uninterrupted_one(
    ckpt_dir, as_bytes):
  whole, seen_whole = _loop(CheckpointCallback(ckpt_dir / "a", every_steps=3),
                            10, Batches(as_bytes))
  data = Batches(as_bytes)
  cb = CheckpointCallback(ckpt_dir / "c", every_steps=3)
  _loop(cb, 7, data, data)  # Saves 3 and 6; the step-7 batch is lost.
  data = Batches(as_bytes)
  cb = CheckpointCallback(ckpt_dir / "c", every_steps=3)
  resumed, seen = _loop(cb, 10, data, data)
  assert cb.restored_step == 6 and data.set_calls == 1
  assert seen == seen_whole[6:]
  np.testing.assert_array_equal(resumed["w"], whole["w"])


def test_each_encoding_round_trips_and_bad_states_name_the_problem(ckpt_dir):
  m = CheckpointManager(ckpt_dir)
  m.save(1, {"w": jnp.ones(2)}, data_state=b"\x00\xff raw")
  m.save(2, {"w": jnp.ones(2)}, data_state={"pos": np.int32(5),
                                            "mix": np.arange(3)})
  m.save(3, {"w": jnp.ones(2)})
  with pytest.raises(TypeError, match="data state must be bytes or JSON"):
    m.save(4, {"w": jnp.ones(2)}, data_state={"f": object()})
  with pytest.raises(TypeError, match="data state"):
    m.save(4, {"w": jnp.ones(2)}, data_state={"nan": float("nan")})
  m.wait_until_finished()
  assert m.data_state(1) == b"\x00\xff raw"
  assert m.data_state(2) == {"pos": 5, "mix": [0, 1, 2]}
  assert m.data_state(3) is None
  assert m.all_steps() == [1, 2, 3]
  entry = json.loads((ckpt_dir / "2" / "manifest.json").read_text())[
      "data_states"]["0"]
  assert entry["file"] == "data/process_00000.state"
  assert entry["encoding"] == "json"
  m.close()


def test_a_damaged_data_state_is_named_and_the_callback_falls_back(
    ckpt_dir, capsys):
  data = Batches()
  _loop(CheckpointCallback(ckpt_dir, every_steps=2), 4, data, data)
  state_file = ckpt_dir / "4" / "data" / "process_00000.state"
  state_file.write_text(state_file.read_text().replace("4", "9"))
  with pytest.raises(CheckpointCorruptedError, match="process_00000.state"):
    CheckpointManager(ckpt_dir, read_only=True).data_state(4)
  assert cli.main(["verify", str(ckpt_dir), "--all"]) != 0
  out = capsys.readouterr()
  assert re.search(r"4/data/process_00000\.state: \d+ bytes that do not"
                   r" match", out.out + out.err), out
  data = Batches()
  cb = CheckpointCallback(ckpt_dir, every_steps=2)
  cb.restore_or_initialize({"w": jnp.zeros(4)}, data_iterator=data)
  assert cb.restored_step == 2 and data.pos == 2
  cb.close()


def test_a_step_without_this_process_state_is_skipped_and_kept(ckpt_dir):
  """What the survivors of a lost process save: the others' states only.
  (Made here by editing a manifest: a real loss is in test_survivors.)"""
  data = Batches()
  _loop(CheckpointCallback(ckpt_dir, every_steps=2), 4, data, data)
  path = ckpt_dir / "4" / "manifest.json"
  manifest = json.loads(path.read_text())
  manifest["data_states"] = {"1": dict(manifest["data_states"]["0"],
                                       file="data/process_00001.state")}
  path.write_text(json.dumps(manifest))
  data = Batches()
  cb = CheckpointCallback(ckpt_dir, every_steps=2)
  cb.restore_or_initialize({"w": jnp.zeros(4)}, data_iterator=data)
  assert cb.restored_step == 2 and data.pos == 2
  assert cb.manager.all_steps() == [2, 4]  # Not set aside: it is whole.
  cb.close()
  # Without a data iterator, step 4 restores as it is.
  cb = CheckpointCallback(ckpt_dir)
  cb.restore_or_initialize({"w": jnp.zeros(4)})
  assert cb.restored_step == 4
  cb.close()


def test_another_process_count_is_an_error_unless_the_data_state_is_skipped(
    ckpt_dir):
  """A step saved by 2 processes (its manifest edited here; the real one is
  in test_multihost_data_state) restored by 1."""
  data = Batches()
  _loop(CheckpointCallback(ckpt_dir, every_steps=2), 2, data, data)
  path = ckpt_dir / "2" / "manifest.json"
  manifest = json.loads(path.read_text())
  manifest["process_count"] = 2
  path.write_text(json.dumps(manifest))
  cb = CheckpointCallback(ckpt_dir)
  with pytest.raises(DataStateMismatchError,
                     match="saved by 2 processes, and this job has 1"):
    cb.restore_or_initialize({"w": jnp.zeros(4)}, data_iterator=Batches())
  cb.close()
  data = Batches()
  cb = CheckpointCallback(ckpt_dir)
  cb.restore_or_initialize({"w": jnp.zeros(4)}, data_iterator=data,
                           restore_data_state=False)
  assert cb.restored_step == 2 and data.set_calls == 0
  cb.close()


def test_the_local_tier_keeps_the_data_state_too(tmp_path, ckpt_dir):
  local = tmp_path / "local"
  data = Batches()
  kwargs = dict(every_steps=10, tolerance=FaultTolerance(
      local_directory=local, local_every_steps=3))
  _loop(CheckpointCallback(ckpt_dir, **kwargs), 7, data, data)
  data = Batches()
  cb = CheckpointCallback(ckpt_dir, **kwargs)
  cb.restore_or_initialize({"w": jnp.zeros(4)}, data_iterator=data)
  assert (cb.restored_step, cb.restored_tier, data.pos) == (6, "local", 6)
  cb.close()
  mine = os.path.join(local, generations.job_name(str(ckpt_dir)),
                      "process_00000", "6", "data", "process_00000.state")
  assert json.loads(open(mine).read()) == {"pos": 6, "epoch": 0}


def test_extra_takes_the_numpy_scalars_that_loaders_hand_out(ckpt_dir):
  m = CheckpointManager(ckpt_dir)
  m.save(1, {"w": jnp.ones(2)}, extra={"seen": np.int64(7),
                                       "lr": np.float32(0.5)})
  m.wait_until_finished()
  assert m.metadata(1).extra == {"seen": 7, "lr": 0.5}
  m.close()
