"""Published weights into a target: `load_safetensors`.

Fine-tuning starts from weights published as safetensors (one
`model.safetensors`, or numbered files and `model.safetensors.index.json`,
as the Hugging Face hub lays them out). Their headers become leaf records
(`format.safetensors_files`), each tensor one shard at its byte range, and
the restore of a step's leaves does the rest (`tree.restore_records`):
the rename (`renaming`) and the match against the target (every leaf
without a tensor and every tensor without a leaf in one message), casts
(`casting`), and each process reading only the byte ranges of the regions
its devices of the target's shardings hold, straight into the arrays it
builds (no host copy of a whole tensor, let alone of the file; on object
stores, where reads are requests, a region that cuts a tensor along a
later axis is read as whole rows of it). Nothing
here meets another process: every process calls it with the same target,
and each reads its own part.
"""

from __future__ import annotations

import os
import time
from typing import Any

from etils import epath

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format import safetensors_files as st
from flax_ckpt_plugin.format.records import CHECKSUM_BLOCK
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.restore import renaming
from flax_ckpt_plugin.restore import tree as tree_lib
from flax_ckpt_plugin.restore.options import RestoreOptions


def _header(folder: epath.Path, name: str, backend: interface.Backend,
            within: epath.Path) -> tuple[list[LeafRecord], int]:
  """The records of one file's tensors, and the file's size."""
  path = folder / name
  f = backend.open_ranged(path, within=within)
  try:
    first = bytearray(min(8, f.size))
    f.read_into(0, memoryview(first))
    n = st.header_length(bytes(first), str(path), f.size)
    header = bytearray(n)
    if f.read_into(8, memoryview(header)) != n:
      raise CheckpointCorruptedError(
          f"safetensors file {path}: ended inside its header")
    leaves, _ = st.leaves_of(bytes(header), name, str(path), f.size)
    return leaves, f.size
  finally:
    f.close()


def _local_within(folder: epath.Path) -> epath.Path:
  """The folder no file may lead outside: `folder` itself, or where it is
  a revision of the hub's cache (`<repo>/snapshots/<revision>/`, whose
  files link to `<repo>/blobs/`), that repository's folder. A link that
  leads elsewhere is refused, naming it."""
  real = os.path.realpath(os.fspath(folder))
  parent = os.path.dirname(real)
  if os.path.basename(parent) == "snapshots":
    return epath.Path(os.path.dirname(parent))
  return epath.Path(real)


def source(path_or_dir: epath.PathLike, backend: interface.Backend | None = None
           ) -> tuple[tree_lib.Source, interface.Backend]:
  """The `tree.Source` of a safetensors file, of an index, or of a folder
  (its index, else its `.safetensors` files).

  Raises:
    FileNotFoundError: no such file or folder, or a folder without
      safetensors files; names the path.
    CheckpointCorruptedError: an index or a header that is not of the
      format, a tensor in the weight map that its file lacks, or a tensor
      name in two files; names the file and the tensor.
  """
  path, backend = interface.make_path(path_or_dir, backend)
  shown = os.fspath(path_or_dir)
  if not path.exists():
    raise FileNotFoundError(f"no safetensors file or folder {shown}")
  wanted: dict[str, str] | None = None  # Tensor name -> file, of an index.
  if path.is_dir():
    folder = path
    if (path / st.INDEX_NAME).exists():
      path = path / st.INDEX_NAME
    else:
      names = sorted(p.name for p in folder.iterdir()
                     if p.name.endswith(st.SUFFIX))
      if not names:
        raise FileNotFoundError(
            f"{shown} holds no {st.INDEX_NAME} and no {st.SUFFIX} files")
  else:
    folder = path.parent
    names = [path.name]
  if path.name.endswith(".json"):
    text = backend.read_small(path, within=folder,
                              limit=st.MAX_INDEX_BYTES)
    wanted = st.weight_map(text, str(path))
    names = sorted(set(wanted.values()))
  local = "://" not in os.fspath(folder)
  within = _local_within(folder) if local else folder
  by_file, sizes = {}, {}
  for name in names:
    try:
      by_file[name], sizes[name] = _header(folder, name, backend, within)
    except FileNotFoundError as e:
      raise FileNotFoundError(
          f"safetensors file {folder / name}"
          + (f", named by {path}," if wanted is not None else "")
          + " does not exist") from e
  st.check_unique(by_file, shown)
  leaves = [leaf for name in names for leaf in by_file[name]]
  if wanted is not None:
    held = {leaf.path: name for name in names for leaf in by_file[name]}
    for tensor, name in wanted.items():
      if held.get(st.path_of(tensor)) != name:
        raise CheckpointCorruptedError(
            f"safetensors index {path}: tensor {tensor!r} is in {name}"
            " by its weight_map, and not in that file's header")
    # A tensor that a file holds and the weight map does not name is not
    # part of the set.
    named = {st.path_of(t) for t in wanted}
    leaves = [leaf for leaf in leaves if leaf.path in named]
  return tree_lib.Source(
      directory=folder, files=sizes, leaves=tuple(leaves),
      block=CHECKSUM_BLOCK, where=f"safetensors {shown}", shown=shown,
      call="load_safetensors", within=within), backend


