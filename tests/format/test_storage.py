"""Tests of the snapshot, the on-disk format and restore (via the manager)."""

import json
import os

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ckpt_plugin
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StructureMismatchError

from helpers import two_device_mesh

DATA_FILE = os.path.join("data", "process_00000.bin")


def _save(directory, step, tree, **kwargs):
  """Saves `tree` as `step` and waits until it is finalized."""
  with CheckpointManager(directory) as manager:
    manager.save(step, tree, **kwargs)
  return directory / str(step)


def _restore(directory, target, step=None):
  with CheckpointManager(directory) as manager:
    return manager.restore(target, step)


def _random_bits(dtype, shape, seed):
  """Arbitrary bit patterns of `dtype`, NaN payloads and subnormals included."""
  dtype = np.dtype(dtype)
  raw = np.random.default_rng(seed).integers(
      0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
  return raw.view(dtype).reshape(shape)


def _zeros_like(tree):
  """A restore target with the same types but different values."""
  def zero(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype,
                                                   jax.dtypes.prng_key):
      return jax.random.wrap_key_data(
          jnp.zeros_like(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array):
      return jnp.zeros_like(x)
    if isinstance(x, np.ndarray):
      return np.zeros_like(x)
    return type(x)(0)
  return jax.tree.map(zero, tree)


def test_two_cpu_devices_are_available():
  # conftest sets XLA_FLAGS; the sharding tests below need it.
  assert len(jax.devices()) == 2


JAX_DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn,
              jnp.int8, jnp.uint8, jnp.int16, jnp.int32, jnp.uint32,
              jnp.complex64]


def test_all_jax_dtypes_round_trip_bit_for_bit(ckpt_dir, assert_trees_equal,
                                               host_copy):
  tree = {np.dtype(d).name: jnp.asarray(_random_bits(d, (3, 5), seed=i))
          for i, d in enumerate(JAX_DTYPES)}
  tree["bool"] = jnp.asarray([[True, False, True], [False, False, True]])
  expected = host_copy(tree)
  _save(ckpt_dir, 1, tree)
  restored = _restore(ckpt_dir, _zeros_like(tree))
  for name, leaf in restored.items():
    assert isinstance(leaf, jax.Array), name
  assert_trees_equal(restored, expected)


def test_64_bit_numpy_leaves_round_trip_and_stay_numpy(ckpt_dir,
                                                       assert_trees_equal):
  # jax x64 is off, so 64-bit values can only be numpy leaves.
  assert not jax.config.jax_enable_x64
  tree = {"int64": _random_bits(np.int64, (4,), 1),
          "uint64": _random_bits(np.uint64, (2, 2), 2),
          "float64": _random_bits(np.float64, (3,), 3),
          "complex128": _random_bits(np.complex128, (2,), 4),
          "float32": np.arange(6, dtype=np.float32).reshape(2, 3),
          "bool": np.array([True, False])}
  _save(ckpt_dir, 1, tree)
  restored = _restore(ckpt_dir, _zeros_like(tree))
  for name, leaf in restored.items():
    assert type(leaf) is np.ndarray, name
  assert_trees_equal(restored, tree)


def test_zero_d_jax_arrays_round_trip(ckpt_dir, assert_trees_equal, host_copy):
  mesh = two_device_mesh()
  tree = {"f32": jnp.float32(-0.0), "i32": jnp.int32(-7),
          "bf16": jnp.asarray(3.5, jnp.bfloat16), "bool": jnp.bool_(True),
          "replicated": jax.device_put(jnp.float32(2.25),
                                       NamedSharding(mesh, P()))}
  expected = host_copy(tree)
  _save(ckpt_dir, 1, tree)
  restored = _restore(ckpt_dir, _zeros_like(tree))
  assert_trees_equal(restored, expected)
  assert restored["f32"].shape == ()


def test_zero_d_numpy_leaves_round_trip(ckpt_dir, assert_trees_equal):
  tree = {"array0d": np.array(5.5, np.float32),
          "int64_0d": np.array(2**40, np.int64)}
  _save(ckpt_dir, 1, tree)
  restored = _restore(ckpt_dir, _zeros_like(tree))
  assert_trees_equal(restored, tree)


def test_numpy_scalar_leaves_round_trip(ckpt_dir):
  tree = {"f32": np.float32(1.25), "i64": np.int64(-3)}
  _save(ckpt_dir, 1, tree)
  restored = _restore(ckpt_dir, {"f32": np.float32(0), "i64": np.int64(0)})
  assert type(restored["f32"]) is np.float32
  assert type(restored["i64"]) is np.int64
  assert restored == tree


def test_python_scalars_keep_their_type(ckpt_dir, assert_trees_equal):
  tree = {"int": 7, "big_int": 2**70, "float": 0.1, "neg_float": -1e-300,
          "true": True, "false": False}
  _save(ckpt_dir, 1, tree)
  restored = _restore(ckpt_dir, {"int": 0, "big_int": 0, "float": 0.0,
                                 "neg_float": 0.0, "true": False,
                                 "false": True})
  assert_trees_equal(restored, tree)  # Checks the Python type of each.


def test_typed_prng_keys_round_trip(ckpt_dir, assert_trees_equal, host_copy):
  tree = {"key": jax.random.key(42),
          "keys": jax.random.split(jax.random.key(7), 4),
          "rbg": jax.random.key(3, impl="rbg")}
  expected = host_copy(tree)
  _save(ckpt_dir, 1, tree)
  restored = _restore(ckpt_dir, _zeros_like(tree))
  assert_trees_equal(restored, expected)
  # The restored keys work as keys.
  np.testing.assert_array_equal(
      jax.random.uniform(restored["key"], (3,)),
      jax.random.uniform(expected["key"], (3,)))


def test_sharded_prng_keys_round_trip(ckpt_dir, assert_trees_equal,
                                      host_copy):
  sharding = NamedSharding(two_device_mesh(), P("x"))
  keys = jax.device_put(jax.random.split(jax.random.key(5), 4), sharding)
  expected = host_copy({"keys": keys})
  _save(ckpt_dir, 1, {"keys": keys})
  target = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=sharding)
  restored = _restore(ckpt_dir, {"keys": target})
  assert restored["keys"].sharding == sharding
  assert_trees_equal(restored, expected)


