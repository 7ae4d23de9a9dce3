"""Restoring into other dtypes with `cast=True` (`casting`)."""

import itertools
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StructureMismatchError
from flax_ckpt_plugin.restore import casting
from flax_ckpt_plugin.restore import matching
from flax_ckpt_plugin.format import records
from launcher import run_workers


def _save(directory, tree, step=1):
  with CheckpointManager(directory) as manager:
    manager.save(step, tree)


def _restore(directory, target, **kwargs):
  with CheckpointManager(directory, read_only=True) as manager:
    return manager.restore(target, **kwargs)


def _bits(x):
  x = np.asarray(x)
  return x.dtype, x.shape, x.tobytes()


def _to(dtype, sharding=None):
  """A target leaf like `x`, in `dtype` where `x` is floating."""
  def one(x):
    if isinstance(x, (int, float)) or not jnp.issubdtype(x.dtype,
                                                          jnp.floating):
      return x
    return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)
  return one


@pytest.fixture
def small_chunks(monkeypatch):
  """Pieces of 256 bytes: every leaf of the test states takes several."""
  monkeypatch.setattr(casting, "CHUNK_BYTES", 256)


def test_float32_train_state_into_bfloat16_equals_jax_conversion(
    ckpt_dir, make_state, train_step, small_chunks, caplog):
  state = train_step(make_state())  # Adam moments are not zero.
  saved = jax.tree.map(np.asarray, state)
  _save(ckpt_dir, state.replace(step=1), step=1)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  for sharding in (None, NamedSharding(mesh, P())):  # One device; both.
    target = jax.tree.map(_to(jnp.bfloat16, sharding), state.replace(step=0))
    with caplog.at_level(logging.INFO, logger="flax_ckpt_plugin"):
      caplog.clear()
      restored = _restore(ckpt_dir, target, cast=True)
    assert restored.step == 1
    leaves = jax.tree_util.tree_leaves_with_path(restored)
    expected = jax.tree.leaves(saved.replace(step=1))
    assert len(leaves) == len(expected) == 14
    for (path, got), want in zip(leaves, expected):
      if isinstance(want, int):
        continue
      if jnp.issubdtype(want.dtype, jnp.floating):
        want = jnp.asarray(want, jnp.bfloat16)
      assert _bits(got) == _bits(want), path  # Adam's count stays int32.
    assert "casting 12 of 14 leaves to the target's dtypes" in caplog.text


def test_a_sharded_target_reads_each_device_region_converted(
    ckpt_dir, small_chunks):
  """Saved whole, restored split over 2 devices along either axis: pieces
  of one region cross the saved shard's checksum blocks."""
  values = np.random.default_rng(0).standard_normal((64, 48)).astype(
      np.float32)
  _save(ckpt_dir, {"w": values})
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  for spec in (P("x", None), P(None, "x")):
    sharding = NamedSharding(mesh, spec)
    target = {"w": jax.ShapeDtypeStruct((64, 48), jnp.float16,
                                        sharding=sharding)}
    restored = _restore(ckpt_dir, target, cast=True)["w"]
    assert restored.sharding == sharding
    assert _bits(restored) == _bits(values.astype(np.float16))


def test_pieces_that_cross_checksum_blocks_are_verified_and_exact(
    ckpt_dir, monkeypatch):
  """A 12 MiB leaf (3 checksum blocks), in pieces of about 1 MB that start
  and end inside blocks, whole and split over 2 devices either way."""
  monkeypatch.setattr(casting, "CHUNK_BYTES", 1_000_000)
  values = np.random.default_rng(1).standard_normal((1536, 2048)).astype(
      np.float32)
  _save(ckpt_dir, {"w": values})
  expected = _bits(values.astype(jnp.bfloat16))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  for spec in (P(), P("x", None), P(None, "x")):
    target = {"w": jax.ShapeDtypeStruct(values.shape, jnp.bfloat16,
                                        sharding=NamedSharding(mesh, spec))}
    assert _bits(_restore(ckpt_dir, target, cast=True)["w"]) == expected


