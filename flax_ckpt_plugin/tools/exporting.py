"""Exporting a step as safetensors or npz files, for tools outside JAX.

`export` writes every array leaf of a finalized step (or those under given
key-path prefixes), each assembled from its shards, under its key path
joined by dots (`params.Dense_0.kernel`), into a new directory:

* safetensors: `model.safetensors`, or, when the arrays exceed
  `max_file_bytes`, numbered files and an index as the Hugging Face hub
  lays them out (`model-00001-of-00003.safetensors` and
  `model.safetensors.index.json`, whose `weight_map` names each array's
  file). bfloat16 and the float8 kinds keep their own dtype codes (`BF16`).
  Non-array leaves (a Python `step`, scalars) go into each file's
  `__metadata__` as JSON text, under their dotted names.
* npz: `model.npz` (stored, not compressed, like `numpy.savez`) and
  `model.json` beside it, holding the non-array leaves and the dtypes that
  numpy has no name for (bfloat16, float8...: stored as unsigned integers
  of their width, bit for bit).

An OUT that ends in `.npz` or `.safetensors` is a file, as `numpy.savez`
and safetensors' `save_file` write one: the export is that one file (and,
for npz, `OUT` with `.json` for `.npz` beside it), in the format its
suffix names; a safetensors export that must be split then asks for a
folder name instead. Any other OUT is the directory above.

Memory stays bounded whatever the state's size: the files are written leaf
by leaf, each leaf in pieces of `PIECE_BYTES` read through
`reader.LeafReader.read_chunks`, which checks the CRC-32C of every block
read. The safetensors format (an 8-byte little-endian header length, a JSON
header of dtypes, shapes and data offsets, then the raw bytes) is written
here, since the `safetensors` package writes a whole dict of arrays from
memory at once; that package (the `[export]` extra) then opens every file
written, before the export is published. Nothing appears at the output
path until the export has succeeded: it is written into a temporary
directory next to it and renamed at the end; a failure removes it.
Needs no JAX, so `flax-ckpt export` starts quickly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import secrets
import shutil
import struct
import zipfile
from typing import Any, BinaryIO, Iterable, Sequence, TextIO

from etils import epath
import numpy as np

from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import backend as backend_lib
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.restore.reader import ByteReader
from flax_ckpt_plugin.restore.reader import LeafReader
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.tools.verify import human_size
from flax_ckpt_plugin.tools.verify import Progress

FORMATS = ("safetensors", "npz")
# Split safetensors exports into files of at most this many bytes of arrays
# (the hub's default shard size); a larger leaf gets a file of its own.
MAX_FILE_BYTES = 5 * 10**9
PIECE_BYTES = 16 << 20  # Bytes of one leaf read and written at a time.
PROGRESS_MIN_BYTES = 64 << 20  # Smaller exports show no progress bar.
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


# An OUT with one of these suffixes is a file of that format.
FILE_SUFFIXES = {".npz": "npz", ".safetensors": "safetensors"}


def file_format(out: os.PathLike | str) -> str | None:
  """The format an OUT names by its suffix, for an export to one file;
  None for a directory."""
  return FILE_SUFFIXES.get(pathlib.Path(out).suffix)


class SafetensorsNotInstalledError(ImportError):
  """The `safetensors` package (the `[export]` extra) is not installed."""


@dataclasses.dataclass(frozen=True)
class ExportResult:
  """What `export` wrote.

  Attributes:
    path: the output directory, or the output file (an OUT that names one).
    step: the step exported.
    format: "safetensors" or "npz".
    files: the names of the files written, in order (data files, then the
      index or the JSON): in `path`, or beside it where `path` is a file.
    arrays: the number of arrays written.
    nbytes: their bytes.
    scalars: the non-array leaves, by dotted name, with their values.
  """
  path: pathlib.Path
  step: int
  format: str
  files: tuple[str, ...]
  arrays: int
  nbytes: int
  scalars: dict[str, Any]
  as_file: bool = False  # `path` is the export's one data file.

  @property
  def written(self) -> list[pathlib.Path]:
    """The paths of `files`."""
    base = self.path.parent if self.as_file else self.path
    return [base / name for name in self.files]


def _name(leaf: LeafRecord) -> str:
  """The key path joined by dots: 'params.Dense_0.kernel'."""
  names = [str(next(iter(k.values()))) for k in leaf.keys if k]
  return ".".join(names) if names else (leaf.path.replace("/", ".")
                                        or "value")


def _select(leaves: Sequence[LeafRecord], only: Iterable[str]
            ) -> list[tuple[str, LeafRecord]]:
  """(dotted name, leaf) of the leaves under the prefixes (all if none)."""
  named = [(_name(leaf), leaf) for leaf in leaves]
  seen: dict[str, str] = {}
  for name, leaf in named:
    if name in seen:
      raise ExportError(f"leaves {seen[name]!r} and {leaf.path!r} would both"
                        f" be exported as {name!r}")
    seen[name] = leaf.path
  prefixes = [p.strip("./").replace("/", ".") for p in only]
  if not prefixes:
    return named
  for p in prefixes:
    if not any(n == p or n.startswith(p + ".") for n, _ in named):
      tops = sorted({n.split(".")[0] for n, _ in named})
      raise ExportError(f"no leaf under {p!r}; the tree's top-level keys:"
                        f" {tops}")
  return [(n, leaf) for n, leaf in named
          if any(n == p or n.startswith(p + ".") for p in prefixes)]


def _import_safetensors() -> Any:
  try:
    import safetensors  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SafetensorsNotInstalledError(f"{SAFETENSORS_MISSING} ({e})") from e
  return safetensors


def _groups(arrays: list[tuple[str, LeafRecord]], limit: int
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


class _Writer:
  """Streams leaves' bytes from the step into open files."""

  def __init__(self, step_dir: epath.Path, manifest: manifest_lib.Manifest,
               backend: backend_lib.Backend, progress: Progress, shown: str):
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


