"""Flax NNX: saving and restoring `nnx.state` of modules and optimizers.

A model with `nnx.Linear`, `nnx.BatchNorm` and `nnx.Dropout` has parameters,
batch statistics, a typed PRNG key and a uint32 counter in its state; an
`nnx.Optimizer` has Adam's moments and its step. Both come back bit-identical
through `CheckpointManager` and `CheckpointCallback`, into concrete targets,
into abstract targets from `nnx.eval_shape` (with shardings over the two CPU
devices), and through the `nnx.split`/`nnx.merge` pattern; training after a
restore continues exactly as without one. `examples/nnx_train.py` runs,
resumes exactly (model, optimizer, metrics and the dropout `nnx.Rngs`), and
stops with exit code 75 on SIGTERM; left out of its checkpoint, the `nnx.Rngs`
or the metrics make the resume inexact; the code of `docs/nnx.md` runs and
prints what the page says.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
from flax_ckpt_plugin import StructureMismatchError

P = jax.sharding.PartitionSpec
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = REPO_ROOT / "examples" / "nnx_train.py"
DOC = REPO_ROOT / "docs" / "nnx.md"


class MLP(nnx.Module):
  """Linear -> BatchNorm -> relu -> Dropout -> Linear (-> Linear)."""

  def __init__(self, hidden: int = 16, *, rngs: nnx.Rngs,
               extra_layer: bool = False):
    self.linear1 = nnx.Linear(8, hidden, rngs=rngs)
    self.bn = nnx.BatchNorm(hidden, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.linear2 = nnx.Linear(hidden, 4, rngs=rngs)
    if extra_layer:
      self.linear3 = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    x = self.dropout(nnx.relu(self.bn(self.linear1(x))))
    return self.linear2(x)


X = np.linspace(-1.0, 1.0, 4 * 8, dtype=np.float32).reshape(4, 8)
Y = np.cos(np.arange(4 * 4, dtype=np.float32)).reshape(4, 4)


def create(seed: int = 0) -> tuple[MLP, nnx.Optimizer]:
  model = MLP(rngs=nnx.Rngs(seed))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


# Donates the model's and optimizer's buffers: a checkpoint must not depend
# on them once `save` returned.
@nnx.jit(donate_argnums=(0, 1))
def train_step(model: MLP, optimizer: nnx.Optimizer, x, y) -> jax.Array:
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def train(model: MLP, optimizer: nnx.Optimizer, steps: int) -> list[bytes]:
  """Runs `steps` train steps; returns the losses' bytes."""
  return [np.asarray(train_step(model, optimizer, X, Y)).tobytes()
          for _ in range(steps)]


@nnx.jit
def forward(model: MLP, x) -> jax.Array:
  return model(x)


def outputs(model: MLP) -> tuple[bytes, bytes]:
  """The model's eval-mode and train-mode (dropout) outputs, as bytes.

  The train-mode call draws a dropout mask from the model's RNG stream and
  updates its batch statistics; the model is left in train mode.
  """
  model.eval()
  evaluated = np.asarray(forward(model, X)).tobytes()
  model.train()
  return evaluated, np.asarray(forward(model, X)).tobytes()


def checkpoint_state(model: MLP, optimizer: nnx.Optimizer) -> dict:
  return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


def leaf_names(state) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in
          jax.tree_util.tree_flatten_with_path(state)[0]]


# -- nnx.state of a module and of an optimizer --------------------------------


def test_model_state_round_trip_is_bit_identical(ckpt_dir, host_copy,
                                                 assert_trees_equal):
  model, optimizer = create(seed=0)
  train(model, optimizer, 2)  # Moves the RNG counter and batch statistics.
  state = nnx.state(model)
  expected = host_copy(state)
  key = state["dropout"]["rngs"]["key"][...]
  assert jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  assert int(state["dropout"]["rngs"]["count"][...]) == 2

  with CheckpointManager(ckpt_dir) as mngr:
    mngr.save(2, state)
    mngr.wait_until_finished()
    # The checkpoint names NNX leaves by their key paths.
    manifest = json.loads((ckpt_dir / "2" / "manifest.json").read_text())
    paths = [leaf["path"] for leaf in manifest["leaves"]]
    assert "linear1/kernel/value" in paths
    assert "dropout/rngs/key/value" in paths
    fresh = MLP(rngs=nnx.Rngs(1))  # Other values everywhere.
    restored = mngr.restore(nnx.state(fresh))

  assert isinstance(restored, nnx.State)
  assert type(restored["linear1"]["kernel"]) is nnx.Param
  assert type(restored["bn"]["mean"]) is nnx.BatchStat
  assert type(restored["dropout"]["rngs"]["key"]) is nnx.RngKey
  assert_trees_equal(restored, expected)
  assert restored["dropout"]["rngs"]["count"][...].dtype == jnp.uint32
  assert str(jax.random.key_impl(restored["dropout"]["rngs"]["key"][...])
             ) == str(jax.random.key_impl(key))

  nnx.update(fresh, restored)
  # Same eval outputs, and the same dropout mask drawn next.
  assert outputs(fresh) == outputs(model)


