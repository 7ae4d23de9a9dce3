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
by leaf, in pieces, each block's CRC-32C checked (`export_files`, which
also writes the safetensors format itself). Nothing appears at the output
path until the export has succeeded: it is written into a temporary
directory next to it and renamed at the end; a failure removes it.
Needs no JAX, so `flax-ckpt export` starts quickly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import secrets
import shutil
import sys
from typing import Any, Iterable, Sequence, TextIO

from etils import epath

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.tools import export_files
from flax_ckpt_plugin.tools.export_files import ExportError
from flax_ckpt_plugin.tools.commands import check_step
from flax_ckpt_plugin.tools.commands import CliError
from flax_ckpt_plugin.tools.commands import existing_dir
from flax_ckpt_plugin.tools.commands import EXIT_EXISTS
from flax_ckpt_plugin.tools.commands import EXIT_OK
from flax_ckpt_plugin.tools.commands import EXIT_USAGE
from flax_ckpt_plugin.tools.commands import finalized
from flax_ckpt_plugin.tools.verify import human_size
from flax_ckpt_plugin.tools.verify import Progress

# What `export` raises besides, named here for its callers.
SafetensorsNotInstalledError = export_files.SafetensorsNotInstalledError
FORMATS = ("safetensors", "npz")
# Split safetensors exports into files of at most this many bytes of arrays
# (the hub's default shard size); a larger leaf gets a file of its own.
MAX_FILE_BYTES = 5 * 10**9
PROGRESS_MIN_BYTES = 64 << 20  # Smaller exports show no progress bar.
# An OUT with one of these suffixes is a file of that format.
FILE_SUFFIXES = {".npz": "npz", ".safetensors": "safetensors"}


def file_format(out: os.PathLike | str) -> str | None:
  """The format an OUT names by its suffix, for an export to one file;
  None for a directory."""
  return FILE_SUFFIXES.get(pathlib.Path(out).suffix)


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
    export_files.import_safetensors()  # Before anything is read.
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
    steps = directory_lib.finalized_steps(directory)
    if not steps:
      raise CheckpointNotFoundError(f"no finalized step in {directory}")
    step = steps[-1]
  step_dir = directory / str(step)
  if not directory_lib.is_finalized(step_dir):
    raise CheckpointNotFoundError(
        f"step {step} is not a finalized checkpoint in {directory}"
        f" (finalized steps: {directory_lib.finalized_steps(directory)})")
  manifest = manifest_lib.read(step_dir, step, backend)
  chosen = _select(manifest.leaves, only)
  arrays = [(n, leaf) for n, leaf in chosen if not leaf.is_scalar]
  scalars = {n: leaf.value for n, leaf in chosen if leaf.is_scalar}
  nbytes = sum(leaf.nbytes for _, leaf in arrays)
  if as_file == "safetensors" and len(
      export_files.file_groups(arrays, max_file_bytes)) > 1:
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
  writer = export_files.LeafWriter(step_dir, manifest, backend, bar,
                   f"{given.rstrip('/')}/{step}")
  try:
    if format == "safetensors":
      files = export_files.write_safetensors(tmp, arrays, scalars, step, writer,
                                 max_file_bytes)
    else:
      files = export_files.write_npz(tmp, arrays, scalars, step, writer)
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


# -- the command ---------------------------------------------------------------


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
  """`flax-ckpt export` (see `cli`)."""
  directory = existing_dir(args.directory)
  if args.step is None:
    finalized(directory, args.directory)
  else:
    check_step(directory, args.directory, args.step)
  try:
    result = export(
        args.directory, args.out, step=args.step, format=args.format,
        only=args.only or (), max_file_bytes=args.max_file_size,
        progress=None if args.quiet else sys.stderr)
  except (ExportError,
          SafetensorsNotInstalledError) as e:
    raise CliError(str(e), EXIT_USAGE) from e
  except FileExistsError as e:
    raise CliError(str(e), EXIT_EXISTS) from e
  plural = "" if result.arrays == 1 else "s"
  out.write(f"exported step {result.step} of {args.directory} to {args.out}"
            f" ({result.format}): {result.arrays} array{plural},"
            f" {human_size(result.nbytes)}\n")
  for path in result.written:
    out.write(f"  {path}\n")
  if result.scalars:
    where = ("the metadata" if result.format == "safetensors"
             else result.written[-1].name)
    out.write(f"in {where}: " + ", ".join(
        f"{k} = {v!r}" for k, v in result.scalars.items()) + "\n")
  return EXIT_OK