def _fsync_close(f: BinaryIO) -> None:
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


def _write_safetensors(tmp: pathlib.Path, arrays, scalars, step: int,
                       writer: _Writer, max_file_bytes: int) -> list[str]:
  safetensors = _import_safetensors()
  for name, leaf in arrays:
    if leaf.dtype.name not in _SAFETENSORS_DTYPES:
      raise ExportError(f"leaf {leaf.path!r} is {leaf.describe()}, which"
                        " safetensors cannot hold; export it with --format"
                        " npz")
  metadata = {name: json.dumps(value) for name, value in scalars.items()}
  metadata["flax_ckpt_plugin.step"] = str(step)
  groups = _groups(arrays, max_file_bytes)
  names = _file_names(len(groups))
  for file_name, group in zip(names, groups):
    f = open(tmp / file_name, "xb")
    try:
      f.write(_safetensors_header(group, metadata))
      for _, leaf in group:
        writer.write(leaf, f)
    finally:
      _fsync_close(f)
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
    _fsync_close(f)
  return names + [index_name]


def _stored_dtype(dtype: np.dtype) -> np.dtype:
  """The dtype a .npy file records: `dtype`, little-endian, or the unsigned
  integer of its width where numpy has no name for it (ml_dtypes)."""
  dtype = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
  if np.dtype(np.lib.format.dtype_to_descr(dtype)) == dtype:
    return dtype
  return np.dtype(f"<u{dtype.itemsize}")


def _write_npz(tmp: pathlib.Path, arrays, scalars, step: int,
               writer: _Writer) -> list[str]:
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
    _fsync_close(f)
  with np.load(tmp / npz) as opened:  # The zip directory reads back.
    if sorted(opened.files) != sorted(n for n, _ in arrays):
      raise RuntimeError(f"{npz} holds {opened.files}")
  with open(tmp / sidecar, "x") as f:
    json.dump({"step": step, "scalars": scalars, "dtypes": dtypes}, f,
              indent=1)
    _fsync_close(f)
  return [npz, sidecar]


