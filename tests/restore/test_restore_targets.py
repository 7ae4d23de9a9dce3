"""A target that cannot hold a checkpoint's value is a mismatch, never damage.

Scalars restore only into targets of their kind that hold them, PRNG keys
only into keys of their impl, and big-endian numpy leaves by value, whatever
the byte order on either side.
"""

from __future__ import annotations

import json

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StructureMismatchError
from helpers import has_key_impl
from helpers import save_each as _save
from helpers import sorted_entries


def test_a_value_the_target_cannot_hold_is_a_mismatch_not_damage(ckpt_dir):
  """A Python int above 2**31 restored into a `jax.eval_shape` target
  (int32) is a StructureMismatchError: `restore_or_initialize` does not
  call the newest step damaged, rename it `2.damaged` and roll back to
  step 1."""
  _save(ckpt_dir, {"count": 7, "w": jnp.ones(3)},
        {"count": 2**40, "w": jnp.ones(3)})
  target = jax.eval_shape(lambda: {"count": 0, "w": jnp.zeros(3)})
  assert target["count"].dtype == jnp.int32
  cb = CheckpointCallback(ckpt_dir)
  with pytest.raises(StructureMismatchError) as info:
    cb.restore_or_initialize(target)
  cb.close()
  message = str(info.value)
  assert "leaf 'count'" in message and "Python int 1099511627776" in message
  assert "int32[]" in message and "cannot hold" in message
  assert sorted_entries(ckpt_dir) == ["1", "2"]  # Nothing set aside.


@pytest.mark.parametrize("saved, target, saved_desc, target_desc", [
    (0.7, 0, "Python float 0.7", "Python int"),
    (jnp.float32(2.5), 0, "float32[]", "Python int"),
    (np.float32(2.5), 0, "float32[]", "Python int"),
    (float("nan"), 0, "Python float nan", "Python int"),
    (float("inf"), jax.ShapeDtypeStruct((), jnp.int32), "Python float inf",
     "int32[]"),
    (3, 1.0, "Python int 3", "Python float"),
    (True, 1, "Python bool True", "Python int"),
    (1, np.bool_(False), "Python int 1", "bool[]"),
    (1e300, jax.ShapeDtypeStruct((), jnp.float32), "Python float 1e+300",
     "float32[], which cannot hold that value"),
    (-1, np.uint8(0), "Python int -1", "uint8[], which cannot hold"),
])
def test_a_scalar_restores_only_into_a_target_of_its_kind(
    ckpt_dir, saved, target, saved_desc, target_desc):
  """A scalar into a target of another kind (0.7 into an int, a value the
  target's dtype cannot hold) is a StructureMismatchError naming the leaf
  and both sides, never a silently rounded value or a raw
  ValueError/OverflowError naming nothing."""
  _save(ckpt_dir, {"x": saved})
  with CheckpointManager(ckpt_dir, read_only=True) as mgr:
    with pytest.raises(StructureMismatchError) as info:
      mgr.restore({"x": target})
  message = str(info.value)
  assert f"leaf 'x': checkpoint has {saved_desc}" in message, message
  assert f"target has {target_desc}" in message, message


@pytest.mark.parametrize("saved, target, expected, kind", [
    (3, jax.ShapeDtypeStruct((), jnp.int32), 3, jnp.int32),
    (0.5, jax.ShapeDtypeStruct((), jnp.bfloat16), 0.5, jnp.bfloat16),
    (2**40, 0, 2**40, int),
    (jnp.int32(-4), 0, -4, int),
    (np.float64(2.5), 1.0, 2.5, float),
    (np.float64(2.5), np.float64(0.0), 2.5, np.float64),
    (2.5, np.float64(0.0), 2.5, np.float64),
    (np.float32(1.5), np.float32(0.0), 1.5, np.float32),
    (True, jax.ShapeDtypeStruct((), jnp.bool_), True, jnp.bool_),
    (-128, np.int8(0), -128, np.int8),
])
def test_a_scalar_restores_into_any_target_of_its_kind_that_holds_it(
    ckpt_dir, saved, target, expected, kind):
  """The value, as the target's type: a Python scalar for a Python target,
  a numpy scalar of its dtype for a numpy one (`np.float64` is a Python
  float too, which once made it a KeyError), a JAX array of its dtype for
  a `ShapeDtypeStruct`."""
  _save(ckpt_dir, {"x": saved})
  with CheckpointManager(ckpt_dir, read_only=True) as mgr:
    got = mgr.restore({"x": target})["x"]
  assert got == expected
  if kind in (int, float) or issubclass(kind, np.generic):
    assert type(got) is kind, type(got)
  else:
    assert isinstance(got, jax.Array) and got.dtype == kind, got