@pytest.mark.parametrize("saved_dtype,target_dtype", [
    (np.float16, np.float32), (jnp.bfloat16, np.float32),
    (np.float32, np.float64), (jnp.float8_e4m3fn, jnp.bfloat16),
    (np.int32, np.int64), (np.int8, np.int16), (np.uint16, np.int32),
])
def test_widening_casts_are_exact(ckpt_dir, small_chunks, saved_dtype,
                                  target_dtype):
  values = (np.arange(-60, 60) if jnp.issubdtype(saved_dtype, jnp.signedinteger)
            or jnp.issubdtype(saved_dtype, jnp.floating)
            else np.arange(0, 120) * 500).astype(saved_dtype).reshape(12, 10)
  _save(ckpt_dir, {"a": values})
  restored = _restore(ckpt_dir, {"a": np.zeros((12, 10), target_dtype)},
                      cast=True)["a"]
  assert isinstance(restored, np.ndarray) and restored.dtype == target_dtype
  np.testing.assert_array_equal(restored.astype(np.float64),
                                values.astype(np.float64))


def test_a_narrower_integer_holds_values_that_fit(ckpt_dir, small_chunks):
  values = np.arange(-500, 500, dtype=np.int64) * 1000
  _save(ckpt_dir, {"a": values})
  restored = _restore(ckpt_dir, {"a": jnp.zeros(1000, jnp.int32)},
                      cast=True)["a"]
  assert restored.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(restored), values)


def test_an_integer_the_target_cannot_hold_names_the_leaf(ckpt_dir):
  _save(ckpt_dir, {"counts": np.array([1, 2**40, 3], np.int64),
                   "small": np.array([-1, 2], np.int8)})
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, {"counts": np.zeros(3, np.int32),
                        "small": np.zeros(2, np.int8)}, cast=True)
  assert str(info.value) == (
      f"step 1 in {ckpt_dir / '1'}, leaf 'counts': checkpoint has int64[3],"
      " target has int32[3], which cannot hold the saved value 1099511627776"
      " (int32 holds [-2147483648, 2147483647]); restore it into a wider"
      " integer")
  with pytest.raises(StructureMismatchError, match=r"leaf 'small'.* -1 "):
    _restore(ckpt_dir, {"counts": np.zeros(3, np.int64),
                        "small": jnp.zeros(2, jnp.uint8)}, cast=True)


def test_such_a_step_is_not_taken_for_damage(ckpt_dir):
  """The callback's restore raises, and the step stays (not set aside)."""
  _save(ckpt_dir, {"n": np.array([2**40], np.int64)}, step=5)
  with CheckpointCallback(ckpt_dir, every_steps=10) as cb:
    with pytest.raises(StructureMismatchError, match="leaf 'n'"):
      cb.restore_or_initialize({"n": np.zeros(1, np.int32)}, cast=True)
    assert cb.manager.all_steps() == [5]
    restored = cb.restore_or_initialize({"n": np.zeros(1, np.int64)},
                                        cast=True)
  assert restored["n"][0] == 2**40 and cb.restored_step == 5


@pytest.mark.parametrize("saved,target,names", [
    (np.float32, np.int32, "floating to integer"),
    (np.complex64, np.float32, "complex to floating"),
    (np.bool_, np.uint8, "boolean to integer"),
    (np.int32, np.bool_, "integer to boolean"),
    (np.int32, np.float32, "integer to floating"),
])
def test_conversions_it_does_not_make_name_the_leaf_and_both_dtypes(
    ckpt_dir, saved, target, names):
  _save(ckpt_dir, {"x": np.ones(3, saved)})
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, {"x": np.zeros(3, target)}, cast=True)
  assert str(info.value) == (
      f"leaf 'x': checkpoint has {np.dtype(saved).name}[3], target has"
      f" {np.dtype(target).name}[3]: cast=True converts floating to floating"
      f" and integer to integer dtypes only, not {names}")


def test_prng_keys_are_not_cast(ckpt_dir):
  _save(ckpt_dir, {"rng": jax.random.key(0)})
  with pytest.raises(StructureMismatchError, match="leaf 'rng': checkpoint"
                     r" has uint32\[2\] \(key data of PRNG impl"):
    _restore(ckpt_dir, {"rng": np.zeros(2, np.uint32)}, cast=True)