def test_optimizer_state_round_trip_and_training_continues(
    ckpt_dir, host_copy, assert_trees_equal):
  model, optimizer = create(seed=0)
  train(model, optimizer, 3)
  opt_state = nnx.state(optimizer)
  assert int(opt_state["step"][...]) == 3
  assert "mu" in str(leaf_names(opt_state))  # Adam's moments are in it.
  expected = host_copy(checkpoint_state(model, optimizer))

  with CheckpointManager(ckpt_dir) as mngr:
    mngr.save(3, checkpoint_state(model, optimizer))
    # The next steps donate every buffer that was saved.
    reference_losses = train(model, optimizer, 2)
    reference = host_copy(checkpoint_state(model, optimizer))
    mngr.wait_until_finished()

    model2, optimizer2 = create(seed=7)
    restored = mngr.restore(checkpoint_state(model2, optimizer2))
  assert_trees_equal(restored, expected)

  nnx.update(model2, restored["model"])
  nnx.update(optimizer2, restored["optimizer"])
  assert int(optimizer2.step[...]) == 3
  assert train(model2, optimizer2, 2) == reference_losses
  assert_trees_equal(host_copy(checkpoint_state(model2, optimizer2)),
                     reference)


def test_callback_restore_or_initialize_resumes_exactly(ckpt_dir, host_copy,
                                                        assert_trees_equal):
  """A job that stops after step 4 and a rerun equal one job of 6 steps."""
  def run(num_steps: int) -> tuple[list[bytes], dict, int | None, object]:
    model, optimizer = create(seed=0)
    with CheckpointCallback(ckpt_dir, every_steps=2,
                            max_to_keep=2) as cb:
      restored = cb.restore_or_initialize(checkpoint_state(model, optimizer))
      nnx.update(model, restored["model"])
      nnx.update(optimizer, restored["optimizer"])
      losses = []
      for step in range(int(optimizer.step[...]) + 1, num_steps + 1):
        losses += train(model, optimizer, 1)
        cb(step, checkpoint_state(model, optimizer), extra={"next": step})
      cb.close()
    return (losses, host_copy(checkpoint_state(model, optimizer)),
            cb.restored_step, cb.restored_extra)

  first_losses, _, first_restored, _ = run(4)
  assert first_restored is None
  losses, state, restored_step, extra = run(6)
  assert (restored_step, extra) == (4, {"next": 4})
  assert len(losses) == 2

  model, optimizer = create(seed=0)
  reference_losses = train(model, optimizer, 6)
  assert first_losses + losses == reference_losses
  assert_trees_equal(state, host_copy(checkpoint_state(model, optimizer)))
  assert int(state["optimizer"]["step"][...]) == 6


def test_split_merge_of_model_and_optimizer(ckpt_dir, host_copy,
                                            assert_trees_equal):
  model, optimizer = create(seed=0)
  train(model, optimizer, 2)
  _, state = nnx.split((model, optimizer))
  expected = host_copy(state)
  assert leaf_names(state)[0].startswith("[0]")  # The model's half.

  with CheckpointManager(ckpt_dir) as mngr:
    mngr.save(2, state)
    mngr.wait_until_finished()
    # A new job builds the same objects to learn the structure.
    new_graphdef, target = nnx.split(create(seed=3))
    restored = mngr.restore(target)
  assert_trees_equal(restored, expected)

  model2, optimizer2 = nnx.merge(new_graphdef, restored)
  assert isinstance(model2, MLP) and isinstance(optimizer2, nnx.Optimizer)
  assert train(model2, optimizer2, 2) == train(model, optimizer, 2)
  assert_trees_equal(host_copy(nnx.state((model2, optimizer2))),
                     host_copy(nnx.state((model, optimizer))))


