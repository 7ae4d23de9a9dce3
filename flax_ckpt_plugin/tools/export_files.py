"""The files an export writes: safetensors and npz, streamed leaf by leaf.

A `LeafWriter` streams each leaf's bytes from the step into an open file,
in pieces of `PIECE_BYTES` read through `reader.LeafReader.read_chunks`
(every block's CRC-32C checked). The safetensors format (an 8-byte
little-endian header length, a JSON header of dtypes, shapes and data
offsets, then the raw bytes) is written here, since the `safetensors`
package writes a whole dict of arrays from memory at once; that package
(the `[export]` extra) then opens every file written. An npz is a stored
zip of `.npy` members with a JSON file beside it. See `exporting` for what
is exported, and where.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import zipfile
from typing import Any, BinaryIO

from etils import epath
import numpy as np

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.restore.data_files import ByteReader
from flax_ckpt_plugin.restore.reader import LeafReader
from flax_ckpt_plugin.tools.verify import Progress

PIECE_BYTES = 16 << 20  # Bytes of one leaf read and written at a time.
STEM = "model"
SAFETENSORS_MISSING = ("export to safetensors needs the safetensors package:"
                       " pip install 'flax_ckpt_plugin[export]' (or use"
                       " --format npz, which needs numpy only)")
# numpy/ml_dtypes name -> safetensors dtype code.
_SAFETENSORS_DTYPES = {
    "bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16",
    "uint16": "U16", "int32": "I32", "uint32": "U32", "int64": "I64",
    "uint64": "U64", "float16": "F16", "bfloat16": "BF16", "float32": "F32",
    "float64": "F64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
}


class ExportError(ValueError):
  """The export cannot be made as asked: a prefix that matches no leaf, a
  dtype the format cannot hold, or two leaves whose names collide."""


class SafetensorsNotInstalledError(ImportError):
  """The `safetensors` package (the `[export]` extra) is not installed."""


def import_safetensors() -> Any:
  try:
    import safetensors  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SafetensorsNotInstalledError(f"{SAFETENSORS_MISSING} ({e})") from e
  return safetensors


def file_groups(arrays: list[tuple[str, LeafRecord]], limit: int
            ) -> list[list[tuple[str, LeafRecord]]]:
  """Consecutive arrays in files of at most `limit` bytes (a larger leaf
  alone), as the hub splits a state."""
  groups, size = [[]], 0
  for name, leaf in arrays:
    if groups[-1] and size + leaf.nbytes > limit:
      groups.append([])
      size = 0
    groups[-1].append((name, leaf))
    size += leaf.nbytes
  return groups


def _file_names(count: int) -> list[str]:
  if count == 1:
    return [f"{STEM}.safetensors"]
  return [f"{STEM}-{i:05d}-of-{count:05d}.safetensors"
          for i in range(1, count + 1)]


class LeafWriter:
  """Streams leaves' bytes from the step into open files."""

  def __init__(self, step_dir: epath.Path, manifest: manifest_lib.Manifest,
               backend: interface.Backend, progress: Progress, shown: str):
    self._reader = ByteReader(step_dir, manifest.files, backend)
    self._where = f"step {manifest.step} in {shown}"  # As the user gave it.
    self._block = manifest.checksum_block_bytes
    self._progress = progress

  def write(self, leaf: LeafRecord, f: BinaryIO) -> None:
    """Writes `leaf`'s values, little-endian in C order, to `f`."""
    self._progress.update(label=leaf.path)
    lr = LeafReader(reader=self._reader, leaf=leaf, where=self._where,
                    verify=True, block=self._block)
    for _, values in lr.read_chunks(tuple((0, d) for d in leaf.shape),
                                    PIECE_BYTES):
      if values.dtype.byteorder == ">":  # Saved so by an older version.
        values = values.astype(values.dtype.newbyteorder("<"))
      f.write(memoryview(values.reshape(-1).view(np.uint8)))
      self._progress.update(values.nbytes)

  def close(self) -> None:
    self._reader.close()


def fsync_close(f: BinaryIO) -> None:
  f.flush()
  os.fsync(f.fileno())
  f.close()


