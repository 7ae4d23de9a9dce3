"""What a safetensors file is, read as leaf records (no JAX, no package).

A safetensors file (Hugging Face's format, which `tools.export_files`
writes too) is 8 bytes of header length (little-endian unsigned), a JSON
header, then the tensors' bytes: the header maps each tensor's name to
its dtype code, shape and `data_offsets` [begin, end) counted from the
end of the header, and may hold a `__metadata__` object of strings. A
sharded set is several such files and `model.safetensors.index.json`,
whose `weight_map` names each tensor's file.

Here a header becomes `LeafRecord`s, one per tensor, each with one
`ShardRecord` (the whole array, at its byte range, without checksums), so
that a restore reads a tensor's regions as it reads a step's shards. A
tensor's path is its name with dots as slashes (`h.0.attn.c_attn.weight`
is `h/0/attn/c_attn/weight`), the inverse of the names an export writes.
Everything read is checked once, here: a header that lies (offsets past
the file's end, sizes that disagree with the shape) is refused, naming
the file and the tensor.
"""

from __future__ import annotations

import json
import math
from typing import Any

import ml_dtypes
import numpy as np

from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.format.records import ShardRecord

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
# The safetensors package refuses headers over 100 MB; so do we, before
# allocating for one.
MAX_HEADER_BYTES = 100 << 20
MAX_INDEX_BYTES = 100 << 20

# The safetensors dtype codes, and the dtypes they read as. (Sub-byte
# codes, F4 and F6, have no numpy dtype of whole bytes: refused.)
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
  DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)


def path_of(name: str) -> str:
  """A tensor's leaf path: 'h.0.attn.bias' -> 'h/0/attn/bias'."""
  return name.replace(".", "/")


def header_length(first: bytes, file: str, size: int) -> int:
  """The header's length from a file's first 8 bytes.

  Raises:
    CheckpointCorruptedError: the file is shorter than its header says, or
      the header is over `MAX_HEADER_BYTES`; names `file`.
  """
  if len(first) < 8:
    raise CheckpointCorruptedError(
        f"safetensors file {file}: {size} bytes, too short for a header")
  n = int.from_bytes(first[:8], "little")
  if n > MAX_HEADER_BYTES:
    raise CheckpointCorruptedError(
        f"safetensors file {file}: its header length {n} is over the limit"
        f" of {MAX_HEADER_BYTES} bytes (not a safetensors file?)")
  if 8 + n > size:
    raise CheckpointCorruptedError(
        f"safetensors file {file}: its header length {n} passes the file's"
        f" end at {size} bytes (not a safetensors file, or truncated?)")
  return n


def leaves_of(header: bytes, name: str, file: str, size: int
              ) -> tuple[list[LeafRecord], dict[str, str]]:
  """The tensors of one file as leaf records, and its `__metadata__`.

  Args:
    header: the JSON header's bytes (after the 8 bytes of its length).
    name: the file's name in its folder (the records' `ShardRecord.file`).
    file: how messages name the file (its path).
    size: the file's size in bytes.

  Raises:
    CheckpointCorruptedError: the header is not JSON of the format, a
      dtype code is unknown, or a tensor's byte range disagrees with its
      shape or lies past the file's end; names the file and the tensor.
  """
  start = 8 + len(header)
  try:
    parsed = json.loads(header)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointCorruptedError(
        f"safetensors file {file}: the header is not JSON: {e}") from None
  if not isinstance(parsed, dict):
    raise CheckpointCorruptedError(
        f"safetensors file {file}: the header is not a JSON object")
  metadata = parsed.pop("__metadata__", None) or {}
  if not isinstance(metadata, dict):
    raise CheckpointCorruptedError(
        f"safetensors file {file}: __metadata__ is not a JSON object")
  leaves = []
  for tensor, info in parsed.items():
    where = f"safetensors file {file}, tensor {tensor!r}"
    try:
      code, shape, (lo, hi) = (info["dtype"], info["shape"],
                               info["data_offsets"])
      shape = tuple(shape)
      ok = (all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                for d in shape)
            and all(isinstance(v, int) and not isinstance(v, bool)
                    for v in (lo, hi)))
    except (TypeError, KeyError, ValueError):
      ok = False
    if not ok:
      raise CheckpointCorruptedError(
          f"{where}: {json.dumps(info)[:200]} is not a tensor's entry"
          " (dtype, shape, data_offsets)")
    dtype = DTYPES.get(code)
    if dtype is None:
      raise CheckpointCorruptedError(
          f"{where}: dtype code {code!r:.40} is not one this reader knows"
          f" ({', '.join(DTYPES)})")
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= lo <= hi or hi - lo != nbytes:
      raise CheckpointCorruptedError(
          f"{where}: data_offsets [{lo}, {hi}) hold {hi - lo} bytes, its"
          f" shape {list(shape)} of {dtype.name} needs {nbytes}")
    if start + hi > size:
      raise CheckpointCorruptedError(
          f"{where}: bytes [{start + lo}, {start + hi}) lie past the file's"
          f" end at {size} (truncated?)")
    path = path_of(tensor)
    leaves.append(LeafRecord(
        path=path, keys=tuple({"dict": k} for k in path.split("/")),
        kind="array", dtype=dtype, shape=shape,
        shards=(ShardRecord(file=name, offset=start + lo, nbytes=nbytes,
                            index=tuple((0, d) for d in shape),
                            crc32c=()),)))
  return leaves, metadata


def weight_map(text: bytes, file: str) -> dict[str, str]:
  """An index's tensor name -> file name.

  Raises:
    CheckpointCorruptedError: not JSON with a `weight_map` of names, or a
      file name that is not a plain name in the index's folder.
  """
  try:
    parsed = json.loads(text)
    found = parsed["weight_map"]
  except (UnicodeDecodeError, json.JSONDecodeError, TypeError,
          KeyError) as e:
    raise CheckpointCorruptedError(
        f"safetensors index {file}: not JSON with a weight_map ({e!s:.100})"
    ) from None
  if not isinstance(found, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
    raise CheckpointCorruptedError(
        f"safetensors index {file}: weight_map is not an object of names")
  for tensor, name in found.items():
    if "/" in name or "\\" in name or name in ("", ".", ".."):
      raise CheckpointCorruptedError(
          f"safetensors index {file}: tensor {tensor!r} is in {name!r},"
          " which is not a file name in the index's folder")
  return found


def check_unique(files: dict[str, list[LeafRecord]], shown: Any) -> None:
  """Raises where two files hold a tensor of one name (or two names that
  give one path), naming both files."""
  seen: dict[str, str] = {}
  for name, leaves in files.items():
    for leaf in leaves:
      if leaf.path in seen:
        raise CheckpointCorruptedError(
            f"safetensors files of {shown}: {seen[leaf.path]} and {name}"
            f" both hold tensor {leaf.path.replace('/', '.')!r}")
      seen[leaf.path] = name