def export(directory: epath.PathLike, out: os.PathLike | str, *,
           step: int | None = None, format: str | None = None,  # pylint: disable=redefined-builtin
           only: Sequence[str] = (), max_file_bytes: int = MAX_FILE_BYTES,
           progress: TextIO | None = None) -> ExportResult:
  """Exports a finalized step's arrays to safetensors or npz files.

  Only reads `directory`, so it may run beside a training job. See the
  module doc for what is written.

  Args:
    directory: the checkpoint directory (local, `gs://` or `s3://`).
    out: the directory to create (local), or the file, where it ends in
      `.npz` or `.safetensors`; it (and an npz file's JSON) must not exist.
    step: the step; None for the newest finalized one.
    format: "safetensors" (needs the `[export]` extra) or "npz"; None: the
      one `out`'s suffix names, else safetensors.
    only: key-path prefixes (`params`, `params.Dense_0`, or with `/`);
      only the leaves under one of them are exported. Empty: all.
    max_file_bytes: safetensors exports larger than this are split into
      numbered files and an index.
    progress: where to draw a progress bar (stderr), for exports of
      `PROGRESS_MIN_BYTES` or more; None draws none.

  Returns:
    An `ExportResult`.

  Raises:
    FileExistsError: `out` (or the JSON beside an npz file) exists.
    CheckpointNotFoundError: no such finalized step.
    CheckpointCorruptedError: the step's manifest or data is damaged (a
      checksum that does not match names the file, the step and the leaf).
    ExportError: see the class.
    SafetensorsNotInstalledError: safetensors is needed and missing.
    ValueError: an unknown format, or `out` is not a local path.
  """
  as_file = file_format(out)
  if format is None:
    format = as_file or "safetensors"  # pylint: disable=redefined-builtin
  if format not in FORMATS:
    raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
  if as_file is not None and as_file != format:
    raise ExportError(
        f"{out} ends in .{as_file}, and the format asked is {format}:"
        f" name the file {pathlib.Path(out).stem}.{format}, or drop the"
        " format to take the suffix's")
  if format == "safetensors":
    _import_safetensors()  # Before anything is read.
  if "://" in os.fspath(out):
    raise ValueError(f"the export goes to a local path, not {out}")
  out = pathlib.Path(out)
  places = [out] + ([out.with_suffix(".json")] if as_file == "npz" else [])
  for place in places:
    if place.exists() or place.is_symlink():
      raise FileExistsError(f"{place} already exists: nothing was written")
  given = os.fspath(directory)
  directory, backend = backend_lib.make_path(given)
  if step is None:
    steps = atomicity.finalized_steps(directory)
    if not steps:
      raise CheckpointNotFoundError(f"no finalized step in {directory}")
    step = steps[-1]
  step_dir = directory / str(step)
  if not atomicity.is_finalized(step_dir):
    raise CheckpointNotFoundError(
        f"step {step} is not a finalized checkpoint in {directory}"
        f" (finalized steps: {atomicity.finalized_steps(directory)})")
  manifest = manifest_lib.read(step_dir, step, backend)
  chosen = _select(manifest.leaves, only)
  arrays = [(n, leaf) for n, leaf in chosen if not leaf.is_scalar]
  scalars = {n: leaf.value for n, leaf in chosen if leaf.is_scalar}
  nbytes = sum(leaf.nbytes for _, leaf in arrays)
  if as_file == "safetensors" and len(_groups(arrays, max_file_bytes)) > 1:
    raise ExportError(
        f"{human_size(nbytes)} of arrays do not fit one safetensors file of"
        f" at most {human_size(max_file_bytes)}: give OUT as a folder name"
        f" (not ending in .safetensors) to write numbered files and an"
        f" index there, or raise the limit (--max-file-size)")
  bar = Progress(nbytes, progress, name="export",
                 enabled=progress is not None and nbytes >= PROGRESS_MIN_BYTES)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
  tmp.mkdir()
  writer = _Writer(step_dir, manifest, backend, bar,
                   f"{given.rstrip('/')}/{step}")
  try:
    if format == "safetensors":
      files = _write_safetensors(tmp, arrays, scalars, step, writer,
                                 max_file_bytes)
    else:
      files = _write_npz(tmp, arrays, scalars, step, writer)
    backend_lib.LOCAL.fsync(epath.Path(tmp))
    for place in places:
      if place.exists() or place.is_symlink():  # Made meanwhile: kept.
        raise FileExistsError(f"{place} appeared during the export: it is"
                              " kept, and nothing was written")
    if as_file is None:
      os.rename(tmp, out)
    else:
      # The JSON first, the data file last: whoever sees OUT sees both.
      for name, place in reversed(list(zip(files, places))):
        os.rename(tmp / name, place)
      files = [place.name for place in places]
      tmp.rmdir()
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    writer.close()
  backend_lib.LOCAL.fsync(epath.Path(out.parent))
  bar.finish()
  return ExportResult(path=out, step=step, format=format, files=tuple(files),
                      arrays=len(arrays), nbytes=nbytes, scalars=scalars,
                      as_file=as_file is not None)