def test_pure_dict_round_trip(ckpt_dir, host_copy, assert_trees_equal):
  """`nnx.to_pure_dict` names leaves without the Variables' '/value'."""
  model, optimizer = create(seed=0)
  train(model, optimizer, 1)
  pure = nnx.to_pure_dict(nnx.state(model))
  expected = host_copy(nnx.state(model))
  with CheckpointManager(ckpt_dir) as mngr:
    mngr.save(1, pure)
    mngr.wait_until_finished()
    fresh = MLP(rngs=nnx.Rngs(5))
    state = nnx.state(fresh)
    restored = mngr.restore(nnx.to_pure_dict(state))
    assert "linear1" in restored and "kernel" in restored["linear1"]
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(fresh, state)
    assert_trees_equal(host_copy(nnx.state(fresh)), expected)

    # A Variable-state target does not match a pure-dict checkpoint; the
    # message names the leaves on both sides.
    with pytest.raises(StructureMismatchError) as e:
      mngr.restore(nnx.state(fresh))
  message = str(e.value)
  assert "'linear1/kernel/value'" in message
  assert "'linear1/kernel'" in message


# -- abstract and sharded targets ----------------------------------------------


def shard_kernels(abstract_state, mesh: jax.sharding.Mesh, spec: P):
  """The abstract state with `spec` on 2-D leaves, replicated elsewhere."""
  def add(x):
    sharding = jax.sharding.NamedSharding(mesh, spec if x.ndim == 2 else P())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(add, abstract_state)


def test_restore_into_abstract_sharded_state(ckpt_dir, host_copy,
                                             assert_trees_equal):
  assert len(jax.devices()) == 2
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("model",))
  model, optimizer = create(seed=0)
  train(model, optimizer, 2)
  # Saved sharded one way (rows of the kernels over the two devices) ...
  state = nnx.state(model)
  expected = host_copy(state)
  nnx.update(model, jax.tree.map(
      lambda a, s: jax.device_put(a, s.sharding), state,
      shard_kernels(state, mesh, P("model", None))))
  assert len(model.linear1.kernel[...].sharding.device_set) == 2
  with CheckpointManager(ckpt_dir) as mngr:
    mngr.save(2, nnx.state(model))
    mngr.wait_until_finished()

    # ... restored another way (columns) into an abstract model.
    abstract_model = nnx.eval_shape(lambda: MLP(rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract_model)
    assert isinstance(abstract_state["linear1"]["kernel"].get_value(),
                      jax.ShapeDtypeStruct)
    target = shard_kernels(abstract_state, mesh, P(None, "model"))
    restored = mngr.restore(target)

  assert_trees_equal(host_copy(restored), expected)
  for (path, leaf), (_, want) in zip(
      jax.tree_util.tree_flatten_with_path(restored)[0],
      jax.tree_util.tree_flatten_with_path(target)[0]):
    assert isinstance(leaf, jax.Array), path
    assert leaf.sharding == want.sharding, jax.tree_util.keystr(path)
  kernel = restored["linear1"]["kernel"][...]
  assert kernel.sharding.spec == P(None, "model")
  assert [s.data.shape for s in kernel.addressable_shards] == [(8, 8)] * 2

  restored_model = nnx.merge(graphdef, restored)
  assert isinstance(restored_model, MLP)
  restored_model.eval()
  model.eval()
  # Rows vs columns of the kernels on two devices: the sums run in other
  # orders, so the outputs agree to rounding, not to the bit.
  np.testing.assert_allclose(restored_model(X), model(X), rtol=1e-5,
                             atol=1e-6)


def test_restore_into_state_from_eval_shape_under_set_mesh(ckpt_dir,
                                                           host_copy,
                                                           assert_trees_equal):
  """Partitioned parameters: `nnx.eval_shape` under `jax.set_mesh`.

  The abstract leaves' shardings name only an abstract mesh; the restore
  places them on the mesh that is set, and says what to do when none is.
  """
  mesh = jax.make_mesh((2,), ("model",),
                       axis_types=(jax.sharding.AxisType.Auto,))

  def make():
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                 (None, "model"))
    return nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))

  with jax.set_mesh(mesh):
    linear = make()
    expected = host_copy(nnx.state(linear))
    abstract_state = nnx.state(nnx.eval_shape(make))
  spec = abstract_state["kernel"].get_value().sharding
  assert isinstance(spec.mesh, jax.sharding.AbstractMesh)

  with CheckpointManager(ckpt_dir) as mngr:
    mngr.save(0, nnx.state(linear))
    mngr.wait_until_finished()
    with jax.set_mesh(mesh):
      restored = mngr.restore(abstract_state)
    # Concrete shardings, from the state itself, need no mesh to be set.
    concrete = jax.tree.map(lambda a, s: a.update(sharding=s),
                            abstract_state,
                            nnx.get_named_sharding(abstract_state, mesh))
    again = mngr.restore(concrete)
    with pytest.raises(ValueError, match=r"leaf 'bias/value'.* abstract mesh"
                       r".* no mesh is set.*jax.set_mesh"):
      mngr.restore(abstract_state)
    one_device = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1])
    with jax.set_mesh(one_device), pytest.raises(
        ValueError, match=r"leaf 'bias/value'.* the mesh set is Mesh\("):
      mngr.restore(abstract_state)

  for tree in (restored, again):
    assert_trees_equal(host_copy(tree), expected)
    kernel = tree["kernel"][...]
    assert kernel.sharding == jax.sharding.NamedSharding(mesh,
                                                         P(None, "model"))