def test_restore_key_into_raw_uint32_target_is_refused(ckpt_dir):
  _save(ckpt_dir, 1, {"key": jax.random.key(42)})
  with pytest.raises(StructureMismatchError, match="'key'"):
    _restore(ckpt_dir, {"key": jnp.zeros((2,), jnp.uint32)})


def _trained_state(make_state, train_step):
  return train_step(train_step(make_state()))


def test_restore_into_abstract_sharded_target(ckpt_dir, make_state,
                                              train_step, assert_trees_equal,
                                              host_copy):
  state = _trained_state(make_state, train_step)
  expected = host_copy(state)
  _save(ckpt_dir, 2, state)

  mesh = two_device_mesh()
  def place(s):
    spec = P("x") if s.ndim else P()
    return jax.ShapeDtypeStruct(s.shape, s.dtype,
                                sharding=NamedSharding(mesh, spec))
  abstract = jax.tree.map(place, jax.eval_shape(make_state))
  restored = _restore(ckpt_dir, abstract)

  assert type(restored) is type(state)
  assert_trees_equal(restored, expected)
  for want, got in zip(jax.tree.leaves(abstract), jax.tree.leaves(restored)):
    assert got.sharding == want.sharding
  kernel = restored.params["params"]["Dense_0"]["kernel"]
  assert {s.device for s in kernel.addressable_shards} == set(mesh.devices)
  assert kernel.addressable_shards[0].data.shape == (4, 16)


@pytest.mark.parametrize("spec", [P("x"), P(None, "x")],
                         ids=["rows", "columns"])
def test_sharded_save_restores_on_one_device(ckpt_dir, assert_trees_equal,
                                             spec):
  values = _random_bits(np.float32, (6, 4), seed=5)
  sharded = jax.device_put(values, NamedSharding(two_device_mesh(), spec))
  assert len(sharded.addressable_shards) == 2
  _save(ckpt_dir, 1, {"w": sharded})

  one_device = SingleDeviceSharding(jax.devices()[1])
  restored = _restore(ckpt_dir, {"w": jax.ShapeDtypeStruct(
      (6, 4), jnp.float32, sharding=one_device)})
  assert restored["w"].sharding == one_device
  assert_trees_equal(restored, {"w": values})