def load_safetensors(path_or_dir: epath.PathLike, target: Any, *,
                     rename: renaming.Rename | None = None,
                     cast: bool = False, partial: bool = False,
                     missing: str = "error") -> Any:
  """Reads safetensors weights (one file, or a sharded set) into `target`.

  Each tensor `a.b.c` is the checkpoint leaf `a/b/c` (as `export` writes
  the leaf `a/b/c`); `rename` gives it its target path, as in
  `CheckpointManager.restore`. Called on every process with the same
  target: each reads only the byte ranges of the regions that its devices
  hold under the target's shardings, and places them there (host memory:
  the arrays built, plus a read buffer per reading thread at most).
  Meets no other process.

  Args:
    path_or_dir: a `.safetensors` file, a `model.safetensors.index.json`,
      or a folder holding either (the index wins; without one, every
      `.safetensors` file in it). Local, or `gs://`/`s3://`.
    target: the pytree to fill, concrete or abstract (`jax.eval_shape`,
      `ShapeDtypeStruct`s with `sharding=`), as for `restore`; None: every
      tensor as a numpy array in nested dicts by its (renamed) path.
    rename: checkpoint path -> target path: rules (regular expressions
      matched against whole paths, first match wins, None drops) or a
      function; see `CheckpointManager.restore`.
    cast: convert tensors of another dtype than their leaf's (floating
      to floating, integer to integer, a narrower integer checked value by
      value), as `restore(cast=True)` does; other conversions are refused,
      naming the leaf.
    partial: tensors that no leaf of the target takes are left unread
      (else they are a mismatch).
    missing: "keep": leaves of the target that no tensor fills keep the
      target's value (a new head); "error" (default): a mismatch.

  Returns:
    A pytree like `target`.

  Raises:
    StructureMismatchError: leaves without a tensor, tensors without a
      leaf, shapes or dtypes that differ: all named in one message, each
      leaf by its target path and tensor path where they differ; before
      any data is read.
    CheckpointCorruptedError: a file, header or index that is not of the
      format (names the file and the tensor).
    FileNotFoundError: no such file or folder, or a file an index names
      is missing.
    ValueError: a rename rule that is not a regular expression, or two
      tensors given one target path (names them).
  """
  # (Safetensors files carry no checksums: nothing to verify.)
  options = RestoreOptions(verify=False, partial=partial, missing=missing,
                           cast=cast, rename=rename)
  t0 = time.perf_counter()
  src, backend = source(path_or_dir)
  if target is None:
    target = tree_lib.plain_target(src.leaves, options.rename)
  tree, nbytes = tree_lib.restore_records(src, target, options,
                                          backend=backend)
  log.info("%s: read %d bytes of %d files in %.2f s", src.where, nbytes,
           len(src.files), time.perf_counter() - t0)
  return tree
