"""The manifest of a step, parsed and validated once, as typed records.

`read` turns a step's `manifest.json` (written by `writer.write_manifest`,
described in docs/format.md) into a `Manifest` of `LeafRecord`s and
`ShardRecord`s (the types are in `records`; this module re-exports them), or raises `CheckpointCorruptedError` naming the file and the
leaf. Every check happens here, before any data file is opened: readers
(`reader`, `restore`, `verify`, the CLI) then use attributes and trust them;
the writer runs `parse` too, on each merged manifest before it finalizes.
Nothing here imports JAX (dtypes come from numpy and `ml_dtypes`, the dtype
library JAX itself uses), so the CLI starts quickly.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable

from etils import epath
import numpy as np

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format.records import ARRAY_KINDS
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.format.records import Manifest
from flax_ckpt_plugin.format.records import BIG_ENDIAN_WRITTEN_UNTIL
from flax_ckpt_plugin.format.records import parse_dtype
from flax_ckpt_plugin.format.records import SCALAR_KINDS
from flax_ckpt_plugin.format.records import ShardRecord
from flax_ckpt_plugin.format.files import FORMAT_NAME
from flax_ckpt_plugin.format.files import FORMAT_VERSION
from flax_ckpt_plugin.format.files import MANIFEST
from flax_ckpt_plugin.errors import NOT_A_FILE
from flax_ckpt_plugin.errors import SaveFailedError

# The largest manifest read (docs/format.md); a million shards take ~60 MiB.
MAX_MANIFEST_BYTES = 256 << 20
# What a PRNG impl's name may be: jax's own are e.g. 'threefry2x32'.
_KEY_IMPL = re.compile(r"[A-Za-z0-9_]{1,64}")


def _corrupt(where: str, what: str) -> CheckpointCorruptedError:
  return CheckpointCorruptedError(f"{where}: {what}")


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _volume(index: Iterable[Iterable[int]]) -> int:
  return math.prod(stop - start for start, stop in index)


def _safe_relative(name: str) -> bool:
  """A data file name that cannot leave the step directory."""
  parts = name.split("/")
  return (not name.startswith("/") and "\\" not in name and
          all(p not in ("", ".", "..") for p in parts))


def check_grid(indices: list[list[list[int]]], shape: list[int], lw: str,
                *, whole: bool = True) -> None:
  """Shards must tile the array: no element missing, none twice.

  Every layout of a JAX sharding is a grid: along each axis, the intervals
  the shards use partition [0, dim). Distinct cells of a grid never overlap,
  so with the volumes summing to the array's size they cover it exactly.
  Checked in O(n log n) for n shards; other layouts are refused. Without
  `whole` (the shards of one process, see `Manifest.scope`), cells of a
  grid, none twice: whether they hold what a restore needs is checked then.
  """
  total = sum(_volume(i) for i in indices)
  if whole and total != math.prod(shape):
    raise _corrupt(lw, f"shards cover {total} elements of"
                   f" {math.prod(shape)}")
  boxes = [tuple(map(tuple, i)) for i in indices if _volume(i)]
  if not boxes:
    return  # An empty array (or a scalar's one element, counted above).
  for axis, dim in enumerate(shape):
    prev = (0, 0)
    for start, stop in sorted({box[axis] for box in boxes}):
      if start < prev[1]:
        raise _corrupt(lw, f"shards overlap or do not form a grid: along"
                       f" axis {axis}, {list(prev)} and {[start, stop]}")
      if whole and start > prev[1]:
        raise _corrupt(lw, f"shards leave a gap along axis {axis}:"
                       f" {[prev[1], start]}")
      prev = (start, stop)
    if whole and prev[1] != dim:
      raise _corrupt(lw, f"shards leave a gap along axis {axis}:"
                     f" {[prev[1], dim]}")
  if len(set(boxes)) != len(boxes):
    raise _corrupt(lw, "shards overlap: one appears twice")


def _scalar_leaf(leaf: dict, kind: str, lw: str) -> Any:
  value = leaf.get("value")
  ok = {"int": _is_int(value), "bool": isinstance(value, bool),
        "float": _is_int(value) or isinstance(value, float)}[kind]
  if ok and kind == "float":
    try:
      float(value)
    except OverflowError:
      ok = False
  if not ok:
    raise _corrupt(lw, f"{kind} leaf with value {value!r:.60}")
  return value


def _shard(s: Any, lw: str, shape: list[int], dtype: np.dtype,
           files: dict[str, int], block: int) -> ShardRecord:
  if not (isinstance(s, dict) and isinstance(s.get("file"), str)
          and s["file"] in files):
    raise _corrupt(lw, f"shard in unknown file {s!r:.200}")
  index = s.get("index")
  if not (isinstance(index, list) and len(index) == len(shape) and all(
      isinstance(r, list) and len(r) == 2 and all(_is_int(v) for v in r)
      and 0 <= r[0] <= r[1] <= d for r, d in zip(index, shape))):
    raise _corrupt(lw, f"shard index {index!r:.200} outside shape {shape}")
  off, nbytes = s.get("offset"), s.get("nbytes")
  if not (_is_int(off) and _is_int(nbytes) and off >= 0
          and nbytes == _volume(index) * dtype.itemsize
          and off + nbytes <= files[s["file"]]):
    raise _corrupt(
        lw, f"shard bytes [{off!r:.40}, +{nbytes!r:.40}) do not fit"
        f" {s['file']} ({files[s['file']]} bytes) or the shard's size")
  sums = s.get("crc32c")
  if not (isinstance(sums, list) and len(sums) == max(1, -(-nbytes // block))
          and all(_is_int(c) and 0 <= c < 2**32 for c in sums)):
    raise _corrupt(lw, f"shard at {index} has no valid crc32c list")
  return ShardRecord(file=s["file"], offset=off, nbytes=nbytes,
                     index=tuple((r[0], r[1]) for r in index),
                     crc32c=tuple(sums))


def _leaf(leaf: Any, where: str, files: dict[str, int],
          block: int, partial: bool = False,
          big_endian_ok: bool = False) -> LeafRecord:
  if not isinstance(leaf, dict) or not isinstance(leaf.get("path"), str):
    raise _corrupt(where, "a leaf entry has no path")
  lw = f"{where}, leaf {leaf['path']!r}"
  keys = leaf.get("keys")
  keys = tuple(keys) if isinstance(keys, list) else ()
  kind = leaf.get("kind")
  if kind in SCALAR_KINDS:
    return LeafRecord(path=leaf["path"], keys=keys, kind=kind, dtype=None,
                      shape=(), value=_scalar_leaf(leaf, kind, lw))
  if kind not in ARRAY_KINDS:
    raise _corrupt(lw, f"unknown kind {kind!r}")
  dtype = parse_dtype(leaf.get("dtype"), lw, big_endian_ok=big_endian_ok)
  shape = leaf.get("shape")
  if not (isinstance(shape, list) and len(shape) <= 64 and all(
      _is_int(d) and 0 <= d < 2**62 for d in shape)):
    raise _corrupt(lw, f"bad shape {shape!r:.200}")
  shards = leaf.get("shards")
  if not isinstance(shards, list):
    raise _corrupt(lw, "no shard list")
  records = tuple(_shard(s, lw, shape, dtype, files, block) for s in shards)
  check_grid([s["index"] for s in shards], shape, lw, whole=not partial)
  key_impl = leaf.get("key_impl")
  if "key_impl" in leaf and not (isinstance(key_impl, str)
                                 and _KEY_IMPL.fullmatch(key_impl)):
    raise _corrupt(lw, f"bad key_impl {key_impl!r:.60}")
  return LeafRecord(path=leaf["path"], keys=keys, kind=kind, dtype=dtype,
                    shape=tuple(shape), shards=records, key_impl=key_impl)


def _optional(value: Any, types: tuple[type, ...]) -> Any:
  """`value` if it is of `types` (bools are not numbers here), else None."""
  if isinstance(value, bool) and bool not in types:
    return None
  return value if isinstance(value, types) else None


def parse(raw: bytes, where: str) -> Manifest:
  """Parses and validates the bytes of a `manifest.json`.

  Args:
    raw: the file's contents.
    where: the file's path, which every error message starts with.

  Raises:
    CheckpointCorruptedError: not valid JSON, not our format, an unknown
      version, or entries that do not fit together.
  """
  try:
    manifest = json.loads(raw.decode("utf-8"))
  except (ValueError, RecursionError) as e:  # Also bad UTF-8, deep nesting.
    raise _corrupt(where, f"not valid JSON ({e!s:.200})") from e
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
    raise _corrupt(where, f"not a {FORMAT_NAME} manifest")
  version = manifest.get("format_version")
  if version != FORMAT_VERSION:
    raise _corrupt(where, f"format_version {version!r} is not supported by"
                   f" this version of {FORMAT_NAME} (reads {FORMAT_VERSION})")
  step = manifest.get("step")
  if not (_is_int(step) and step >= 0):
    raise _corrupt(where, f"bad 'step' entry {step!r:.60}")
  files = manifest.get("files")
  if not isinstance(files, dict) or not all(
      isinstance(k, str) and isinstance(v, int) and v >= 0
      and _safe_relative(k) for k, v in files.items()):
    raise _corrupt(where, "bad 'files' table")
  checksum = manifest.get("checksum")
  if not (isinstance(checksum, dict) and checksum.get("algorithm") == "crc32c"
          and _is_int(checksum.get("block_bytes"))
          and checksum["block_bytes"] > 0):
    raise _corrupt(where, f"bad 'checksum' entry {checksum!r:.200}")
  leaves = manifest.get("leaves")
  if not isinstance(leaves, list):
    raise _corrupt(where, "no 'leaves' list")
  scope = manifest.get("scope")
  if scope is not None:
    if not (isinstance(scope, dict) and all(
        _is_int(scope.get(k)) for k in ("process_index", "process_count"))
            and 0 <= scope["process_index"] < scope["process_count"]):
      raise _corrupt(where, f"bad 'scope' entry {scope!r:.200}")
    scope = (scope["process_index"], scope["process_count"])
  created_unix = _optional(manifest.get("created_unix"), (int, float))
  old_writer = (created_unix is not None
                and created_unix < BIG_ENDIAN_WRITTEN_UNTIL)
  records, paths = [], set()
  for leaf in leaves:
    try:
      record = _leaf(leaf, where, files, checksum["block_bytes"],
                     partial=scope is not None, big_endian_ok=old_writer)
    except CheckpointCorruptedError as e:  # Which leaf, for the writer.
      e.leaf_path = leaf.get("path") if isinstance(leaf, dict) else None
      raise
    if record.path in paths:
      raise _corrupt(where, f"leaf {record.path!r} appears twice")
    paths.add(record.path)
    records.append(record)
  return Manifest(
      format=FORMAT_NAME, format_version=version, step=step,
      created=_optional(manifest.get("created"), (str,)),
      created_unix=created_unix,
      process_count=_optional(manifest.get("process_count"), (int,)),
      byte_order=_optional(manifest.get("byte_order"), (str,)),
      files=dict(files), checksum_algorithm=checksum["algorithm"],
      checksum_block_bytes=checksum["block_bytes"], leaves=tuple(records),
      extra=manifest.get("extra"), metrics=manifest.get("metrics"),
      scope=scope,
      data_states=datastate.parse(manifest.get("data_states"), where),
      retention=manifest.get("retention"))


def read(step_dir: epath.Path, step: int | None = None,
         backend: interface.Backend | None = None) -> Manifest:
  """Reads and validates `manifest.json` of a step directory.

  Args:
    step_dir: the step's directory.
    step: the step the directory is named after, if known: a manifest that
      records another step (a directory copied or renamed by hand) is then
      refused rather than restored or reported as that step.
    backend: the directory's storage (default: by the path's scheme).

  Raises:
    FileNotFoundError: no manifest.
    CheckpointCorruptedError: not a regular file inside `step_dir` of at
      most `MAX_MANIFEST_BYTES`, not valid JSON, not our format, an unknown
      version, entries that do not fit together, or another step than
      `step`; the message names the file.
  """
  return of_step(read_raw(step_dir, backend), step_dir, step)


def read_raw(step_dir: epath.Path,
             backend: interface.Backend | None = None) -> bytes:
  """The bytes of `manifest.json` of a step directory, unchecked (see
  `read` for the errors but those of `of_step`)."""
  path = step_dir / MANIFEST
  backend = backend or interface.for_path(step_dir)
  try:
    return backend.read_small(path, within=step_dir, limit=MAX_MANIFEST_BYTES)
  except FileNotFoundError as e:
    raise FileNotFoundError(f"no {MANIFEST} in {step_dir}") from e
  except OSError as e:
    if e.errno not in NOT_A_FILE:
      raise  # EACCES, EIO...: the file may be fine; do not call it bad.
    raise _corrupt(str(path), f"cannot be read as a file ({e.strerror})")


def of_step(raw: bytes, step_dir: epath.Path, step: int | None) -> Manifest:
  """`parse`, for the manifest of `step_dir` (read elsewhere, maybe by
  another process), refused if it records another step than `step`."""
  path = step_dir / MANIFEST
  manifest = parse(raw, str(path))
  if step is not None and manifest.step != step:
    raise CheckpointCorruptedError(
        f"{path}: records step {manifest.step!r}, but lives in the directory"
        f" of step {step}")
  return manifest


def checked_text(manifest: dict[str, Any],
                 origins: dict[str, dict[int, list[list[list[int]]]]],
                 where: str) -> str:
  """The JSON of a merged manifest, once the reader (`manifest.parse`)
  accepts it: a step is finalized only if it would restore.

  Args:
    manifest: the merged manifest (see `writer.merge_tables`).
    origins: per leaf path, the shard indices each process wrote.
    where: the step, for messages.

  Raises:
    SaveFailedError: the reader would refuse it; names the leaf and every
      process's shards of it.
  """
  text = json.dumps(manifest)  # indent= would take the slow Python encoder.
  if len(text) > MAX_MANIFEST_BYTES:  # `read` would refuse it.
    raise SaveFailedError(
        f"{where}: its manifest would have {len(text)} bytes, over the"
        f" {MAX_MANIFEST_BYTES} that a restore reads. Not"
        " finalized.")
  try:
    parse(text.encode(), where)
  except CheckpointCorruptedError as e:
    views = origins.get(getattr(e, "leaf_path", None), {})
    shards = "; ".join(
        f"process {p}: {idx[:8]}" + (" ..." if len(idx) > 8 else "")
        for p, idx in sorted(views.items()))
    raise SaveFailedError(
        f"{e}; the shards each process wrote: {shards or 'none'}. Not"
        " finalized: the step would not restore. Do all processes save the"
        " same state, with the same shardings?") from None
  return text