# -- what a user sees when the structure differs --------------------------------


def test_structure_mismatch_names_the_leaf(ckpt_dir):
  model, _ = create(seed=0)
  with CheckpointManager(ckpt_dir) as mngr:
    mngr.save(0, nnx.state(model))
    mngr.wait_until_finished()

    # A layer added since the checkpoint was written.
    with pytest.raises(StructureMismatchError) as e:
      mngr.restore(nnx.state(MLP(rngs=nnx.Rngs(0), extra_layer=True)))
    message = str(e.value)
    assert os.fspath(ckpt_dir / "0") in message
    assert ("target leaves not in the checkpoint: ['linear3/bias/value',"
            " 'linear3/kernel/value']") in message

    # A layer made wider: both shapes, by the leaf's key path.
    with pytest.raises(StructureMismatchError,
                       match=re.escape(
                           "leaf 'bn/bias/value': checkpoint has"
                           " float32[16], target has float32[32]")):
      mngr.restore(nnx.state(MLP(32, rngs=nnx.Rngs(0))))

    # An abstract target with the wider layer says the same (every leaf
    # that differs is named, this one among them).
    with pytest.raises(StructureMismatchError,
                       match=re.escape(
                           "leaf 'bn/bias/value': checkpoint has"
                           " float32[16], target has float32[32]")):
      mngr.restore(nnx.state(nnx.eval_shape(
          lambda: MLP(32, rngs=nnx.Rngs(0)))))

    # The optimizer's state is not the model's state.
    with pytest.raises(StructureMismatchError,
                       match=r"opt_state/0/mu/linear1/kernel/value"):
      mngr.restore(nnx.state(create(seed=0)[1]))


def test_scalar_variables_and_other_rng_impls(ckpt_dir, host_copy,
                                              assert_trees_equal):
  """Python scalars, numpy values and an 'rbg' key in Variables."""

  class Stateful(nnx.Module):

    def __init__(self, rngs: nnx.Rngs):
      self.calls = nnx.Variable(0)
      self.scale = nnx.Variable(1.5)
      self.enabled = nnx.Variable(True)
      self.table = nnx.Variable(np.arange(3, dtype=np.int16))
      self.rngs = rngs

  def make(seed: int) -> Stateful:
    return Stateful(nnx.Rngs(params=seed, noise=jax.random.key(
        seed, impl="rbg")))

  module = make(0)
  module.calls.set_value(7)
  module.rngs.noise()  # Advances that stream's counter.
  state = nnx.state(module)
  with CheckpointManager(ckpt_dir) as mngr:
    mngr.save(0, state)
    mngr.wait_until_finished()
    restored = mngr.restore(nnx.state(make(1)))
    abstract = mngr.restore(nnx.state(nnx.eval_shape(lambda: make(1))))

  assert_trees_equal(restored, host_copy(state))
  assert restored["calls"].get_value() == 7
  assert type(restored["calls"].get_value()) is int
  assert isinstance(restored["table"].get_value(), np.ndarray)
  noise_key = restored["rngs"]["noise"]["key"][...]
  assert str(jax.random.key_impl(noise_key)) == str(
      jax.random.key_impl(state["rngs"]["noise"]["key"][...]))
  assert int(restored["rngs"]["noise"]["count"][...]) == 1
  # Into an abstract target every leaf is an array of the target's dtype.
  assert int(abstract["calls"][...]) == 7
  assert float(abstract["scale"][...]) == 1.5
  assert np.array_equal(abstract["table"][...], np.arange(3))
  assert np.array_equal(jax.random.key_data(abstract["rngs"]["noise"]["key"]
                                            [...]),
                        jax.random.key_data(noise_key))