def test_without_the_option_the_mismatch_names_it(ckpt_dir):
  _save(ckpt_dir, {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)})
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, {"w": jnp.zeros((4, 3), jnp.bfloat16),
                        "b": jnp.zeros(3)})
  assert str(info.value) == (
      "leaf 'w': checkpoint has float32[4,3], target has bfloat16[4,3];"
      " restore(..., cast=True) converts the dtype")
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, {"w": jnp.zeros((4, 3), jnp.bfloat16),
                        "b": jnp.zeros(3, jnp.int32)})
  assert str(info.value).endswith(
      "2 leaves differ in shape or dtype: leaf 'b': checkpoint has"
      " float32[3], target has int32[3]; leaf 'w': checkpoint has"
      " float32[4,3], target has bfloat16[4,3]; restore(..., cast=True)"
      " converts the dtypes of 1 of these leaves")
  # A conversion it would not make gets no hint.
  with pytest.raises(StructureMismatchError) as info:
    _restore(ckpt_dir, {"w": jnp.zeros((4, 3), jnp.int32), "b": jnp.zeros(3)})
  assert "cast=True" not in str(info.value)


def test_the_callback_restores_with_a_cast(ckpt_dir, make_state):
  state = make_state()
  with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
    cb(1, state.replace(step=1))
  target = jax.tree.map(_to(jnp.bfloat16), state)
  with CheckpointCallback(ckpt_dir, every_steps=1) as cb:
    with pytest.raises(StructureMismatchError, match="cast=True"):
      cb.restore_or_initialize(target)
    restored = cb.restore_or_initialize(target, cast=True)
  assert cb.restored_step == 1 and restored.step == 1
  assert _bits(restored.params["params"]["Dense_0"]["kernel"]) == _bits(
      jnp.asarray(state.params["params"]["Dense_0"]["kernel"], jnp.bfloat16))


@pytest.mark.parametrize("shape", [(), (7,), (5, 3, 4), (1, 1, 9), (0, 4)])
@pytest.mark.parametrize("limit", [4, 12, 40, 10**6])
def test_chunk_regions_are_consecutive_bounded_pieces(shape, limit):
  region = tuple((1, 1 + d) for d in shape)
  pieces = list(records.chunk_regions(region, 4, limit))
  full = np.arange(math.prod(shape)).reshape(shape)
  flat = []
  for piece in pieces:
    sizes = [hi - lo for lo, hi in piece]
    assert math.prod(sizes) * 4 <= max(limit, 4), piece
    flat.extend(full[tuple(slice(lo - 1, hi - 1) for lo, hi in piece)]
                .reshape(-1))
  assert flat == list(full.reshape(-1))  # Every element once, in C order.
  if math.prod(shape) * 4 <= limit:
    assert len(pieces) == (1 if math.prod(shape) else 0)


def test_refusal_rules():
  floats = [jnp.bfloat16, np.float16, np.float32, np.float64,
            jnp.float8_e4m3fn, jnp.float8_e5m2]
  for a, b in itertools.product(floats, floats):
    assert matching.refusal(np.dtype(a), np.dtype(b)) is None
  ints = [np.int8, np.uint8, np.int32, np.uint64, jnp.int4]
  for a, b in itertools.product(ints, ints):
    assert matching.refusal(np.dtype(a), np.dtype(b)) is None
  assert not casting.needs_check(np.dtype(np.int32), np.dtype(np.int64))
  assert not casting.needs_check(np.dtype(np.uint8), np.dtype(np.int16))
  assert casting.needs_check(np.dtype(np.int8), np.dtype(np.uint8))
  assert casting.needs_check(np.dtype(np.int64), np.dtype(np.int32))
  assert casting.needs_check(np.dtype(jnp.int8), np.dtype(jnp.int4))
  assert not casting.needs_check(np.dtype(jnp.int4), np.dtype(np.int8))
  assert not casting.needs_check(np.dtype(np.float32), np.dtype(np.float16))
  assert matching.refusal(np.dtype(np.float32), np.dtype(np.int32))
  assert matching.refusal(np.dtype(np.complex64), np.dtype(np.float32))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_processes_restore_a_sharded_state_cast_to_bfloat16(tmp_path):
  """2 processes x 2 devices: a float32 TrainState sharded over both
  processes restores with cast=True into bfloat16 together (shared
  reads), alone into another layout, and through a callback's local tier;
  every global array equals jnp.asarray(saved, jnp.bfloat16)."""
  results = run_workers("cast_restore", 2, args=[tmp_path], timeout=200)
  for r in results:
    out = r.json
    assert out["tier"] == "local", r.log()
    assert any("kernel" in k for k in out["expected"])
    for how in ("together", "alone", "callback"):
      assert out[how] == out["expected"], (how, r.log())
