"""Safetensors headers read as leaf records (`format.safetensors_files`):
what the `safetensors` package writes is read back at the right byte
ranges, in every dtype it writes, and a header that lies is refused,
naming the file and the tensor. No JAX."""

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format import safetensors_files as st


def _parse(data: bytes, name: str = "model.safetensors"):
  n = st.header_length(data[:8], name, len(data))
  return st.leaves_of(data[8:8 + n], name, name, len(data))


DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32,
          np.int32, np.uint64, np.int64, np.float16, np.float32, np.float64,
          ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_each_tensor_is_one_shard_at_its_bytes(dtype):
  rng = np.random.default_rng(0)
  tensors = {"h.0.w": (rng.standard_normal((3, 5)) * 4).astype(dtype),
             "b": np.arange(7).astype(dtype), "s": np.array(2, dtype)}
  data = safetensors.numpy.save(tensors, metadata={"format": "np"})
  leaves, metadata = _parse(data)
  assert metadata == {"format": "np"}
  by_path = {leaf.path: leaf for leaf in leaves}
  assert set(by_path) == {"h/0/w", "b", "s"}
  assert by_path["h/0/w"].keys == ({"dict": "h"}, {"dict": "0"},
                                   {"dict": "w"})
  for name, value in tensors.items():
    leaf = by_path[st.path_of(name)]
    (shard,) = leaf.shards
    assert leaf.dtype == np.dtype(dtype) and leaf.shape == value.shape
    assert shard.index == tuple((0, d) for d in value.shape)
    assert shard.file == "model.safetensors" and shard.crc32c == ()
    got = np.frombuffer(data[shard.offset:shard.offset + shard.nbytes],
                        leaf.dtype).reshape(leaf.shape)
    assert got.tobytes() == value.tobytes()


def _header(entries) -> bytes:
  text = json.dumps(entries).encode()
  return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize("entry, message", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
     r"tensor 'x': data_offsets \[0, 4\) hold 4 bytes, its shape \[2\] of"
     " float32 needs 8"),
    ({"dtype": "F32", "shape": [64], "data_offsets": [0, 256]},
     r"tensor 'x': bytes \[\d+, \d+\) lie past the file's end"),
    ({"dtype": "F4", "shape": [2], "data_offsets": [0, 1]},
     r"tensor 'x': dtype code 'F4' is not one this reader knows"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]},
     r"tensor 'x': .* is not a tensor's entry"),
    ({"dtype": "F32", "shape": [2]},
     r"tensor 'x': .* is not a tensor's entry"),
])
def test_an_entry_that_lies_is_refused_naming_file_and_tensor(entry,
                                                               message):
  data = _header({"x": entry}) + b"\0" * 8
  with pytest.raises(CheckpointCorruptedError,
                     match=r"safetensors file model.safetensors, " + message):
    _parse(data)


def test_a_header_that_is_not_one_is_refused():
  with pytest.raises(CheckpointCorruptedError, match="header is not JSON"):
    _parse((3).to_bytes(8, "little") + b"{x}")
  with pytest.raises(CheckpointCorruptedError,
                     match="passes the file's end at 11 bytes"):
    st.header_length((100).to_bytes(8, "little"), "f", 11)
  with pytest.raises(CheckpointCorruptedError, match="over the limit"):
    st.header_length((1 << 40).to_bytes(8, "little"), "f", 1 << 41)
  with pytest.raises(CheckpointCorruptedError, match="too short for a header"):
    st.header_length(b"abc", "f", 3)


def test_an_index_names_files_of_its_folder_only():
  assert st.weight_map(json.dumps({"metadata": {"total_size": 8},
                                   "weight_map": {"a.w": "m-1.safetensors"}}
                                  ).encode(), "i.json") == {
                                      "a.w": "m-1.safetensors"}
  for name in ("../m.safetensors", "/etc/m.safetensors", ""):
    with pytest.raises(CheckpointCorruptedError,
                       match="not a file name in the index's folder"):
      st.weight_map(json.dumps({"weight_map": {"a.w": name}}).encode(),
                    "i.json")
  with pytest.raises(CheckpointCorruptedError, match="not JSON with a"
                     " weight_map"):
    st.weight_map(b'{"metadata": {}}', "i.json")