@pytest.mark.parametrize("saved,other", [("philox4x32", "threefry2x32"),
                                         ("unsafe_rbg", "rbg")])
def test_prng_keys_restore_only_into_keys_of_their_impl(ckpt_dir, saved,
                                                         other):
  """Threefry and philox keys both hold two uint32 words, rbg and
  unsafe_rbg both four: the impl decides."""
  if not has_key_impl(saved):
    pytest.skip(f"this JAX has no {saved} keys")
  _save(ckpt_dir, {"key": jax.random.key(0, impl=saved)})
  with CheckpointManager(ckpt_dir, read_only=True) as mgr:
    with pytest.raises(StructureMismatchError, match="leaf 'key'"):
      mgr.restore({"key": jax.random.key(1, impl=other)})
    got = mgr.restore({"key": jax.random.key(1, impl=saved)})["key"]
  assert (jax.random.key_data(got) ==
          jax.random.key_data(jax.random.key(0, impl=saved))).all()


def test_big_endian_numpy_leaves_are_stored_little_endian(ckpt_dir):
  """A `>f4` numpy leaf is stored little-endian, as dtype float32, as the
  format page says (so its numpy reader returns the right values); a `>f4`
  target of a `float32` leaf of the same shape restores, in the target's
  byte order."""
  values = np.arange(8, dtype=">f4") / 3
  _save(ckpt_dir, {"big": values, "native": values.astype("<f4")})
  manifest = json.loads((ckpt_dir / "1" / "manifest.json").read_text())
  leaf = next(l for l in manifest["leaves"] if l["path"] == "big")
  assert leaf["dtype"] == "float32"
  (shard,) = leaf["shards"]
  raw = (ckpt_dir / "1" / shard["file"]).read_bytes()
  on_disk = np.frombuffer(raw[shard["offset"]:shard["offset"] + 32], "<f4")
  np.testing.assert_array_equal(on_disk, values)
  with CheckpointManager(ckpt_dir, read_only=True) as mgr:
    got = mgr.restore({"big": np.zeros(8, ">f4"),
                       "native": np.zeros(8, ">f4")})
    for name in ("big", "native"):  # Same values, the target's byte order.
      assert got[name].dtype == np.dtype(">f4")
      np.testing.assert_array_equal(got[name], values)
    with pytest.raises(StructureMismatchError,
                       match=r"checkpoint has float32\[8\], target has"
                       r" >f4\[4\]"):
      mgr.restore({"big": np.zeros(4, ">f4"), "native": values})


def test_a_big_endian_step_of_an_older_version_restores_into_jax(ckpt_dir):
  """Versions before 2026-11-24 05:40 UTC stored big-endian numpy leaves
  as `>f4`: such steps still restore, into numpy and jax targets alike.
  (A step created since that says `>f4` is damage: test_damaged_files.)"""
  values = np.arange(8, dtype=np.float32) / 3
  _save(ckpt_dir, {"x": values})
  path = ckpt_dir / "1" / "manifest.json"
  doc = json.loads(path.read_text())
  (shard,) = doc["leaves"][0]["shards"]
  doc["leaves"][0]["dtype"] = ">f4"
  doc["created_unix"] = 1795400000.0  # 2026-11-23, by the older writer.
  data = ckpt_dir / "1" / shard["file"]
  raw = bytearray(data.read_bytes())
  lo, hi = shard["offset"], shard["offset"] + shard["nbytes"]
  raw[lo:hi] = values.astype(">f4").tobytes()
  data.write_bytes(bytes(raw))
  shard["crc32c"] = [crc32c.crc32c(bytes(raw[lo:hi]))]
  path.write_text(json.dumps(doc))
  with CheckpointManager(ckpt_dir, read_only=True) as mgr:
    got = mgr.restore({"x": jax.ShapeDtypeStruct((8,), jnp.float32)})["x"]
    np.testing.assert_array_equal(np.asarray(got), values)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(mgr.restore({"x": values})["x"], values)