# -- docs/nnx.md ------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.multiprocess
def test_doc_code_runs_and_prints_what_the_doc_says(tmp_path):
  """The page's ```python blocks, run in order as one script."""
  text = DOC.read_text()
  code = "\n".join(re.findall(r"^```python\n(.*?)^```", text, re.S | re.M))
  script = tmp_path / "nnx_doc.py"
  script.write_text(code)
  env = dict(os.environ)  # Two CPU devices (conftest's XLA_FLAGS).
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, os.fspath(script)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  lines = result.stdout.splitlines()
  assert lines[:3] == ["key<fry>", "3", "3"]
  # "Save everything the train step mutates": restored with its nnx.Rngs
  # and metrics the run is exact; without them it is not, as the page says.
  assert lines[3:5] == ["True True", "False 2"]
  assert "prints `True True`, then `False 2`." in text
  assert lines[5:8] == ["P(None, 'model')"] * 3
  # The error messages are the ones the page shows ("/..." is the cwd).
  shown = re.search(r"^prints\n\n```\n(.*?)^```", text, re.S | re.M)[1]
  assert lines[8:] == shown.replace(
      "/...", os.fspath(tmp_path.resolve())).splitlines()
  # Its saves finalized; retention kept the newest three (max_to_keep=3).
  assert CheckpointManager(tmp_path / "checkpoints" / "nnx",
                           read_only=True).all_steps() == [20, 30, 40]


# -- examples/nnx_train.py ---------------------------------------------------


def example_env() -> dict[str, str]:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # One CPU device, as on a user's laptop.
  env["JAX_PLATFORMS"] = "cpu"
  return env


def example_argv(workdir: pathlib.Path, num_steps: int, final: pathlib.Path,
                 *extra: str) -> list[str]:
  return [sys.executable, os.fspath(EXAMPLE), "--workdir", os.fspath(workdir),
          "--num-steps", str(num_steps), "--every-steps", "5",
          "--log-every", "4", "--final-state", os.fspath(final), *extra]


