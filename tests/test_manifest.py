"""Tests of the typed manifest: parsing, validation and dtype names."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import manifest as manifest_lib


def _jax_dtypes() -> list[np.dtype]:
  """Every dtype JAX arrays can have: jnp's scalar types, and JAX's set."""
  found = {np.dtype(getattr(jnp, n).dtype) for n in dir(jnp)
           if isinstance(getattr(getattr(jnp, n), "dtype", None), np.dtype)}
  try:
    from jax._src import dtypes  # pylint: disable=g-import-not-at-top
    found |= {np.dtype(d) for d in getattr(dtypes, "_jax_dtype_set", ())}
  except ImportError:
    pass
  # Those a leaf can be saved with: no objects, fields or zero-size items.
  return sorted((d for d in found if not d.hasobject and d.names is None
                 and d.itemsize), key=str)


def test_every_jax_dtype_name_parses_as_jax_parses_it():
  dtypes = _jax_dtypes()
  names = {str(d) for d in dtypes}
  assert {"bfloat16", "float8_e4m3fn", "int4", "uint4", "bool", "float32",
          "complex64"} <= names, names
  for dtype in dtypes:
    name = str(dtype)  # What the writer writes.
    parsed = manifest_lib.parse_dtype(name, "here")
    assert parsed == jnp.dtype(name), name
    assert parsed.type is jnp.dtype(name).type, name
    assert parsed.itemsize == dtype.itemsize, name


@pytest.mark.parametrize("name,message", [
    ("float33", "unknown dtype 'float33'"),
    (None, "unknown dtype None"),
    (["float32"], "unknown dtype ['float32']"),
    ("O", "dtype 'O' is not allowed"),
    ("f4,f4", "dtype 'f4,f4' is not allowed"),
    ("V0", "dtype 'V0' is not allowed"),
])
def test_bad_dtype_names_are_corruption_naming_where(name, message):
  with pytest.raises(CheckpointCorruptedError) as info:
    manifest_lib.parse_dtype(name, "m.json, leaf 'w'")
  assert str(info.value) == f"m.json, leaf 'w': {message}"


def test_read_gives_typed_records(ckpt_dir):
  tree = {"w": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4),
          "n": np.int8(3), "key": jax.random.key(0), "lr": 0.5}
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(7, tree, extra={"epoch": 2}, metrics={"loss": 1.0})
  m = manifest_lib.read(ckpt_dir / "7", 7)
  assert (m.format, m.format_version, m.step) == ("flax_ckpt_plugin", 1, 7)
  assert m.process_count == 1 and m.byte_order == "little"
  assert m.checksum_algorithm == "crc32c"
  assert m.extra == {"epoch": 2} and m.metrics == {"loss": 1.0}
  leaves = m.leaf_by_path
  w = leaves["w"]
  assert w.is_array and not w.is_scalar
  assert w.dtype == jnp.bfloat16 and w.shape == (3, 4) and w.nbytes == 24
  (shard,) = w.shards
  assert shard.index == ((0, 3), (0, 4)) and shard.nbytes == 24
  assert shard.index_list == [[0, 3], [0, 4]]
  assert leaves["n"].kind == "numpy" and leaves["n"].shape == ()
  assert leaves["key"].key_impl == "threefry2x32"
  assert leaves["key"].describe() == (
      "uint32[2] (key data of PRNG impl threefry2x32)")
  assert leaves["lr"].is_scalar and leaves["lr"].value == 0.5
  assert leaves["lr"].dtype is None and leaves["lr"].nbytes == 0
  assert m.total_bytes == 24 + 1 + 8
  assert sum(m.files.values()) >= m.total_bytes


def test_read_refuses_a_manifest_of_another_step(ckpt_dir):
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(7, {"w": jnp.zeros(2)})
  (ckpt_dir / "7").rename(ckpt_dir / "8")
  path = ckpt_dir / "8" / "manifest.json"
  with pytest.raises(CheckpointCorruptedError) as info:
    manifest_lib.read(ckpt_dir / "8", 8)
  assert str(info.value) == (f"{path}: records step 7, but lives in the"
                             " directory of step 8")
  assert manifest_lib.read(ckpt_dir / "8").step == 7  # No step: no check.
  with pytest.raises(FileNotFoundError, match="no manifest.json in"):
    manifest_lib.read(ckpt_dir / "9", 9)


def test_parse_reports_the_first_problem_with_the_leaf(ckpt_dir):
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, {"w": jnp.zeros((4, 2))})
  raw = json.loads((ckpt_dir / "1" / "manifest.json").read_text())
  raw["leaves"][0]["shards"][0]["index"] = [[0, 5], [0, 2]]
  with pytest.raises(CheckpointCorruptedError,
                     match=r"^m\.json, leaf 'w': shard index \[\[0, 5\]"):
    manifest_lib.parse(json.dumps(raw).encode(), "m.json")
  raw["leaves"][0]["shards"][0]["index"] = [[0, 4], [0, 2]]
  raw["step"] = "7"
  with pytest.raises(CheckpointCorruptedError,
                     match=r"^m\.json: bad 'step' entry '7'"):
    manifest_lib.parse(json.dumps(raw).encode(), "m.json")


def test_manifest_and_reader_do_not_import_jax():
  code = ("import sys\n"
          "from flax_ckpt_plugin import manifest, reader, verify\n"
          "assert 'jax' not in sys.modules\n"
          "assert str(manifest.parse_dtype('bfloat16', '')) == 'bfloat16'\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                     text=True, timeout=120, check=False)
  assert r.returncode == 0, r.stderr
