"""Tests of the typed manifest: parsing, validation and dtype names."""

import json
import math
import re
import subprocess
import sys

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.format import manifest as manifest_lib


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
    (">f4", "dtype '>f4' is not one the format writes (the little-endian"
     " names of numpy and ml_dtypes, such as 'float32' or 'bfloat16')"),
    ("<f4", "dtype '<f4' is not one the format writes (the little-endian"
     " names of numpy and ml_dtypes, such as 'float32' or 'bfloat16')"),
    ("single", "dtype 'single' is not one the format writes (the"
     " little-endian names of numpy and ml_dtypes, such as 'float32' or"
     " 'bfloat16')"),
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
          "from flax_ckpt_plugin.format import manifest\nfrom flax_ckpt_plugin.restore import reader\nfrom flax_ckpt_plugin.tools import verify\n"
          "assert 'jax' not in sys.modules\n"
          "assert str(manifest.parse_dtype('bfloat16', '')) == 'bfloat16'\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                     text=True, timeout=120, check=False)
  assert r.returncode == 0, r.stderr


# -- the cover check and hostile leaf fields ----------------------------------


def _doc(shape: list[int], indices: list[list[list[int]]],
         **leaf_fields) -> bytes:
  """A manifest of one float32 leaf 'w' in shards at `indices`."""
  shards, offset = [], 0
  for index in indices:
    nbytes = 4 * math.prod(b - a for a, b in index)
    shards.append({"file": "d", "offset": offset, "nbytes": nbytes,
                   "index": index, "crc32c": [0]})
    offset += nbytes
  leaf = {"path": "w", "kind": "array", "dtype": "float32", "shape": shape,
          "shards": shards, **leaf_fields}
  return json.dumps({
      "format": "flax_ckpt_plugin", "format_version": 1, "step": 1,
      "files": {"d": offset},
      "checksum": {"algorithm": "crc32c", "block_bytes": 1 << 40},
      "leaves": [leaf]}).encode()


# Each layout's shards sum to the array's size: only the cover check sees it.
@pytest.mark.parametrize("shape,indices,message", [
    ([4, 4], [[[0, 4], [0, 2]], [[0, 2], [2, 4]], [[1, 3], [2, 4]]],
     "overlap"),
    ([6], [[[0, 2]], [[3, 6]], [[1, 2]]], "overlap"),
    ([2, 2], [[[0, 1], [0, 1]], [[0, 1], [0, 1]], [[1, 2], [1, 2]],
              [[0, 1], [1, 2]]], "appears twice"),
    ([2, 4], [[[0, 2], [0, 1]], [[0, 2], [2, 4]], [[0, 2], [2, 3]]],
     "gap along axis 1: [1, 2]"),
    ([2, 4], [[[0, 2], [0, 1]], [[0, 2], [1, 2]], [[0, 2], [1, 3]]],
     "overlap"),
    # An exact cover, but bricks, not a grid: refused all the same.
    ([2, 4], [[[0, 1], [0, 2]], [[0, 1], [2, 4]], [[1, 2], [0, 1]],
              [[1, 2], [1, 4]]], "do not form a grid"),
], ids=["overlap_2d", "overlap_1d", "duplicate", "gap", "overlap_at_end",
        "bricks"])
def test_cover_check_refuses_overlaps_gaps_and_non_grids(shape, indices,
                                                         message):
  with pytest.raises(CheckpointCorruptedError) as info:
    manifest_lib.parse(_doc(shape, indices), "m.json")
  assert str(info.value).startswith("m.json, leaf 'w': shards "), info.value
  assert message in str(info.value), info.value


@pytest.mark.parametrize("shape,indices", [
    ([3, 2], [[[0, 1], [0, 2]], [[1, 2], [0, 2]], [[2, 3], [0, 2]],
              [[3, 3], [0, 2]]]),  # 3 rows on 4 devices: one is empty.
    ([0, 4], [[[0, 0], [0, 2]], [[0, 0], [2, 4]]]),
    ([], [[]]),
    ([2, 3], [[[1, 2], [0, 3]], [[0, 1], [0, 3]]]),  # Any order.
])
def test_cover_check_accepts_what_jax_shardings_make(shape, indices):
  m = manifest_lib.parse(_doc(shape, indices), "m.json")
  assert len(m.leaves[0].shards) == len(indices)


def _exact_cover(shape: list[int], indices: list[list[list[int]]]) -> bool:
  count = np.zeros(shape, np.int64)
  for index in indices:
    count[tuple(slice(a, b) for a, b in index)] += 1
  return bool((count == 1).all())


_BOXES = st.integers(1, 2).flatmap(
    lambda ndim: st.tuples(
        st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim),
        st.lists(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)),
                          min_size=ndim, max_size=ndim), max_size=8)))


@settings(max_examples=300, deadline=None)
@given(layout=_BOXES)
def test_any_accepted_layout_covers_exactly(layout):
  """Random boxes: accepted only if they cover every element exactly once."""
  shape, boxes = layout
  indices = [[[min(a, b, d), min(max(a, b), d)]
              for (a, b), d in zip(box, shape)] for box in boxes]
  try:
    manifest_lib.parse(_doc(shape, indices), "m.json")
  except CheckpointCorruptedError as e:
    assert str(e).startswith("m.json, leaf 'w': "), e
    return
  assert _exact_cover(shape, indices), indices


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.lists(st.integers(0, 6), max_size=4), min_size=1,
                     max_size=3), rnd=st.randoms())
def test_any_grid_layout_is_accepted(cuts, rnd):
  """Every grid (cut points per axis, empty cells too), in any order."""
  axes = [[0] + sorted(c) + [6] for c in cuts]
  cells = [[]]
  for edges in axes:
    cells = [cell + [[a, b]] for cell in cells
             for a, b in zip(edges, edges[1:])]
  rnd.shuffle(cells)
  m = manifest_lib.parse(_doc([6] * len(axes), cells), "m.json")
  assert len(m.leaves[0].shards) == len(cells)


@settings(max_examples=200, deadline=None)
@given(impl=st.one_of(st.none(), st.integers(), st.text(max_size=80),
                      st.sampled_from(["", "x" * 10_000, "threefry2x32",
                                       "no_such_impl", "../rbg", "a b"])),
       dtype=st.one_of(st.none(), st.integers(), st.text(max_size=12),
                       st.sampled_from(["float32", "", "O", "V0", ","])))
def test_hostile_key_impl_or_dtype_is_refused_naming_the_leaf(impl, dtype):
  raw = _doc([2], [[[0, 2]]], key_impl=impl, dtype=dtype)
  try:
    m = manifest_lib.parse(raw, "m.json")
  except CheckpointCorruptedError as e:
    assert str(e).startswith("m.json, leaf 'w': "), e
    assert len(str(e)) < 400, e
    return
  assert re.fullmatch(r"[A-Za-z0-9_]{1,64}", impl), impl
  assert isinstance(dtype, str), dtype
  assert m.leaves[0].key_impl == impl