def run_example(*argv: object) -> list[str]:
  """Runs the example to exit code 0, as a user would; its stdout lines."""
  result = subprocess.run(example_argv(*argv), capture_output=True, text=True,
                          env=example_env(), timeout=300, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout.splitlines()


def losses(lines: list[str], after: int = 0) -> list[str]:
  """The reports after step `after`: means of the metrics since the last."""
  return [l for l in lines
          if (m := re.fullmatch(r"step (\d+): loss \S+ accuracy \S+", l))
          and int(m[1]) > after]


def steps_in(workdir: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in workdir.iterdir() if p.name.isdigit())


def assert_same_npz(actual: pathlib.Path, expected: pathlib.Path) -> None:
  with np.load(actual) as a, np.load(expected) as e:
    assert sorted(a.files) == sorted(e.files)
    names = "\n".join(e.files)
    for part in ("['model']['bn']['mean']", "['rngs']['dropout']['key']",
                 "['rngs']['dropout']['count']", "['opt_state'][0]['mu']",
                 "['optimizer']['step']", "['metrics']['loss']['total']",
                 "['metrics']['accuracy']['count']"):
      assert part in names, names
    for k in e.files:
      assert (a[k].dtype, a[k].shape) == (e[k].dtype, e[k].shape), k
      assert a[k].tobytes() == e[k].tobytes(), f"{k} differs after resume"


def load_example():
  """examples/nnx_train.py as a module, to call its functions here."""
  spec = importlib.util.spec_from_file_location("nnx_train_example", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_a_resume_is_exact_only_with_everything_the_step_mutates(
    tmp_path, host_copy, assert_trees_equal):
  """The example's objects, saved at step 3 in full or with one left out.

  Left out, the `nnx.Rngs` restarts its count: the resumed steps draw the
  dropout masks of steps 1-3 again, and the parameters end elsewhere. Left
  out, the metrics restart empty: the parameters agree, the running means
  do not. Saved with the rest, every bit agrees.
  """
  example = load_example()
  x, y = example.make_dataset()
  batches = [(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
             for i in range(6)]

  def run(train: dict, batches: list) -> dict:
    for bx, by in batches:
      example.train_step(train["model"], train["optimizer"], train["metrics"],
                         train["rngs"], bx, by)
    return train

  whole = host_copy(nnx.state(run(example.create(), batches)))

  def resume(saved: tuple[str, ...]) -> nnx.State:
    """Saves `saved` of a run stopped at step 3, restores into new objects
    (as a restarted job builds them) and runs steps 4-6."""
    train = run(example.create(), batches[:3])
    directory = tmp_path / "-".join(saved)
    with CheckpointManager(directory) as mngr:
      mngr.save(3, nnx.state({k: train[k] for k in saved}))
    train = example.create()
    kept = {k: train[k] for k in saved}
    with CheckpointManager(directory, read_only=True) as mngr:
      nnx.update(kept, mngr.restore(nnx.state(kept)))
    return host_copy(nnx.state(run(train, batches[3:])))

  everything = resume(("model", "optimizer", "metrics", "rngs"))
  assert_trees_equal(everything, whole)

  def kernel(state):
    return np.asarray(state["model"]["linear1"]["kernel"][...]).tobytes()

  def metric(state, name):
    return np.asarray(state["metrics"][name]["total"][...]).tobytes()

  no_rngs = resume(("model", "optimizer", "metrics"))
  assert int(whole["rngs"]["dropout"]["count"][...]) == 6
  assert int(no_rngs["rngs"]["dropout"]["count"][...]) == 3
  assert kernel(no_rngs) != kernel(whole)  # Other dropout masks.
  assert metric(no_rngs, "loss") != metric(whole, "loss")

  no_metrics = resume(("model", "optimizer", "rngs"))
  assert kernel(no_metrics) == kernel(whole)  # Training itself is exact ...
  assert int(whole["metrics"]["loss"]["count"][...]) == 6
  assert int(no_metrics["metrics"]["loss"]["count"][...]) == 3  # ... its
  assert metric(no_metrics, "loss") != metric(whole, "loss")  # report not.


@pytest.mark.timeout(900)
@pytest.mark.multiprocess
def test_example_resumes_exactly_and_stops_on_sigterm(tmp_path):
  fresh = run_example(tmp_path / "fresh", 30, tmp_path / "fresh.npz")
  assert fresh[0] == "no checkpoint, starting fresh"
  assert fresh[-1] == "done at step 30"
  assert re.fullmatch(r"accuracy \d\.\d{4}", fresh[-2])

  # Twice on one workdir: the second run resumes from the first's last step.
  workdir = tmp_path / "resumed"
  first = run_example(workdir, 15, tmp_path / "first.npz")
  assert first[-1] == "done at step 15"
  assert steps_in(workdir) == [5, 10, 15]
  second = run_example(workdir, 30, tmp_path / "second.npz")
  assert second[0] == "restored step 15"
  assert second[-1] == "done at step 30"
  assert steps_in(workdir) == [20, 25, 30]
  # Same batches, dropout masks and updates as the uninterrupted run, and
  # the same metrics: step 16 reports the means over steps 13-16, three of
  # which the first run accumulated and saved.
  assert len(losses(fresh)) == 7
  assert losses(first) == losses(fresh)[:3]
  assert losses(second) == losses(fresh, after=15)
  assert_same_npz(tmp_path / "second.npz", tmp_path / "fresh.npz")

  # SIGTERM: saves the step it is at, exits 75; a rerun finishes exactly.
  workdir = tmp_path / "preempted"
  with tempfile.TemporaryFile() as stderr:
    proc = subprocess.Popen(
        example_argv(workdir, 30, tmp_path / "unused.npz", "--step-secs",
                     "0.1"),
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=example_env(),
        start_new_session=True)
    try:
      lines = []
      for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if lines[-1].startswith("step 4: loss"):
          proc.send_signal(signal.SIGTERM)
      code = proc.wait(timeout=300)
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    stderr.seek(0)
    output = "\n".join(lines) + "\n" + stderr.read().decode()[-4000:]
  assert code == PREEMPTED_EXIT_CODE, output
  m = re.fullmatch(r"preempted: checkpoint of step (\d+) is durable, exiting"
                   r" with code 75", lines[-1])
  assert m, output
  step = int(m[1])
  assert 4 <= step < 30, output
  assert steps_in(workdir)[-1] == step
  resumed = run_example(workdir, 30, tmp_path / "after_sigterm.npz")
  assert resumed[0] == f"restored step {step}"
  assert losses(resumed) == losses(fresh, after=step)
  assert_same_npz(tmp_path / "after_sigterm.npz", tmp_path / "fresh.npz")
