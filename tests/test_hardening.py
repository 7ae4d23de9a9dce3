"""Never finalize what cannot be restored; a mismatch is never damage.

Each test names the finding of the hardening audit it covers, and what
happened before.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin.backends import backend as backend_lib
from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import ConcurrentWriterError
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin import SaveFailedError
from flax_ckpt_plugin import StructureMismatchError
from flax_ckpt_plugin.manager.retention import steps_to_delete
from flax_ckpt_plugin import Commit
from helpers import assert_only_finalized_steps
from helpers import FlakyDisk
from helpers import free_bytes
from helpers import fill
from helpers import sorted_entries
from launcher import run_workers

RUN_TIMEOUT = 120


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_processes_that_disagree_about_a_leaf_never_finalize(tmp_path):
  """Before: process 1 saving `w` as bfloat16 (process 0: float32), or each
  process sharding it by another PartitionSpec, finalized a step that could
  not be restored, and retention (max_to_keep=1) had already deleted the
  good one. Now the save fails on both processes naming the leaf and both
  views, and the good step stays."""
  p0, p1 = (r.json for r in run_workers(
      "hardening", 2, args=["disagree", tmp_path], timeout=RUN_TIMEOUT))
  for o in (p0, p1):
    assert set(o["errors"]) == {"dtype", "spec"}, o
    assert o["all_steps"] == [1], o
    assert o["restored"] == [1, True], o  # Bit for bit, every shard.
  dtype0, spec0 = p0["errors"]["dtype"], p0["errors"]["spec"]
  assert ("leaf 'w': process 0 (primary) saves float32[8,8], process 1 saves"
          " bfloat16[8,8]") in dtype0, dtype0
  assert "overlap" in spec0 and "process 0: " in spec0, spec0
  assert "process 1: " in spec0 and "Not finalized" in spec0, spec0
  for name in ("dtype", "spec"):  # Process 1 hears of it from the primary.
    assert p1["errors"][name].startswith("SaveFailedError"), p1["errors"]
    assert "leaf 'w'" in p1["errors"][name]
  assert_only_finalized_steps(tmp_path / "run", [1])


# -- a target that cannot hold a value is a mismatch, never damage ----------


def _save(directory, *states, **kwargs) -> None:
  with CheckpointManager(directory, **kwargs) as mgr:
    for step, state in enumerate(states, start=1):
      mgr.save(step, state)
      mgr.wait_until_finished()


def test_a_value_the_target_cannot_hold_is_a_mismatch_not_damage(ckpt_dir):
  """Before: a Python int above 2**31 restored into a `jax.eval_shape`
  target (int32) made `restore_or_initialize` call the newest step damaged,
  rename it `2.damaged` and roll back to step 1, with a warning only."""
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
  """Before: 0.7 into an int target gave 0, float32 2.5 gave 2, NaN or inf
  into an int raised a raw ValueError/OverflowError naming nothing."""
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


def test_prng_keys_restore_only_into_keys_of_their_impl(ckpt_dir):
  """Threefry and philox keys both hold two uint32 words: the impl decides."""
  _save(ckpt_dir, {"key": jax.random.key(0, impl="philox4x32")})
  with CheckpointManager(ckpt_dir, read_only=True) as mgr:
    with pytest.raises(StructureMismatchError, match="leaf 'key'"):
      mgr.restore({"key": jax.random.key(1, impl="threefry2x32")})
    got = mgr.restore({"key": jax.random.key(1, impl="philox4x32")})["key"]
  assert (jax.random.key_data(got) ==
          jax.random.key_data(jax.random.key(0, impl="philox4x32"))).all()


def test_big_endian_numpy_leaves_are_stored_little_endian(ckpt_dir):
  """Before: a `>f4` numpy leaf was stored big-endian, as dtype `>f4`,
  though the format page says little-endian (its numpy reader then returned
  wrong values); a `>f4` target of a `float32` leaf was refused with
  "checkpoint has float32[8], target has float32[8]"."""
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


# -- the save path on a full or changed disk ------------------------------------


def test_a_full_disk_fails_a_save_with_enospc_never_a_json_error(small_tmpfs):
  """Before: with the disk full while a process wrote its shard table, the
  unbuffered write wrote part of it and nobody checked, so the primary host
  failed the save with a JSONDecodeError. Now every failing save, at every
  fill level, raises OSError(ENOSPC), and the earlier step stays."""
  ckpt, filler = small_tmpfs / "ckpt", small_tmpfs / "filler"
  # Many tiny leaves: the shard table (tens of KiB) outweighs the data.
  state = {f"leaf_{i:03d}": np.full(2, i, np.float32) for i in range(300)}
  errors = []
  with CheckpointManager(ckpt, max_to_keep=1) as mgr:
    mgr.save(0, state)
    mgr.wait_until_finished()
    room = free_bytes(small_tmpfs)
    step = 1
    for left in range(0, 320 << 10, 4 << 10):
      fill(filler, room - left)
      try:
        mgr.save(step, state)
        mgr.wait_until_finished()
        step += 1
      except OSError as e:
        errors.append(e)
        assert e.errno == errno.ENOSPC, repr(e)
      except Exception as e:  # pylint: disable=broad-except
        pytest.fail(f"with {left} bytes free: {e!r}")
      finally:
        os.remove(filler)
    steps = mgr.all_steps()
  assert errors and step > 1  # Both outcomes were seen.
  assert sorted_entries(ckpt) == [str(steps[-1])]


@pytest.mark.parametrize("recreate", [True, False])
def test_a_deleted_directory_is_claimed_again(ckpt_dir, recreate):
  """Before: after the checkpoint directory was deleted (and made anew),
  every later save raised `ConcurrentWriterError ... (its claim: None)`."""
  with CheckpointManager(ckpt_dir, max_to_keep=2) as mgr:
    mgr.save(1, {"w": np.ones(3)})
    mgr.wait_until_finished()
    shutil.rmtree(ckpt_dir)
    if recreate:
      ckpt_dir.mkdir()
    for step in (2, 3, 4):
      mgr.save(step, {"w": np.full(3, step)})
      mgr.wait_until_finished()
    assert mgr.all_steps() == [3, 4]
    token = mgr.name.rsplit("/", 1)[1]
  assert sorted_entries(ckpt_dir) == ["3", "4"]
  claim = json.loads((ckpt_dir / "_WRITER").read_text())
  assert claim["token"] == token


class _NoDeletes(backend_lib.LocalBackend):
  """Retention fails (injected: a real disk refuses no unlink as root)."""

  def delete_step(self, directory, step):
    raise PermissionError(f"cannot delete step {step} (injected)")


def test_error_notes_tell_whether_the_step_was_finalized(ckpt_dir):
  """Before: every background error said "That step was not finalized",
  also for a retention error after the step was."""
  with CheckpointManager(ckpt_dir, max_to_keep=1,
                         commit=Commit(backend=_NoDeletes())) as mgr:
    mgr.save(1, {"w": np.ones(3)})
    mgr.wait_until_finished()
    mgr.save(2, {"w": np.ones(3)})
    with pytest.raises(PermissionError) as info:
      mgr.wait_until_finished()
    notes = " ".join(info.value.__notes__)
    assert f"Step 2 is finalized in {ckpt_dir}." in notes, notes
    assert "not finalized" not in notes
  flaky = FlakyDisk()
  with CheckpointManager(ckpt_dir, commit=Commit(backend=flaky)) as mgr:
    flaky.on_fire = True
    mgr.save(3, {"w": np.ones(3)})
    with pytest.raises(OSError) as info:
      mgr.wait_until_finished()
    assert "Step 3 was not finalized." in info.value.__notes__, info.value
    flaky.on_fire = False


def test_symlinked_step_entries_are_skipped_with_a_warning(
    tmp_path, caplog):
  """Before: a symbolic link named like a step (to a step elsewhere) or
  like `<n>.partial` made retention fail and every later writing open fail
  (removing it raised). Now links are ignored with a warning and nothing
  they point to is touched."""
  elsewhere = tmp_path / "elsewhere"
  _save(elsewhere, {"w": np.ones(3)}, {"w": np.ones(3)})
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "1").symlink_to(elsewhere / "1")
  (ckpt / "7.partial").symlink_to(elsewhere / "2")
  with caplog.at_level(logging.WARNING, logger="flax_ckpt_plugin"):
    with CheckpointManager(ckpt, max_to_keep=1) as mgr:
      assert mgr.all_steps() == []
      for step in (2, 3):
        mgr.save(step, {"w": np.full(3, step)})
        mgr.wait_until_finished()
      assert mgr.all_steps() == [3]
  assert sorted_entries(ckpt) == ["1", "3", "7.partial"]
  assert sorted_entries(elsewhere) == ["1", "2"]
  assert "symbolic link" in caplog.text and "7.partial" in caplog.text


def test_an_unreadable_claim_is_not_taken_for_a_deleted_one(ckpt_dir):
  """A claim that exists but cannot be read (replaced by hand) is an error,
  not a reason to claim the directory over it."""
  with CheckpointManager(ckpt_dir) as mgr:
    (ckpt_dir / "_WRITER").write_text("not json")
    mgr.save(1, {"w": np.ones(3)})
    with pytest.raises(ConcurrentWriterError, match="cannot be read"):
      mgr.wait_until_finished()
  assert (ckpt_dir / "_WRITER").read_text() == "not json"


def test_a_manifest_over_the_read_limit_is_never_finalized(
    ckpt_dir, monkeypatch):
  """The limit is lowered (injected) to what a small state exceeds: a save
  whose manifest a restore would refuse fails instead of finalizing."""
  with CheckpointManager(ckpt_dir) as mgr:
    mgr.save(1, {"w": np.ones(3)})
    mgr.wait_until_finished()
    monkeypatch.setattr(manifest_lib, "MAX_MANIFEST_BYTES", 200)
    mgr.save(2, {"w": np.ones(3)})
    with pytest.raises(SaveFailedError, match="over the 200"):
      mgr.wait_until_finished()
    assert mgr.all_steps() == [1]


def test_a_big_endian_step_of_an_older_version_restores_into_jax(ckpt_dir):
  """Versions before 2026-11-24 05:40 UTC stored big-endian numpy leaves
  as `>f4`: such steps still restore, into numpy and jax targets alike.
  (A step created since that says `>f4` is damage: test_reliability.)"""
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


def test_retention_keeps_the_newest_step_known_to_restore():
  assert steps_to_delete([1, 6], 1, None) == [1]
  assert steps_to_delete([1, 6], 1, None, protect=1) == []
  assert steps_to_delete([1, 6, 8], 1, None, protect=6) == [1]
