"""Restored CPU shards copied by the runtime straight from the data file.

A restored region that is one run of bytes of one saved shard is mapped
from the file (its blocks checked there) and copied once into memory the
runtime owns (`placement._copied_from_file`); other regions are read into
memory made by a program. These tests restore real files onto the 2 CPU
devices, with the size past which shards take those ways lowered to 0 so
that small states take them, and check what a user sees: the values, that
the first train step may donate every restored shard, that no mapping of a
data file outlives the restore, and that damage in a mapped region fails
the restore naming the leaf, the file and the step.
"""

import contextlib
import json

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.restore import placement
from flax_ckpt_plugin.restore import data_files
from flax_ckpt_plugin.restore import reader as reader_lib
from flax_ckpt_plugin.arrays import copies as copies_lib
from flax_ckpt_plugin.backends import registry
from flax_ckpt_plugin.format import files

DATA = "data/process_00000.bin"


@pytest.fixture(name="mapped_regions")
def mapped_regions_fixture(monkeypatch):
  """Every shard takes the ways of large ones; returns the list of
  (leaf, region) that came from a mapping of the file (a spy on the real
  `LeafReader.mapped`)."""
  monkeypatch.setattr(copies_lib, "REUSE_BYTES", 0)
  seen = []
  real = reader_lib.LeafReader.mapped

  @contextlib.contextmanager
  def mapped(self, region):
    with real(self, region) as host:
      if host is not None:
        seen.append((self._where.rsplit("leaf ", 1)[1], region))  # pylint: disable=protected-access
      try:
        yield host
      finally:
        del host  # As the caller did: the mapping ends with the context.

  monkeypatch.setattr(reader_lib.LeafReader, "mapped", mapped)
  return seen


def _tree():
  rng = np.random.default_rng(7)
  return {
      "w": rng.standard_normal((64, 48), np.float32),
      "b16": rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16),
      "i8": rng.integers(-100, 100, (16, 8), np.int8),
      "scalar": np.float32(2.5),
      "count": np.int32(41),
      "step": 7,
  }


def _target(tree, mesh, spec):
  def leaf(a):
    if not isinstance(a, (np.ndarray, np.generic)):
      return a
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, spec if a.ndim == 2 else P()))
  return jax.tree.map(leaf, tree)


def _data_file_mappings(ckpt_dir) -> list[str]:
  with open("/proc/self/maps", encoding="utf-8") as f:
    return [line for line in f if str(ckpt_dir) in line]


_donating_step = jax.jit(lambda t: jax.tree.map(lambda a: a + 1, t),
                         donate_argnums=0)

# (mesh shape, axis names, spec of the 2-D leaves, whether their regions
# are runs of bytes of the saved shard): rows split over a 1-D mesh; the
# same on a 2-D (data, model) mesh; columns split (each region a strided
# part of the shard, read the other way); and replicated.
_LAYOUTS = {
    "rows_1d": ((2,), ("x",), P("x"), True),
    "rows_2d_data_model": ((2, 1), ("data", "model"), P("data", "model"),
                           True),
    "columns_2d_data_model": ((1, 2), ("data", "model"), P("data", "model"),
                              False),
    "replicated": ((2,), ("x",), P(), True),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_restored_shards_equal_the_saved_and_are_donated(
    layout, ckpt_dir, mapped_regions):
  shape, names, spec, runs = _LAYOUTS[layout]
  tree = _tree()
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, tree)
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(shape), names)
  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    restored = manager.restore(_target(tree, mesh, spec), 1)
  assert not _data_file_mappings(ckpt_dir)

  assert restored["step"] == 7
  for key in ("w", "b16", "i8", "scalar", "count"):
    assert restored[key].dtype == np.asarray(tree[key]).dtype, key
    np.testing.assert_array_equal(np.asarray(restored[key]), tree[key],
                                  err_msg=key)
  # Which regions came from a mapping: the 1-D leaves (and scalars) are
  # whole shards on each device, so always; the 2-D ones where a region is
  # one run of bytes.
  mapped = {(leaf.strip("'"), region) for leaf, region in mapped_regions}
  for key in ("scalar", "count"):
    assert (key, ()) in mapped
  for key in ("w", "b16", "i8"):
    regions = {r for leaf, r in mapped if leaf == key}
    assert bool(regions) == runs, (key, regions)

  arrays = {k: v for k, v in restored.items() if k != "step"}
  before = {k: sorted(s.data.unsafe_buffer_pointer()
                      for s in v.addressable_shards)
            for k, v in arrays.items()}
  after = _donating_step(arrays)
  for k, v in after.items():
    assert sorted(s.data.unsafe_buffer_pointer()
                  for s in v.addressable_shards) == before[k], k
    np.testing.assert_array_equal(
        np.asarray(v), (np.asarray(tree[k]) + 1).astype(v.dtype), err_msg=k)