@pytest.mark.parametrize("spec", [P("x"), P(None, "x"), P()],
                         ids=["rows", "columns", "replicated"])
def test_one_device_save_restores_sharded(ckpt_dir, assert_trees_equal,
                                          spec):
  values = _random_bits(np.float32, (6, 4), seed=6)
  _save(ckpt_dir, 1, {"w": jax.device_put(values, jax.devices()[0])})

  sharding = NamedSharding(two_device_mesh(), spec)
  restored = _restore(ckpt_dir, {"w": jax.device_put(
      np.zeros_like(values), sharding)})
  assert restored["w"].sharding == sharding
  assert_trees_equal(restored, {"w": values})
  for shard in restored["w"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])


def test_sharded_save_restores_with_other_sharding(ckpt_dir,
                                                   assert_trees_equal):
  values = _random_bits(np.int32, (4, 6), seed=7)
  mesh = two_device_mesh()
  _save(ckpt_dir, 1, {"w": jax.device_put(values,
                                          NamedSharding(mesh, P("x")))})
  target = jax.ShapeDtypeStruct((4, 6), jnp.int32,
                                sharding=NamedSharding(mesh, P(None, "x")))
  restored = _restore(ckpt_dir, {"w": target})
  assert restored["w"].sharding == target.sharding
  assert_trees_equal(restored, {"w": values})


def test_replicated_array_is_written_once(ckpt_dir):
  values = np.arange(8, dtype=np.float32)
  replicated = jax.device_put(values, NamedSharding(two_device_mesh(), P()))
  step_dir = _save(ckpt_dir, 1, {"w": replicated})
  assert os.path.getsize(step_dir / DATA_FILE) == values.nbytes


def test_manifest_is_json_and_data_file_holds_only_array_bytes(
    ckpt_dir, make_state, train_step):
  state = _trained_state(make_state, train_step)
  step_dir = _save(ckpt_dir, 2, state)

  manifest = json.loads((step_dir / "manifest.json").read_text())
  assert manifest["format"] == "flax_ckpt_plugin"
  assert manifest["format_version"] == 1
  assert manifest["step"] == 2
  paths = {leaf["path"] for leaf in manifest["leaves"]}
  assert {"step", "params/params/Dense_0/kernel",
          "params/params/Dense_1/bias",
          "opt_state/0/mu/params/Dense_0/kernel"} <= paths
  kernel = next(leaf for leaf in manifest["leaves"]
                if leaf["path"] == "params/params/Dense_0/kernel")
  assert kernel["dtype"] == "float32"
  assert kernel["shape"] == [8, 16]

  # Raw array bytes only: nothing pickled, no per-leaf headers.
  array_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
  assert os.path.getsize(step_dir / DATA_FILE) == array_bytes
  assert manifest["files"] == {"data/process_00000.bin": array_bytes}
  # The per-process shard tables were merged into the manifest.
  assert sorted(os.listdir(step_dir / "data")) == ["process_00000.bin"]


def test_data_file_is_raw_little_endian_c_order(ckpt_dir):
  values = np.arange(12, dtype=np.int32).reshape(3, 4) * 1000003
  step_dir = _save(ckpt_dir, 1, {"a": np.float32(1.0),
                                 "w": jnp.asarray(values)})
  manifest = json.loads((step_dir / "manifest.json").read_text())
  leaf = next(x for x in manifest["leaves"] if x["path"] == "w")
  (shard,) = leaf["shards"]
  with open(step_dir / shard["file"], "rb") as f:
    f.seek(shard["offset"])
    raw = f.read(shard["nbytes"])
  np.testing.assert_array_equal(
      np.frombuffer(raw, dtype="<i4").reshape(3, 4), values)