def _safetensors_header(group: list[tuple[str, LeafRecord]],
                        metadata: dict[str, str]) -> bytes:
  header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
  offset = 0
  for name, leaf in group:
    header[name] = {"dtype": _SAFETENSORS_DTYPES[leaf.dtype.name],
                    "shape": list(leaf.shape),
                    "data_offsets": [offset, offset + leaf.nbytes]}
    offset += leaf.nbytes
  text = json.dumps(header, separators=(",", ":")).encode("utf-8")
  text += b" " * (-len(text) % 8)  # The data starts 8-byte aligned.
  return struct.pack("<Q", len(text)) + text


def write_safetensors(tmp: pathlib.Path, arrays, scalars, step: int,
                       writer: LeafWriter, max_file_bytes: int) -> list[str]:
  safetensors = import_safetensors()
  for name, leaf in arrays:
    if leaf.dtype.name not in _SAFETENSORS_DTYPES:
      raise ExportError(f"leaf {leaf.path!r} is {leaf.describe()}, which"
                        " safetensors cannot hold; export it with --format"
                        " npz")
  metadata = {name: json.dumps(value) for name, value in scalars.items()}
  metadata["flax_ckpt_plugin.step"] = str(step)
  groups = file_groups(arrays, max_file_bytes)
  names = _file_names(len(groups))
  for file_name, group in zip(names, groups):
    f = open(tmp / file_name, "xb")
    try:
      f.write(_safetensors_header(group, metadata))
      for _, leaf in group:
        writer.write(leaf, f)
    finally:
      fsync_close(f)
    # The reference reader must accept what was written.
    with safetensors.safe_open(tmp / file_name, framework="numpy") as opened:
      got = {k: (opened.get_slice(k).get_shape()) for k in opened.keys()}
    want = {n: list(leaf.shape) for n, leaf in group}
    if got != want:
      raise RuntimeError(f"{file_name}: safetensors reads {got}, not {want}")
  if len(names) == 1:
    return names
  index = {"metadata": {"total_size": sum(l.nbytes for _, l in arrays),
                        "flax_ckpt_plugin.step": step, **scalars},
           "weight_map": {n: f for f, g in zip(names, groups) for n, _ in g}}
  index_name = f"{STEM}.safetensors.index.json"
  with open(tmp / index_name, "x") as f:
    json.dump(index, f, indent=1)
    fsync_close(f)
  return names + [index_name]


def _stored_dtype(dtype: np.dtype) -> np.dtype:
  """The dtype a .npy file records: `dtype`, little-endian, or the unsigned
  integer of its width where numpy has no name for it (ml_dtypes)."""
  dtype = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
  if np.dtype(np.lib.format.dtype_to_descr(dtype)) == dtype:
    return dtype
  return np.dtype(f"<u{dtype.itemsize}")


def write_npz(tmp: pathlib.Path, arrays, scalars, step: int,
               writer: LeafWriter) -> list[str]:
  npz, sidecar = f"{STEM}.npz", f"{STEM}.json"
  dtypes = {}
  f = open(tmp / npz, "xb")
  try:
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
      for name, leaf in arrays:
        stored = _stored_dtype(leaf.dtype)
        if stored.name != leaf.dtype.newbyteorder("=").name:
          dtypes[name] = leaf.dtype.name
        header = {"descr": np.lib.format.dtype_to_descr(stored),
                  "fortran_order": False, "shape": tuple(leaf.shape)}
        with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
          try:  # Version 1.0 unless the header needs more than 64 KiB.
            np.lib.format.write_array_header_1_0(member, header)
          except ValueError:
            np.lib.format.write_array_header_2_0(member, header)
          writer.write(leaf, member)
  finally:
    fsync_close(f)
  with np.load(tmp / npz) as opened:  # The zip directory reads back.
    if sorted(opened.files) != sorted(n for n, _ in arrays):
      raise RuntimeError(f"{npz} holds {opened.files}")
  with open(tmp / sidecar, "x") as f:
    json.dump({"step": step, "scalars": scalars, "dtypes": dtypes}, f,
              indent=1)
    fsync_close(f)
  return [npz, sidecar]