def test_two_restores_never_share_memory(ckpt_dir, mapped_regions):
  tree = _tree()
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, tree)
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    first = manager.restore(_target(tree, mesh, P("x")), 1)
    second = manager.restore(_target(tree, mesh, P("x")), 1)
  assert mapped_regions
  pointers = [s.data.unsafe_buffer_pointer() for t in (first, second)
              for a in jax.tree.leaves(t) if isinstance(a, jax.Array)
              for s in a.addressable_shards]
  assert len(set(pointers)) == len(pointers)


def test_a_runtime_that_adopts_the_pages_gets_the_other_way(
    ckpt_dir, mapped_regions, monkeypatch):
  """Should the runtime adopt the file's pages instead of copying them
  (the real batched put, told it may: it adopts memory on a 64-byte
  boundary, which a page is), the restore makes the array the other way:
  no restored array may live in a mapping of the file."""
  real = placement._BATCHED_PUT  # pylint: disable=protected-access
  adopted = []

  def may_adopt(aval, sharding, pieces, devices, committed, force_copy=False):
    del force_copy
    out = real(aval, sharding, pieces, devices, committed, False)
    adopted.append(out.unsafe_buffer_pointer() == pieces[0].ctypes.data)
    return out

  monkeypatch.setattr(placement, "_BATCHED_PUT", may_adopt)
  tree = {"w": np.arange(4096 * 8, dtype=np.float32).reshape(4096, 8)}
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, tree)
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    restored = manager.restore(_target(tree, mesh, P("x")), 1)
  assert adopted and adopted[0]  # The fault happened.
  np.testing.assert_array_equal(np.asarray(restored["w"]), tree["w"])
  before = sorted(s.data.unsafe_buffer_pointer()
                  for s in restored["w"].addressable_shards)
  after = _donating_step(restored)
  assert sorted(s.data.unsafe_buffer_pointer()
                for s in after["w"].addressable_shards) == before
  assert not _data_file_mappings(ckpt_dir)


def test_a_flipped_byte_in_a_mapped_region_fails_the_restore(
    ckpt_dir, mapped_regions):
  """The damage is named (leaf, file, step); the step before still
  restores; with `verify=False` the damaged value comes back as it is."""
  values = np.random.default_rng(1).standard_normal((256, 64), np.float32)
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, {"w": values})
    manager.save(2, {"w": values})
  manifest = json.loads((ckpt_dir / "2" / files.MANIFEST).read_text())
  start = manifest["leaves"][0]["shards"][0]["offset"]
  flipped = 200 * 64 * 4 + 12  # In the rows of device 1.
  path = ckpt_dir / "2" / DATA
  with open(path, "r+b") as f:
    f.seek(start + flipped)
    byte = f.read(1)
    f.seek(start + flipped)
    f.write(bytes([byte[0] ^ 0x40]))
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  target = _target({"w": values}, mesh, P("x"))
  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    with pytest.raises(CheckpointCorruptedError) as info:
      manager.restore(target, 2)
    message = str(info.value)
    assert "step 2" in message and "leaf 'w'" in message, message
    assert "checksum mismatch" in message and DATA in message, message
    # The check that failed was the mapped way's.
    assert any(entry.name == "mapped" for entry in info.traceback)
    np.testing.assert_array_equal(
        np.asarray(manager.restore(target, 1)["w"]), values)
    damaged = np.asarray(manager.restore(target, 2, verify=False)["w"])
  assert not _data_file_mappings(ckpt_dir)
  differs = damaged.reshape(-1).view(np.uint8) != values.reshape(-1).view(
      np.uint8)
  assert np.flatnonzero(differs).tolist() == [flipped]


def test_a_range_past_the_file_is_not_mapped(tmp_path):
  path = tmp_path / "f.bin"
  path.write_bytes(bytes(range(256)) * 64)
  reader = data_files.ByteReader(tmp_path, {"f.bin": 256 * 64},
                                  registry.LOCAL)
  with reader.mapped("f.bin", 100, 50, 50) as view:
    assert bytes(view) == (bytes(range(256)) * 64)[100:150]
  with reader.mapped("f.bin", 256 * 64 - 10, 11, 11) as view:
    assert view is None
  assert reader.bytes_read == 50
  reader.close()
