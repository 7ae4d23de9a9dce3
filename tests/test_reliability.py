"""Reliability: full disks, damaged and hostile files, two writers, fallback.

What a user relies on when things go wrong, tested as the user sees it:

* a full disk fails the save loudly at the next call, leaves nothing behind,
  and the loop goes on once there is space again;
* a damaged or hostile checkpoint is a `CheckpointCorruptedError` that names
  the file (and, for data, the step and the leaf), never another exception,
  a hang, or a read outside the step directory; other steps still restore;
* two jobs writing one directory: the newest claim wins, the older job gets
  `ConcurrentWriterError` and neither corrupts the other's steps; a read-only
  evaluation job disturbs nothing;
* `restore_or_initialize` falls back to the newest good step, with every
  process agreeing on which;
* a save fsyncs its files and directories in an order that makes the commit
  marker the last thing to become durable.

`docs/reliability.md` lists the guarantees and where each is tested.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import threading
from typing import Any, Callable

from hypothesis import example
from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import CheckpointNotFoundError
from flax_ckpt_plugin import ConcurrentWriterError
from flax_ckpt_plugin.format import storage
from flax_ckpt_plugin import StructureMismatchError
from flax_ckpt_plugin import Commit
from helpers import fill
from helpers import free_bytes
from helpers import two_device_mesh
from launcher import run_workers

DATA = "data/process_00000.bin"
# One run of real worker processes: jax starts in ~3 s per process on this
# 2-core machine; the rest is a few tiny saves and restores.
RUN_TIMEOUT = 120


def _entries(directory: pathlib.Path) -> list[str]:
  return sorted(os.listdir(directory))


def _flip_byte(path: pathlib.Path, offset: int) -> None:
  """Inverts every bit of one byte, as a disk or a copy gone bad would."""
  with open(path, "r+b") as f:
    f.seek(offset)
    (byte,) = f.read(1)
    f.seek(offset)
    f.write(bytes([byte ^ 0xFF]))


def _small_state(seed: int) -> dict[str, Any]:
  """A few leaves of every kind the format stores.

  A float32 matrix sharded over the 2 CPU devices (two shards), a bfloat16
  vector, a jax int32 scalar, and Python float and int leaves (which live in
  the manifest, without data bytes).
  """
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((8, 4), dtype=np.float32)
  return {
      "w": jax.device_put(w, NamedSharding(two_device_mesh(), P("x"))),
      "v": jnp.asarray(rng.standard_normal(6), jnp.bfloat16),
      "n": jnp.int32(rng.integers(1000)),
      "lr": float(rng.uniform()),
      "count": int(rng.integers(1000)),
  }


def _small_target() -> dict[str, Any]:
  """An abstract restore target for `_small_state`, `w` sharded as saved."""
  return {
      "w": jax.ShapeDtypeStruct(
          (8, 4), jnp.float32,
          sharding=NamedSharding(two_device_mesh(), P("x"))),
      "v": jax.ShapeDtypeStruct((6,), jnp.bfloat16),
      "n": jax.ShapeDtypeStruct((), jnp.int32),
      "lr": 0.0,
      "count": 0,
  }


def _save_steps(directory: pathlib.Path, states: dict[int, Any],
                **kwargs) -> None:
  with CheckpointManager(directory, max_to_keep=None, **kwargs) as manager:
    for step, state in states.items():
      manager.save(step, state)
      manager.wait_until_finished()


def _restore(directory: pathlib.Path, target: Any, step: int,
             **kwargs) -> Any:
  # Read-only: restoring must never need write access, and a read-only
  # manager never touches the directory.
  with CheckpointManager(directory, read_only=True) as manager:
    return manager.restore(target, step, **kwargs)


def _leaf(manifest: dict, path: str) -> dict:
  return next(l for l in manifest["leaves"] if l["path"] == path)


def _edit_manifest(step_dir: pathlib.Path,
                   edit: Callable[[dict], None]) -> None:
  manifest = json.loads((step_dir / storage.MANIFEST).read_text())
  edit(manifest)
  (step_dir / storage.MANIFEST).write_text(json.dumps(manifest))


# -- 1. A full disk ----------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_full_disk_fails_the_save_at_the_next_call_and_the_loop_recovers(
    small_tmpfs, assert_trees_equal, host_copy):
  """A save that runs out of space (a real ENOSPC from an 8 MiB tmpfs).

  The callback's save returns before writing; the write fails in the
  background; the next call into the callback raises that OSError, type and
  errno kept. The failed step leaves no `.partial` behind, the step before it
  restores bit for bit, and once space is freed the loop saves again.
  """
  ckpt = small_tmpfs / "ckpt"
  rng = np.random.default_rng(0)
  small = {"w": jnp.asarray(rng.standard_normal((64, 64), np.float32))}
  small_expected = host_copy(small)
  # 2 MiB: fits in the tmpfs, but not in what the filler leaves free.
  large = {"w": jnp.asarray(rng.standard_normal((512, 1024), np.float32))}
  large_expected = host_copy(large)

  cb = CheckpointCallback(ckpt, every_steps=1, max_to_keep=3)
  assert cb(1, small)
  cb.wait_until_finished()
  filler = small_tmpfs / "filler"
  fill(filler, free_bytes(small_tmpfs) - (1 << 20))
  assert free_bytes(small_tmpfs) < large["w"].nbytes

  assert cb(2, large)  # Only the host snapshot: the write runs behind.
  with pytest.raises(OSError) as info:
    cb(3, large)
  assert info.value.errno == errno.ENOSPC, info.value
  assert "ASYNCHRONOUSLY" in " ".join(info.value.__notes__)
  assert "step 2" in " ".join(info.value.__notes__)
  # Nothing of step 2 is left, step 3 was not started, step 1 is intact.
  assert _entries(ckpt) == ["1", "_WRITER"]
  assert cb.manager.all_steps() == [1]
  assert_trees_equal(cb.manager.restore({"w": jnp.zeros((64, 64))}, 1),
                     small_expected)

  os.remove(filler)
  assert cb(4, large)  # The error was raised once; the loop goes on.
  cb.close()
  assert _entries(ckpt) == ["1", "4", "_WRITER"]
  assert_trees_equal(_restore(ckpt, {"w": jnp.zeros((512, 1024))}, 4),
                     large_expected)


# -- 2. Damaged and hostile input ----------------------------------------------


@pytest.fixture
def two_steps(ckpt_dir, host_copy):
  """Steps 1 and 2 of `_small_state` in `ckpt_dir`; their expected values."""
  states = {1: _small_state(1), 2: _small_state(2)}
  expected = {s: host_copy(t) for s, t in states.items()}
  _save_steps(ckpt_dir, states)
  return expected


def _truncate_manifest(step_dir, outside):
  del outside
  text = (step_dir / storage.MANIFEST).read_text()
  (step_dir / storage.MANIFEST).write_text(text[:len(text) // 2])


def _invalid_json(step_dir, outside):
  del outside
  (step_dir / storage.MANIFEST).write_text('{"format": "flax_ckpt_plugin",,}')


def _not_utf8(step_dir, outside):
  del outside
  text = (step_dir / storage.MANIFEST).read_bytes()
  (step_dir / storage.MANIFEST).write_bytes(b"\xff\xfe" + text)


def _deeply_nested(step_dir, outside):
  del outside
  (step_dir / storage.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)


def _edit(edit):
  def damage(step_dir, outside):
    del outside
    _edit_manifest(step_dir, edit)
  return damage


def _set_version(m):
  m["format_version"] = 2


def _absurd_shape(m):
  _leaf(m, "w")["shape"] = [2**61]


def _absurd_shape_2d(m):
  # Each dimension is allowed; their product is 2**122 elements.
  _leaf(m, "w")["shape"] = [2**61, 2**61]


def _negative_dim(m):
  _leaf(m, "w")["shape"] = [-8, 4]


def _shard_field(field, value):
  def edit(m):
    _leaf(m, "w")["shards"][1][field] = value
  return edit


def _overlapping_shards(m):
  # Rows [2, 6) overlap the first shard's [0, 4); the size still fits.
  _leaf(m, "w")["shards"][1]["index"] = [[2, 6], [0, 4]]


def _drop_checksums(m):
  del _leaf(m, "w")["shards"][0]["crc32c"]


def _drop_checksum_table(m):
  del m["checksum"]


def _point_file_at(name):
  """Every shard (and the files table, same size) now names file `name`."""
  def edit(m):
    m["files"] = {name: m["files"][DATA]}
    for leaf in m["leaves"]:
      for shard in leaf.get("shards", []):
        shard["file"] = name
  return edit


def _dotdot_to_step_1(step_dir, outside):
  # Step 1's data file is genuine and of the right size: only the path is bad.
  del outside
  _edit_manifest(step_dir, _point_file_at(f"../1/{DATA}"))


def _absolute_to_step_1(step_dir, outside):
  del outside
  _edit_manifest(step_dir,
                 _point_file_at(str(step_dir.parent / "1" / DATA)))


def _symlinked_data_file(step_dir, outside):
  # The file outside holds exactly the right bytes: only where it is matters.
  shutil.copy(step_dir / DATA, outside / "copy.bin")
  os.remove(step_dir / DATA)
  os.symlink(outside / "copy.bin", step_dir / DATA)


def _symlinked_data_dir(step_dir, outside):
  shutil.copytree(step_dir / "data", outside / "data")
  shutil.rmtree(step_dir / "data")
  os.symlink(outside / "data", step_dir / "data")


def _file_is_a_directory(step_dir, outside):
  del outside
  # The manifest keeps the data file's size, so whether the directory's
  # st_size (4096 on ext4, less on tmpfs) looks large enough must not matter.
  _edit_manifest(step_dir, _point_file_at("data"))


def _file_name_not_a_string(m):
  _leaf(m, "w")["shards"][0]["file"] = [DATA]


def _file_under_a_file(step_dir, outside):
  del outside
  _edit_manifest(step_dir, _point_file_at(f"{DATA}/x"))


def _file_name_with_nul(step_dir, outside):
  del outside
  _edit_manifest(step_dir, _point_file_at("data/x\x00y"))


def _file_name_too_long(step_dir, outside):
  del outside
  _edit_manifest(step_dir, _point_file_at("x" * 300))  # NAME_MAX is 255.


def _huge_scalar(path, value):
  def edit(m):
    _leaf(m, path)["value"] = value
  return edit


def _dtype_named(name):
  def edit(m):
    _leaf(m, "w")["dtype"] = name
  return edit


def _manifest_at(step_dir):
  return str(step_dir / storage.MANIFEST)


def _data_at(step_dir):
  return str(step_dir / DATA)


# (damage, where the message must point, substrings of the message)
_HOSTILE_CASES = {
    "truncated_manifest": (_truncate_manifest, _manifest_at,
                           ["not valid JSON"]),
    "invalid_json": (_invalid_json, _manifest_at, ["not valid JSON"]),
    "manifest_not_utf8": (_not_utf8, _manifest_at, []),
    "manifest_nested_100k_deep": (_deeply_nested, _manifest_at, []),
    "unknown_format_version": (_edit(_set_version), _manifest_at,
                               ["format_version 2"]),
    "shape_2_pow_61": (_edit(_absurd_shape), _manifest_at, ["leaf 'w'"]),
    "shape_product_2_pow_122": (_edit(_absurd_shape_2d), _manifest_at,
                                ["leaf 'w'"]),
    "negative_dimension": (_edit(_negative_dim), _manifest_at,
                           ["leaf 'w'", "bad shape"]),
    "negative_offset": (_edit(_shard_field("offset", -64)), _manifest_at,
                        ["leaf 'w'"]),
    "huge_offset": (_edit(_shard_field("offset", 2**70)), _manifest_at,
                    ["leaf 'w'"]),
    "negative_nbytes": (_edit(_shard_field("nbytes", -64)), _manifest_at,
                        ["leaf 'w'"]),
    "huge_nbytes": (_edit(_shard_field("nbytes", 2**61)), _manifest_at,
                    ["leaf 'w'"]),
    "overlapping_shards": (_edit(_overlapping_shards), _manifest_at,
                           ["leaf 'w'", "overlap"]),
    "missing_crc32c_list": (_edit(_drop_checksums), _manifest_at,
                            ["leaf 'w'", "crc32c"]),
    "missing_checksum_table": (_edit(_drop_checksum_table), _manifest_at,
                               ["checksum"]),
    "file_name_with_dotdot": (_dotdot_to_step_1, _manifest_at, ["files"]),
    "absolute_file_name": (_absolute_to_step_1, _manifest_at, ["files"]),
    "file_name_not_a_string": (_edit(_file_name_not_a_string), _manifest_at,
                               ["leaf 'w'"]),
    # The data files hold little-endian values: '>f4' would read float32
    # bytes backwards, and 'f4' is a name no writer writes.
    "big_endian_dtype": (_edit(_dtype_named(">f4")), _manifest_at,
                         ["leaf 'w'", "dtype '>f4' is not one the format"]),
    "dtype_name_not_written": (_edit(_dtype_named("f4")), _manifest_at,
                               ["leaf 'w'", "dtype 'f4'"]),
    "huge_python_float_value": (_edit(_huge_scalar("lr", 10**400)),
                                _manifest_at, ["leaf 'lr'"]),
    "infinite_python_int_value": (_edit(_huge_scalar("count", float("inf"))),
                                  _manifest_at, ["leaf 'count'"]),
    "data_file_symlink_leads_outside": (_symlinked_data_file, _data_at,
                                        ["outside the step directory"]),
    "data_dir_symlink_leads_outside": (_symlinked_data_dir, _data_at,
                                       ["outside the step directory"]),
    "file_is_a_directory": (_file_is_a_directory,
                            lambda d: str(d / "data"), []),
    "file_under_a_regular_file": (_file_under_a_file,
                                  lambda d: str(d / DATA), []),
    # Refused by the manifest check or when opened: either names the step.
    "file_name_with_nul_byte": (_file_name_with_nul, str, []),
    "file_name_too_long": (_file_name_too_long, str, []),
}


@pytest.mark.parametrize("case", list(_HOSTILE_CASES))
def test_hostile_or_damaged_manifest_is_a_clear_corruption_error(
    ckpt_dir, tmp_path, two_steps, assert_trees_equal, case):
  """Each damage of step 2 is a CheckpointCorruptedError naming the file.

  Never an IndexError, KeyError, TypeError, OverflowError, MemoryError or
  other OSError; never a read of a file outside the step directory (the
  cases that point outside name files with exactly the right bytes, so only
  the refusal keeps them out). Step 1 restores bit for bit afterwards.
  """
  damage, where, fragments = _HOSTILE_CASES[case]
  outside = tmp_path / "outside"
  outside.mkdir()
  step_dir = ckpt_dir / "2"
  damage(step_dir, outside)
  with pytest.raises(CheckpointCorruptedError) as info:
    _restore(ckpt_dir, _small_target(), 2)
  message = str(info.value)
  assert where(step_dir) in message, message
  for fragment in fragments:
    assert fragment in message, message
  assert_trees_equal(_restore(ckpt_dir, _small_target(), 1), two_steps[1])


def test_a_byte_swapped_dtype_falls_back_to_the_older_step(
    ckpt_dir, two_steps, assert_trees_equal, caplog):
  """A manifest whose float32 leaf says '>f4' restored step 2 with other
  values before; now the newest valid step is step 1, and the warning
  names step 2, its manifest and the leaf."""
  _edit_manifest(ckpt_dir / "2", _dtype_named(">f4"))
  with caplog.at_level(logging.WARNING):
    with CheckpointManager(ckpt_dir, read_only=True) as manager:
      step, restored = manager.restore_newest_valid(_small_target())
  assert step == 1
  assert_trees_equal(restored, two_steps[1])
  warned = "\n".join(r.getMessage() for r in caplog.records)
  assert str(ckpt_dir / "2" / storage.MANIFEST) in warned, warned
  assert "leaf 'w'" in warned and "'>f4'" in warned, warned


def _w_shard(step_dir: pathlib.Path, n: int) -> dict:
  manifest = json.loads((step_dir / storage.MANIFEST).read_text())
  return _leaf(manifest, "w")["shards"][n]


def _flip_in_w(step_dir):
  shard = _w_shard(step_dir, 1)
  _flip_byte(step_dir / shard["file"], shard["offset"] + 5)


def _truncate_data(step_dir):
  size = os.path.getsize(step_dir / DATA)
  with open(step_dir / DATA, "r+b") as f:
    f.truncate(size - 10)


def _remove_data(step_dir):
  os.remove(step_dir / DATA)


@pytest.mark.parametrize("damage,fragment", [
    (_flip_in_w, "leaf 'w': checksum mismatch"),
    (_truncate_data, "truncated"),
    (_remove_data, "missing"),
], ids=["flipped_byte", "truncated_data_file", "missing_data_file"])
def test_damaged_data_file_error_names_file_step_and_leaf(
    ckpt_dir, two_steps, assert_trees_equal, damage, fragment):
  """Damaged data bytes: the error says which file, which step, which leaf.

  A flipped byte is found by the CRC-32C of its block; a short or missing
  file before any byte of it is used.
  """
  step_dir = ckpt_dir / "2"
  damage(step_dir)
  with pytest.raises(CheckpointCorruptedError) as info:
    _restore(ckpt_dir, _small_target(), 2)
  message = str(info.value)
  assert fragment in message, message
  assert "process_00000.bin" in message and str(step_dir) in message, message
  assert "step 2" in message, message
  assert re.search(r"leaf '\w+'", message), message
  assert_trees_equal(_restore(ckpt_dir, _small_target(), 1), two_steps[1])


@pytest.mark.timeout(120)
def test_data_file_that_is_a_fifo_does_not_hang_restore(ckpt_dir, two_steps):
  """A named pipe where a data file should be: refused, not waited on.

  Opening a FIFO for reading blocks until a writer appears, which for a
  hostile checkpoint is never. The restore runs in a thread; if it is still
  blocked after the deadline, the test opens the FIFO's write end itself to
  let it go, and fails.
  """
  del two_steps
  fifo = ckpt_dir / "2" / DATA
  os.remove(fifo)
  os.mkfifo(fifo)
  outcome = {}

  def restore():
    try:
      _restore(ckpt_dir, _small_target(), 2)
      outcome["error"] = None
    except Exception as e:  # pylint: disable=broad-except
      outcome["error"] = e

  thread = threading.Thread(target=restore, daemon=True)
  thread.start()
  thread.join(15)  # A tiny restore takes well under a second.
  hung = thread.is_alive()
  if hung:  # Release the reader blocked in open().
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    thread.join(30)
  assert not hung, "restore blocked opening a FIFO named as a data file"
  assert isinstance(outcome["error"], CheckpointCorruptedError), outcome
  assert str(fifo) in str(outcome["error"])


# 3000 x 1024 float32 = 12,288,000 bytes: three 4 MiB checksum blocks.
_LARGE_SHAPE = (3000, 1024)
_LARGE_NBYTES = 3000 * 1024 * 4


def test_flipped_byte_in_a_partially_read_large_shard(ckpt_dir):
  """A large shard read in parts (one per target device) is still verified.

  Step 1 and 2 hold one 12 MB float32 shard each (written from one device):
  three 4 MiB checksum blocks. The target is sharded by rows over the 2 CPU
  devices, so each device reads half of the shard: rows [0, 1500) are bytes
  [0, 6144000) of the shard, which end inside block 1 ([4194304, 8388608)
  from the shard's start, which the manifest gives).

  The flipped byte of step 2 is at byte 7,000,000 of the shard, in rows
  device 1 reads,
  but inside block 1. With `verify=True` a partial read checks whole blocks,
  so the damage is caught (on device 0's read already); each block is read
  once for both devices, so no byte is read twice.

  With `verify=False` the restore reads exactly the bytes each device
  needs, checks nothing, and returns the damaged value: the result differs
  from what was saved in exactly the flipped byte.
  """
  values = np.random.default_rng(3).standard_normal(_LARGE_SHAPE,
                                                    np.float32)
  one_device = jax.device_put(values, jax.devices()[0])
  _save_steps(ckpt_dir, {1: {"w": one_device}, 2: {"w": one_device}})
  manifest = json.loads((ckpt_dir / "2" / storage.MANIFEST).read_text())
  start = manifest["leaves"][0]["shards"][0]["offset"]
  flipped = 7_000_000
  _flip_byte(ckpt_dir / "2" / DATA, start + flipped)
  sharding = NamedSharding(two_device_mesh(), P("x"))
  target = {"w": jax.ShapeDtypeStruct(_LARGE_SHAPE, jnp.float32,
                                      sharding=sharding)}

  with CheckpointManager(ckpt_dir, read_only=True) as manager:
    good = manager.restore(target, 1)
    np.testing.assert_array_equal(np.asarray(good["w"]), values)
    assert manager.last_restore_stats.nbytes_read == _LARGE_NBYTES

    with pytest.raises(CheckpointCorruptedError) as info:
      manager.restore(target, 2)
    message = str(info.value)
    assert "step 2" in message and "leaf 'w'" in message, message
    assert "checksum mismatch in data/process_00000.bin" in message, message
    block_1 = f"[{start + 4194304}, {start + 8388608})"
    assert block_1 in message, message

    unverified = manager.restore(target, 2, verify=False)
    assert manager.last_restore_stats.nbytes_read == _LARGE_NBYTES
  assert unverified["w"].sharding == sharding
  got = np.asarray(unverified["w"]).reshape(-1).view(np.uint8)
  want = values.reshape(-1).view(np.uint8)
  assert np.flatnonzero(got != want).tolist() == [flipped]
  assert got[flipped] == want[flipped] ^ 0xFF


# -- 3. Property: any manifest mutation is harmless or a clear error ---------


class _BaseCheckpoint:
  """A finalized step 1 of `_small_state(1)`, its manifest and host values."""

  def __init__(self, directory: pathlib.Path):
    state = _small_state(1)
    self.directory = directory
    self.expected = jax.tree.map(
        lambda x: np.array(x) if isinstance(x, jax.Array) else x, state)
    _save_steps(directory, {1: state})
    self.manifest = json.loads(
        (directory / "1" / storage.MANIFEST).read_text())

  def __repr__(self) -> str:  # Hypothesis prints it with every failure.
    return f"_BaseCheckpoint({str(self.directory)!r})"


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
  # Module scope: one checkpoint for all examples (each restores the
  # manifest it mutated), and no function-scoped fixture under @given.
  return _BaseCheckpoint(tmp_path_factory.mktemp("property") / "ckpt")


_INTERESTING_INTS = [0, 1, -1, 2**31, 2**32, 2**61, 2**62, 2**63, 2**64,
                     -2**63, 10**400, storage.CHECKSUM_BLOCK]
_INTERESTING_STRINGS = [
    "", ".", "..", "../x", "/etc/passwd", "data", DATA, "data/../../1",
    "manifest.json", "_COMMITTED", "float32", "bfloat16", "int32", "float64",
    "object", "O", "V8", "f4,f4", "array", "numpy", "int", "float", "bool",
    "w", "lr", "count", "crc32c", "flax_ckpt_plugin", "threefry2x32"]
_JSON_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from(_INTERESTING_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10), st.sampled_from(_INTERESTING_STRINGS))
_JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["file", "offset", "nbytes", "index",
                                         "crc32c", "path", "kind", "dtype",
                                         "shape", "value", "shards"])
                        | st.text(max_size=5), inner, max_size=3)),
    max_leaves=6)
# (kind, path, value): the path is an int (which of the manifest's current
# paths, modulo their number) or, in explicit examples, a tuple whose "@name"
# entries pick a leaf by its path.
_MUTATIONS = st.one_of(
    st.tuples(st.just("replace"), st.integers(0, 2**16), _JSON_VALUES),
    st.tuples(st.just("delete"), st.integers(0, 2**16), st.none()),
    st.tuples(st.just("duplicate_shard"), st.integers(0, 2**16), st.none()))


def _json_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
  """The path of every value inside `value`, parents before children."""
  out = [prefix]
  if isinstance(value, dict):
    for k, v in value.items():
      out += _json_paths(v, prefix + (k,))
  elif isinstance(value, list):
    for i, v in enumerate(value):
      out += _json_paths(v, prefix + (i,))
  return out


def _get(doc: Any, path: tuple) -> Any:
  for key in path:
    doc = doc[key]
  return doc


def _resolve(doc: Any, path: tuple) -> tuple:
  """Turns "@name" entries into the index of the leaf named `name`."""
  out, node = [], doc
  for key in path:
    if isinstance(key, str) and key.startswith("@"):
      key = next(i for i, l in enumerate(node) if l.get("path") == key[1:])
    out.append(key)
    node = node[key]
  return tuple(out)


def _mutate(doc: Any, mutation: tuple) -> Any:
  """Applies one mutation to the JSON document `doc`; returns the new doc."""
  kind, where, value = mutation
  if kind == "duplicate_shard":
    # ("leaves", i, "shards") lists that still hold a shard.
    lists = [p for p in _json_paths(doc)
             if len(p) == 3 and p[-1] == "shards"
             and isinstance(_get(doc, p), list) and _get(doc, p)]
    if lists:
      shards = _get(doc, lists[where % len(lists)])
      shards.append(copy.deepcopy(shards[where % len(shards)]))
    return doc
  paths = _json_paths(doc)
  path = (_resolve(doc, where) if isinstance(where, tuple)
          else paths[where % len(paths)])
  if not path:
    return value if kind == "replace" else doc
  parent = _get(doc, path[:-1])
  if kind == "replace":
    parent[path[-1]] = value
  else:
    del parent[path[-1]]
  return doc


_ALLOWED_ERRORS = (CheckpointCorruptedError, StructureMismatchError,
                   CheckpointNotFoundError)


@pytest.mark.timeout(300)
# ~10 ms per example: 200 of them take a few seconds.
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(_MUTATIONS, min_size=1, max_size=3))
# Always tried: a harmless change, and changes that made restore crash when
# this test was written (docs/reliability.md, "Known gaps").
@example(mutations=[("replace", ("created",), "not a date")])
@example(mutations=[("replace", ("leaves", "@lr", "value"), 10**400)])
@example(mutations=[("replace", ("leaves", "@count", "value"), float("nan"))])
@example(mutations=[("replace", ("leaves", "@w", "shards", 0, "file"),
                     [DATA])])
@example(mutations=[("replace", ("files", DATA), 2**70)])
@example(mutations=[("duplicate_shard", 0, None)])
@example(mutations=[("replace", ("leaves", "@w", "shape"), [2**61])])
# Found by the hardening audit (tests/test_bounded_reads.py has the rest:
# FIFOs, /dev/zero, sparse files, hostile key_impl, many shards).
@example(mutations=[("replace", ("checksum", "block_bytes"), 2**50)])
@example(mutations=[("replace", ("leaves", "@w", "dtype"), None)])
@example(mutations=[("delete", ("leaves", "@v", "dtype"), None)])
def test_any_manifest_mutation_restores_identically_or_raises_clearly(
    base_checkpoint, mutations):
  """Random changes to a real manifest never crash or corrupt a restore.

  Mutations replace any JSON value at a random path (ints huge and negative,
  strings such as '../x' and '/etc/passwd', lists, dicts, null), delete keys
  or list items, or duplicate a shard. The restore then either returns
  exactly the saved state (the change was harmless, e.g. to `created`) or
  raises CheckpointCorruptedError, StructureMismatchError or
  CheckpointNotFoundError; nothing else.

  One allowance: Python scalar leaves (`lr`, `count`) are stored as JSON
  numbers in the manifest, which has no checksum of its own, so a changed
  number restores as written; the test then asks only that it comes back in
  the target's type.
  """
  directory = base_checkpoint.directory
  original, expected = base_checkpoint.manifest, base_checkpoint.expected
  doc = copy.deepcopy(original)
  for mutation in mutations:
    doc = _mutate(doc, mutation)
  text = json.dumps(doc)
  manifest_path = directory / "1" / storage.MANIFEST
  manifest_path.write_text(text)
  try:
    try:
      restored = _restore(directory, _small_target(), 1)
    except _ALLOWED_ERRORS:
      return
    written = json.loads(text)
    want = dict(expected)
    for name in ("lr", "count"):
      before = _leaf(original, name)["value"]
      after = _leaf(written, name).get("value")
      if json.dumps(after) != json.dumps(before):
        want[name] = type(before)(after)
    for name, value in restored.items():
      if isinstance(want[name], (int, float)):
        assert type(value) is type(want[name]), (name, value)
        assert repr(value) == repr(want[name]), (name, value, want[name])
        continue
      got, exp = np.asarray(value), want[name]
      assert got.dtype == exp.dtype and got.shape == exp.shape, name
      assert got.tobytes() == exp.tobytes(), (name, got, exp)
  finally:
    manifest_path.write_text(json.dumps(original, indent=1))


# -- 4. Two writers; read-only readers -----------------------------------------


def _job_state(seed: int) -> dict[str, Any]:
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.standard_normal((16, 8), dtype=np.float32)),
          "step": seed}


def _job_target() -> dict[str, Any]:
  return {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32), "step": 0}


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.multiprocess
def test_second_job_takes_over_and_the_first_gets_concurrent_writer_error(
    ckpt_dir, assert_trees_equal, host_copy):
  """Job A writes; job B (another process) opens the same directory.

  B's claim wins: `_WRITER` records B. A's next save is not finalized and
  its error (ConcurrentWriterError, naming B's host and pid) comes from A's
  next call; A's retention (max_to_keep=1) deletes nothing of B's, nor its
  own older step. Every finalized step restores bit for bit.
  """
  a = CheckpointManager(ckpt_dir, max_to_keep=1)
  a_claim = json.loads((ckpt_dir / atomicity.WRITER_FILE).read_text())
  assert a_claim["pid"] == os.getpid()
  state_1 = _job_state(1)
  expected_1 = host_copy(state_1)
  a.save(1, state_1)
  a.wait_until_finished()

  (b,) = run_workers("second_writer", 1, args=[ckpt_dir, 2, 7],
                     timeout=RUN_TIMEOUT)
  b_out = b.json
  assert b_out["pid"] != os.getpid()
  assert b_out["all_steps"] == [1, 2]
  claim = json.loads((ckpt_dir / atomicity.WRITER_FILE).read_text())
  assert sorted(claim) == ["host", "opened", "pid", "process_count", "token"]
  assert claim["pid"] == b_out["pid"] and claim["host"] == b_out["host"]
  assert claim["process_count"] == 1
  assert re.fullmatch(r"[0-9a-f]{32}", claim["token"])
  assert claim["token"] != a_claim["token"]

  a.save(3, _job_state(3))  # Returns: the commit fails behind it.
  with pytest.raises(ConcurrentWriterError) as info:
    a.save(4, _job_state(4))  # A's next call.
  message = str(info.value)
  assert f"'pid': {b_out['pid']}" in message, message
  assert f"'host': '{b_out['host']}'" in message, message
  assert "step 3 was not finalized" in message, message
  # A's later saves fail the same way; nothing of A's is finalized after B.
  a.save(5, _job_state(5))
  with pytest.raises(ConcurrentWriterError):
    a.close()
  assert _entries(ckpt_dir) == ["1", "2", "_WRITER"]

  assert_trees_equal(_restore(ckpt_dir, _job_target(), 1), expected_1)
  restored_2 = _restore(ckpt_dir, _job_target(), 2)
  assert np.asarray(restored_2["w"]).tobytes().hex() == b_out["w_hex"]
  assert restored_2["step"] == 2


def test_older_job_never_deletes_after_a_takeover_at_the_worst_moment(
    ckpt_dir, monkeypatch, assert_trees_equal, host_copy):
  """B claims the directory between A's finalize and A's retention.

  Injected fault: A's `AtomicRenamePath.finalize` is wrapped so that, right
  after step 2 is finalized, another job claims the directory (exactly what
  opening a `CheckpointManager` there does first). A's retention
  (max_to_keep=1) would now delete step 1; it must not, and A's next call
  raises ConcurrentWriterError saying so.
  """
  a = CheckpointManager(ckpt_dir, max_to_keep=1)
  states = {1: _job_state(1), 2: _job_state(2)}
  expected = {s: host_copy(t) for s, t in states.items()}
  a.save(1, states[1])
  a.wait_until_finished()
  real_finalize = atomicity.AtomicRenamePath.finalize

  def finalize_then_taken_over(self):
    real_finalize(self)
    if self.step == 2:
      atomicity.claim_directory(self.final.parent, 1)

  monkeypatch.setattr(atomicity.AtomicRenamePath, "finalize",
                      finalize_then_taken_over)
  a.save(2, states[2])
  with pytest.raises(ConcurrentWriterError,
                     match=r"steps \[1\] were not deleted"):
    a.wait_until_finished()
  a.close()
  assert _entries(ckpt_dir) == ["1", "2", "_WRITER"]
  for step in (1, 2):
    assert_trees_equal(_restore(ckpt_dir, _job_target(), step),
                       expected[step])


class _Gates:
  """Holds the n-th data write open until `release[n]` is set.

  Injected fault: wraps `storage.write_process_files` so that each write,
  once its data file is written, sets `entered[n]` and waits on `release[n]`
  (n counts writes from 0). Lets a test interleave two saves exactly.
  """

  def __init__(self, monkeypatch, count: int):
    self.entered = [threading.Event() for _ in range(count)]
    self.release = [threading.Event() for _ in range(count)]
    self._next = 0
    self._lock = threading.Lock()
    real_write = storage.write_process_files

    def gated_write(step_dir, leaves, process_index, **kwargs):
      nbytes = real_write(step_dir, leaves, process_index, **kwargs)
      with self._lock:
        n, self._next = self._next, self._next + 1
      if n < count:
        self.entered[n].set()
        if not self.release[n].wait(60):
          raise TimeoutError(f"the test never released gated write {n}")
      return nbytes

    monkeypatch.setattr(storage, "write_process_files", gated_write)

  def release_all(self) -> None:
    for event in self.release:
      event.set()


@pytest.mark.timeout(120)
def test_restart_while_the_old_job_still_runs_keeps_the_new_jobs_save(
    ckpt_dir, monkeypatch, assert_trees_equal, host_copy):
  """A restart while the old job is mid-save, both saving the same step.

  Injected fault: writes are held open (`_Gates`), so that job A is in the
  middle of writing step 2 when job B (its restart, same schedule) opens the
  directory and starts writing its own step 2. A's save then fails with
  ConcurrentWriterError; cleaning up after itself, it must not remove B's
  `2.partial`, and B's step 2 must finalize and restore bit for bit.
  """
  gates = _Gates(monkeypatch, 2)
  try:
    a = CheckpointManager(ckpt_dir, max_to_keep=None)
    a.save(2, _job_state(2))
    assert gates.entered[0].wait(60), "A's write never started"

    b = CheckpointManager(ckpt_dir, max_to_keep=None)  # Claims the dir.
    b_state = _job_state(20)
    expected = host_copy(b_state)
    b.save(2, b_state)
    assert gates.entered[1].wait(60), "B's write never started"

    gates.release[0].set()  # A goes on: its finalize sees B's claim.
    with pytest.raises(ConcurrentWriterError):
      a.close()
    gates.release[1].set()
    b.close()
  finally:
    gates.release_all()
  assert _entries(ckpt_dir) == ["2", "_WRITER"]
  assert_trees_equal(_restore(ckpt_dir, _job_target(), 2), expected)


@pytest.mark.timeout(120)
def test_read_only_manager_never_disturbs_a_save_in_progress(
    ckpt_dir, monkeypatch, assert_trees_equal, host_copy):
  """An evaluation job opens a training directory while a save is running.

  Injected fault: step 2's write is held open once its data file is written
  (`_Gates`: `storage.write_process_files` waits on a threading.Event),
  leaving a `2.partial` on disk. A read-only manager opened then lists only
  step 1, restores it, refuses to save, and neither removes `2.partial` nor
  writes or changes `_WRITER`. Released, the save finalizes.
  """
  fresh = ckpt_dir.parent / "never_opened_for_writing"
  with CheckpointManager(fresh, read_only=True) as reader:
    assert reader.all_steps() == []
  assert not fresh.exists()  # Not even created.

  writer = CheckpointManager(ckpt_dir, max_to_keep=None)
  states = {1: _job_state(1), 2: _job_state(2)}
  expected = {s: host_copy(t) for s, t in states.items()}
  writer.save(1, states[1])
  writer.wait_until_finished()

  gates = _Gates(monkeypatch, 1)
  claim_path = ckpt_dir / atomicity.WRITER_FILE
  try:
    writer.save(2, states[2])
    assert gates.entered[0].wait(60), "step 2's write never started"
    partial = ckpt_dir / ("2" + atomicity.TMP_SUFFIX)
    before = (claim_path.read_bytes(), os.stat(claim_path),
              sorted(str(p.relative_to(ckpt_dir))
                     for p in ckpt_dir.rglob("*")))

    with CheckpointManager(ckpt_dir, read_only=True) as reader:
      assert reader.all_steps() == [1]
      assert_trees_equal(reader.restore(_job_target()), expected[1])
      with pytest.raises(PermissionError, match="read-only"):
        reader.save(3, states[2])

    after = (claim_path.read_bytes(), os.stat(claim_path),
             sorted(str(p.relative_to(ckpt_dir))
                    for p in ckpt_dir.rglob("*")))
    assert after[0] == before[0]
    assert (after[1].st_ino, after[1].st_mtime_ns) == (
        before[1].st_ino, before[1].st_mtime_ns)
    assert after[2] == before[2]
    assert (partial / DATA).is_file()
  finally:
    gates.release_all()
  writer.close()
  assert _entries(ckpt_dir) == ["1", "2", "_WRITER"]
  assert_trees_equal(_restore(ckpt_dir, _job_target(), 2), expected[2])


# -- 5. Fallback to the newest good step ---------------------------------------


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


# -- 6. Durability: what is fsynced, and in which order ------------------------


@pytest.fixture
def fsync_log(monkeypatch):
  """Records every os.fsync (by the path of its fd) and os.rename, in order.

  A spy, not a fault: the real calls still run.
  """
  events = []
  real_fsync, real_rename = os.fsync, os.rename

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return real_fsync(fd)

  def rename(src, dst, *args, **kwargs):
    events.append(("rename", os.fspath(src), os.fspath(dst)))
    return real_rename(src, dst, *args, **kwargs)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "rename", rename)
  return events


def _last(events: list, event: tuple) -> int:
  assert event in events, f"{event} not in {events}"
  return max(i for i, e in enumerate(events) if e == event)


def _first_after(events: list, event: tuple, start: int) -> int:
  later = [i for i, e in enumerate(events) if e == event and i > start]
  assert later, f"{event} not after event {start}: {events}"
  return later[0]


def test_rename_mode_fsyncs_data_manifest_marker_and_directories_in_order(
    ckpt_dir, fsync_log):
  """Before the rename, everything in `<step>.partial` is durable.

  The data file, the manifest, the `data/` and step directories and then the
  commit marker are fsynced; the step directory again (so the marker's entry
  is durable) before the rename; the parent directory after it (so the
  rename is). Nothing becomes durable as finalized before its data.
  """
  manager = CheckpointManager(ckpt_dir)
  del fsync_log[:]  # The claim of the directory at open is not a save.
  manager.save(1, _small_state(1))
  manager.close()
  top = os.path.realpath(ckpt_dir)
  tmp, final = f"{top}/1.partial", f"{top}/1"
  events = fsync_log
  data = _last(events, ("fsync", f"{tmp}/{DATA}"))
  manifest = _last(events, ("fsync", f"{tmp}/manifest.json"))
  data_dir = _last(events, ("fsync", f"{tmp}/data"))
  marker = _last(events, ("fsync", f"{tmp}/_COMMITTED"))
  renamed = _last(events, ("rename", tmp, final))
  step_dir = _first_after(events, ("fsync", tmp), marker)
  parent = _first_after(events, ("fsync", top), renamed)
  assert data < manifest < marker, events
  assert data_dir < marker, events
  assert marker < step_dir < renamed < parent, events


def test_commit_file_mode_makes_the_marker_entry_durable(ckpt_dir,
                                                         fsync_log):
  """commit_file on a local disk: the marker's directory entry is fsynced.

  The marker is the last file written; fsyncing the file alone does not make
  its name durable, so after it the step directory must be fsynced, and the
  parent directory since the step directory was created, or a power cut
  after `save` finished (and after retention deleted older steps) could
  leave no finalized step at all.
  """
  manager = CheckpointManager(ckpt_dir, commit=Commit(atomicity="commit_file"))
  del fsync_log[:]
  manager.save(1, _small_state(1))
  manager.close()
  top = os.path.realpath(ckpt_dir)
  final = f"{top}/1"
  events = fsync_log
  data = _last(events, ("fsync", f"{final}/{DATA}"))
  manifest = _last(events, ("fsync", f"{final}/manifest.json"))
  marker = _last(events, ("fsync", f"{final}/_COMMITTED"))
  assert data < manifest < marker, events
  _first_after(events, ("fsync", final), marker)
  assert ("fsync", top) in events, events