def test_structure_mismatch_names_leaf_and_both_sides(ckpt_dir):
  _save(ckpt_dir, 1, {"dense": {"kernel": jnp.zeros((512, 10))}})
  with pytest.raises(StructureMismatchError) as excinfo:
    _restore(ckpt_dir, {"dense": {"kernel": jnp.zeros((512, 20))}})
  assert str(excinfo.value) == ("leaf 'dense/kernel': checkpoint has"
                                " float32[512,10], target has float32[512,20]")


def test_missing_leaf_is_named(ckpt_dir):
  _save(ckpt_dir, 1, {"a": jnp.zeros(2)})
  with pytest.raises(StructureMismatchError, match="'b'"):
    _restore(ckpt_dir, {"a": jnp.zeros(2), "b": jnp.zeros(2)})


def _saved_step(ckpt_dir):
  step_dir = _save(ckpt_dir, 1, {"w": jnp.arange(16, dtype=jnp.float32)})
  return step_dir


def _truncate(text):
  return text[:-20]


def _future_version(text):
  return json.dumps(dict(json.loads(text), format_version=2))


def _foreign(text):
  del text
  return json.dumps({"format": "orbax", "format_version": 1})


@pytest.mark.parametrize("mutate,message", [
    (_truncate, "not valid JSON"),
    (_future_version, "format_version 2"),
    (_foreign, "not a flax_ckpt_plugin"),
])
def test_damaged_manifest_is_corruption_naming_the_file(ckpt_dir, mutate,
                                                        message):
  step_dir = _saved_step(ckpt_dir)
  manifest = step_dir / "manifest.json"
  manifest.write_text(mutate(manifest.read_text()))
  with pytest.raises(CheckpointCorruptedError) as excinfo:
    _restore(ckpt_dir, {"w": jnp.zeros(16)})
  assert str(manifest) in str(excinfo.value)
  assert message in str(excinfo.value)


def test_truncated_data_file_is_corruption(ckpt_dir):
  step_dir = _saved_step(ckpt_dir)
  data = step_dir / DATA_FILE
  with open(data, "r+b") as f:
    f.truncate(os.path.getsize(data) - 4)
  with pytest.raises(CheckpointCorruptedError) as excinfo:
    _restore(ckpt_dir, {"w": jnp.zeros(16)})
  assert str(data) in str(excinfo.value)
  assert "truncated" in str(excinfo.value)


def test_missing_data_file_is_corruption(ckpt_dir):
  step_dir = _saved_step(ckpt_dir)
  os.remove(step_dir / DATA_FILE)
  with pytest.raises(CheckpointCorruptedError) as excinfo:
    _restore(ckpt_dir, {"w": jnp.zeros(16)})
  assert "process_00000.bin" in str(excinfo.value)


def test_data_file_name_outside_step_dir_is_corruption(ckpt_dir):
  step_dir = _saved_step(ckpt_dir)
  manifest = step_dir / "manifest.json"
  content = json.loads(manifest.read_text())
  content["files"] = {"../../etc/passwd": 64}
  content["leaves"][0]["shards"][0]["file"] = "../../etc/passwd"
  manifest.write_text(json.dumps(content))
  with pytest.raises(CheckpointCorruptedError, match="files"):
    _restore(ckpt_dir, {"w": jnp.zeros(16)})


def test_unsupported_leaf_is_refused_synchronously(ckpt_dir):
  with CheckpointManager(ckpt_dir) as manager:
    with pytest.raises(TypeError, match="leaf 'name' has type str"):
      manager.save(1, {"name": "adam", "w": jnp.zeros(2)})
    assert not manager.save_in_progress
  assert flax_ckpt_plugin.CheckpointManager(ckpt_dir).all_steps() == []


def test_leaves_whose_paths_clash_are_refused_at_save(ckpt_dir):
  """'a/b' as one dict key and a/b as nested keys would share one manifest
  name, and one of the two values would be lost: save refuses instead."""
  manager = CheckpointManager(ckpt_dir)
  with pytest.raises(ValueError, match=r"same path 'a/b'"):
    manager.save(1, {"a/b": np.zeros(2), "a": {"b": np.ones(2)}})
  manager.close()
  assert [p.name for p in ckpt_dir.iterdir()] == ["_WRITER"]  # No step.
