"""What a new user ran into adapting Flax's examples, and sees now."""

import json
import logging

import flax
from flax.training import train_state
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.tools import cli
from helpers import two_device_mesh


def _train_state(step):
  s = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)},
                                    tx=optax.adam(1e-3))
  return s.replace(step=jnp.int32(step))


def test_a_resume_is_visible_in_a_plain_script(ckpt_dir, caplog):
  """A script that configures no logging shows warnings (Python's last
  resort handler): the resume is one."""
  with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
    cb(4, _train_state(4))
  caplog.set_level(logging.WARNING)
  with CheckpointCallback(ckpt_dir) as cb:
    cb.restore_or_initialize(_train_state(0))
  assert [r.levelname for r in caplog.records
          if "resumed: restored step 4" in r.getMessage()] == ["WARNING"]


def test_nan_metrics_are_stored_as_null_and_show_json_stays_valid(
    ckpt_dir, capsys):
  with CheckpointManager(ckpt_dir) as m:
    m.save(1, _train_state(1), metrics={"loss": float("nan"), "acc": 0.5,
                                        "grad": float("inf")})
    m.wait_until_finished()
    assert m.metadata(1).metrics == {"loss": None, "acc": 0.5, "grad": None}
  raw = (ckpt_dir / "1" / "manifest.json").read_text()
  assert "NaN" not in raw and "Infinity" not in raw
  assert cli.main(["show", str(ckpt_dir), "--json"]) == 0
  shown = json.loads(capsys.readouterr().out)  # Strict JSON.
  assert shown["metrics"]["loss"] is None


def test_show_prints_the_value_of_0_d_arrays_such_as_the_step(
    ckpt_dir, capsys):
  with CheckpointManager(ckpt_dir) as m:
    m.save(1, _train_state(42))
  assert cli.main(["show", str(ckpt_dir)]) == 0
  out = capsys.readouterr().out
  assert "int32[] = 42" in out and "float32[3] " in out
  assert cli.main(["show", str(ckpt_dir), "--json"]) == 0
  leaves = {leaf["path"]: leaf for leaf in json.loads(
      capsys.readouterr().out)["leaves"]}
  assert leaves["step"]["value"] == 42
  assert "value" not in leaves["params/w"]


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


def test_restore_without_a_target_gives_plain_dicts_of_numpy_arrays(
    ckpt_dir):
  """`restore(None)`, as `flax.training.checkpoints` users do to look at a
  checkpoint: the tree as saved, string keys, whole numpy arrays."""
  mesh = two_device_mesh()
  sharded = jax.device_put(jnp.arange(8.0).reshape(4, 2),
                           NamedSharding(mesh, P("x")))
  tree = {"state": _train_state(7), "rng": jax.random.key(3),
          "host": np.arange(3, dtype=np.int16), "epoch": 5,
          "pair": [1.5, sharded]}
  with CheckpointManager(ckpt_dir) as m:
    m.save(7, tree)
    m.wait_until_finished()
    restored = m.restore(None)

  state = restored["state"]
  assert sorted(state) == ["opt_state", "params", "step"]
  assert sorted(state["opt_state"]) == ["0"]  # optax's EmptyState: no leaf.
  count = state["opt_state"]["0"]["count"]
  assert type(count) is np.ndarray and count.dtype == np.int32
  assert state["step"] == 7 and type(state["step"]) is np.ndarray
  assert type(state["params"]["w"]) is np.ndarray
  np.testing.assert_array_equal(state["params"]["w"], np.ones(3))
  np.testing.assert_array_equal(state["opt_state"]["0"]["mu"]["w"],
                                np.zeros(3))
  assert restored["epoch"] == 5 and type(restored["epoch"]) is int
  assert restored["host"].dtype == np.int16
  assert restored["pair"]["0"] == 1.5
  whole = restored["pair"]["1"]
  assert type(whole) is np.ndarray and whole.flags.writeable
  np.testing.assert_array_equal(whole, np.arange(8.0).reshape(4, 2))
  assert jax.numpy.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(restored["rng"]),
                                jax.random.key_data(jax.random.key(3)))

  # The same key paths as the saved tree's: restoring the params of it
  # into the user's own tree works by path.
  params = flax.serialization.from_state_dict({"w": jnp.zeros(3)},
                                              state["params"])
  np.testing.assert_array_equal(params["w"], np.ones(3))
