"""The clu integration, with the released clu (and the tensorflow it needs).

`CheckpointAction` runs in a list of clu periodic actions beside clu's own
`ReportProgress`, and the callback's metric writer is clu's default writer,
whose TensorBoard event files the test reads back with tensorflow.
"""

import glob

import jax
import numpy as np
import pytest

# The test extra installs clu, tensorflow-cpu and tensorboard: a missing one
# is an installation error, so these imports fail rather than skip.
from clu import metric_writers
from clu import periodic_actions
import tensorflow as tf

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin.clu_hooks import CheckpointAction
from helpers import adam_train_state as _train_state

NUM_STEPS = 12
METRICS = {"checkpoint/blocking_secs", "checkpoint/commit_secs",
           "checkpoint/bytes", "checkpoint/gbytes_per_sec",
           "checkpoint/secs_since_last_durable"}


def _scalars(logdir) -> dict[str, dict[int, float]]:
  """Scalars of the TensorBoard event files under `logdir`, by tag and step."""
  out: dict[str, dict[int, float]] = {}
  for path in glob.glob(f"{logdir}/**/events.out.tfevents.*", recursive=True):
    for record in tf.data.TFRecordDataset(path):
      event = tf.compat.v1.Event.FromString(record.numpy())
      for value in event.summary.value:
        out.setdefault(value.tag, {})[event.step] = float(
            tf.make_ndarray(value.tensor))
  return out


def _loop(ckpt_dir, logdir, make_state, train_step, *, num_steps, first=None):
  """A flax-examples style loop: a list of clu hooks called every step."""
  writer = metric_writers.create_default_writer(logdir, asynchronous=False)
  state = make_state()
  ckpt = CheckpointAction(
      CheckpointCallback(ckpt_dir, every_steps=5, last_step=num_steps,
                         metric_writer=writer),
      lambda: state, extra_fn=lambda: {"next_batch": int(state.step)})
  state = ckpt.restore_or_initialize(state)
  start = first or int(state.step) + 1
  hooks = [periodic_actions.ReportProgress(num_train_steps=num_steps,
                                           every_steps=4, writer=writer), ckpt]
  triggered = []
  for step in range(start, num_steps + 1):
    state = train_step(state)
    for hook in hooks:
      if hook(step) and hook is ckpt:
        triggered.append(step)
  ckpt.close()
  writer.close()
  return ckpt, state, triggered


def test_checkpoint_action_is_a_clu_periodic_action(tmp_path, make_state,
                                                     train_step,
                                                     assert_trees_equal):
  ckpt_dir, logdir = tmp_path / "ckpt", tmp_path / "logs"
  ckpt, state, triggered = _loop(ckpt_dir, logdir, make_state, train_step,
                                 num_steps=NUM_STEPS)
  assert isinstance(ckpt, periodic_actions.PeriodicAction)
  assert triggered == [5, 10, 12]
  assert ckpt.manager.all_steps() == [5, 10, 12]
  assert not ckpt.should_stop

  # A new job resumes from step 12 through the same action.
  again = CheckpointAction.create(ckpt_dir, lambda: None, every_steps=5)
  restored = again.restore_or_initialize(make_state(seed=1))
  assert int(restored.step) == NUM_STEPS
  assert_trees_equal((restored.params, restored.opt_state),
                     jax.device_get((state.params, state.opt_state)))
  assert again.restored_extra == {"next_batch": NUM_STEPS}
  again.close()


def test_metric_writer_gets_one_row_of_save_metrics_per_save(
    tmp_path, make_state, train_step):
  ckpt_dir, logdir = tmp_path / "ckpt", tmp_path / "logs"
  _, state, _ = _loop(ckpt_dir, logdir, make_state, train_step,
                      num_steps=NUM_STEPS)
  scalars = _scalars(logdir)
  assert METRICS <= set(scalars), sorted(scalars)
  assert "steps_per_sec" in scalars  # clu's own hook wrote to the same writer.
  state_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
  for name in METRICS:
    assert sorted(scalars[name]) == [5, 10, 12], name
  for step in (5, 10, 12):
    assert scalars["checkpoint/bytes"][step] == state_bytes
    assert scalars["checkpoint/commit_secs"][step] > 0
    assert scalars["checkpoint/blocking_secs"][step] >= 0
    assert scalars["checkpoint/gbytes_per_sec"][step] == pytest.approx(
        state_bytes / 1e9 / scalars["checkpoint/commit_secs"][step], rel=1e-3)
    assert scalars["checkpoint/secs_since_last_durable"][step] > 0


def test_the_clu_action_calls_extra_fn_only_when_it_saves(ckpt_dir):
  """`extra_fn` may sync with the device (reading the state): it runs at
  the saves, not at every step."""
  from flax_ckpt_plugin.clu_hooks import CheckpointAction  # pylint: disable=g-import-not-at-top
  calls = []
  state = _train_state(0)
  action = CheckpointAction.create(
      ckpt_dir, lambda: state, every_steps=5,
      extra_fn=lambda: calls.append(1) or {"at": len(calls)})
  saved = [step for step in range(1, 13) if action(step)]
  action.close()
  assert saved == [5, 10] and len(calls) == 2


def test_flax_examples_0_based_hooks_save_the_end_with_step_offset(
    ckpt_dir, caplog):
  """Flax's examples call hooks with the index of the batch just trained:
  with `last_step=num_steps` the end was never saved, and nothing said so."""
  from flax_ckpt_plugin.clu_hooks import CheckpointAction  # pylint: disable=g-import-not-at-top
  num_steps, state = 8, _train_state(0)
  short = CheckpointAction.create(ckpt_dir / "a", lambda: state,
                                  every_steps=100, last_step=num_steps)
  for step in range(0, num_steps):
    short(step)
  short.close()
  assert short.manager.all_steps() == []
  assert "one short of last_step=8" in caplog.text
  assert "step_offset=1" in caplog.text
  action = CheckpointAction.create(ckpt_dir / "b", lambda: state,
                                   every_steps=100, last_step=num_steps,
                                   step_offset=1)
  for step in range(0, num_steps):
    action(step)
  action.close()
  assert action.manager.all_steps() == [num_steps]
