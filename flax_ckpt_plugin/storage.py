"""Storage format v1: a JSON manifest and one data file per process.

A step directory holds:

* `manifest.json` - format name and version, step, timestamps, every leaf by
  key path with its kind, dtype and global shape, and for every shard the
  file, byte offset, byte count and the shard's index in the global array;
  user `extra` state and `metrics`.
* `data/process_NNNNN.bin` - the raw little-endian C-order bytes of the
  shards that process NNNNN owns, one after another.
* `_COMMITTED` - the commit marker (see `atomicity`).

While a step is written, each process also leaves `data/process_NNNNN.json`
(its shard table); the primary host merges those into the manifest and
removes them before finalizing. `docs/format.md` describes the format for
readers with numpy alone; `manifest` reads and validates the manifest and
`reader` the data files. Nothing here unpickles or executes anything.
"""

from __future__ import annotations

import datetime
import json
import math
import time
import threading
from typing import Any, Iterable, TYPE_CHECKING

import crc32c
from etils import epath
import numpy as np

from flax_ckpt_plugin import backend as backend_lib
from flax_ckpt_plugin import datafile

if TYPE_CHECKING:  # snapshot imports jax; the CLI reads without it.
  from flax_ckpt_plugin.snapshot import LeafSnapshot

FORMAT_NAME = "flax_ckpt_plugin"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA_DIR = "data"
# Every shard carries a CRC-32C per block of this many bytes (the last block
# may be shorter), so a reader of part of a shard verifies whole blocks only.
CHECKSUM_BLOCK = 4 << 20


def data_file(process_index: int) -> str:
  return f"{DATA_DIR}/process_{process_index:05d}.bin"


def index_file(process_index: int) -> str:
  return f"{DATA_DIR}/process_{process_index:05d}.json"


def _write_all(f, buf: memoryview) -> None:
  while buf:
    n = f.write(buf[:datafile.CHUNK])
    if n is None:  # Non-blocking streams only; not expected for files.
      raise OSError("short write")
    buf = buf[n:]


def block_checksums(buf: memoryview, block: int = CHECKSUM_BLOCK) -> list[int]:
  """CRC-32C of each `block`-byte block of `buf` (one for an empty buffer)."""
  if not buf:
    return [crc32c.crc32c(b"")]
  return [crc32c.crc32c(buf[i:i + block]) for i in range(0, len(buf), block)]


def _as_bytes(arr: np.ndarray) -> np.ndarray:
  # Views through uint8 also work for dtypes the buffer protocol lacks
  # (bfloat16, float8, int4 from ml_dtypes).
  return np.asarray(arr, order="C").reshape(-1).view(np.uint8)


def write_process_files(step_dir: epath.Path, leaves: list[LeafSnapshot],
                        process_index: int, *,
                        identity: backend_lib.Identity | None = None,
                        backend: backend_lib.Backend | None = None) -> int:
  """Writes this process's shards and shard table; returns the shards' bytes.

  Called on every process, each into the same temporary step directory. The
  data file is fsynced before the shard table is written.

  Args:
    step_dir: the step's temporary directory.
    leaves: this process's snapshot.
    process_index: names the files.
    identity: the identity of `step_dir` when the primary host made it
      (local disks); a different directory there raises
      `ConcurrentWriterError`.
    backend: the directory's storage backend (default: by its scheme).
  """
  backend = backend or backend_lib.for_path(step_dir)
  out = backend.step_writer(step_dir, identity, DATA_DIR)
  try:
    entries = []
    offset = 0  # The data file's size.
    name = data_file(process_index)
    shards = [(leaf, s) for leaf in leaves for s in leaf.shards]
    if shards:
      if out.positional:
        offset = _write_by_offset(out, name, shards, entries)
      else:
        with out.open(name) as f:
          for leaf, shard in shards:
            buf = _as_bytes(shard.host())
            _write_all(f, memoryview(buf))
            entries.append(_entry(leaf, shard, name, offset, buf))
            offset += buf.nbytes
    table = {"process_index": process_index, "file": name if shards else None,
             "nbytes": offset, "shards": entries}
    with out.open(index_file(process_index)) as f:
      f.write(json.dumps(table).encode())
      out.sync(f)
  finally:
    out.close()
  return sum(e["nbytes"] for e in entries)


def _entry(leaf: LeafSnapshot, shard: Any, name: str, offset: int,
           buf: np.ndarray, sums: list[int] | None = None) -> dict:
  return {"path": leaf.path, "file": name, "offset": offset,
          "nbytes": buf.nbytes, "index": [list(r) for r in shard.index],
          "crc32c": block_checksums(memoryview(buf)) if sums is None else sums}


def _write_by_offset(out: backend_lib.StepWriter, name: str,
                     shards: list[Any], entries: list[dict]) -> int:
  """Writes the data file by offset (local disks); returns its size.

  The checksums are computed by a second thread while this one writes
  (both release the GIL), so a save costs about its slower half.
  """
  bufs = [_as_bytes(shard.host()) for _, shard in shards]
  # A plain thread, not a pool: a commit that finishes while the interpreter
  # exits (see async_commit) may no longer start pool work.
  sums: list[list[int]] = []
  failed: list[BaseException] = []

  def checksum() -> None:
    try:
      sums.extend(block_checksums(memoryview(b)) for b in bufs)
    except BaseException as e:  # pylint: disable=broad-except
      failed.append(e)

  summer = threading.Thread(target=checksum, name="flax_ckpt_plugin-checksum")
  summer.start()
  try:
    data = datafile.DataFile(out, name)
    try:
      offsets = [data.place(b) for b in bufs]
      for buf, offset in zip(bufs, offsets):
        data.write(buf, offset)
      data.sync()
    finally:
      data.close()
  finally:
    summer.join()
  if failed:
    raise failed[0]
  for (leaf, shard), buf, offset, crcs in zip(shards, bufs, offsets, sums):
    entries.append(_entry(leaf, shard, name, offset, buf, crcs))
  return data.end


def _volume(index: Iterable[Iterable[int]]) -> int:
  return math.prod(stop - start for start, stop in index)


def extra_to_json(value: Any, what: str = "extra") -> Any:
  """`extra` as the JSON it is stored as; TypeError if it cannot be."""
  try:
    return json.loads(json.dumps(value, allow_nan=False))
  except (TypeError, ValueError) as e:
    raise TypeError(f"{what} must be JSON-serializable (dicts, lists, str,"
                    f" int, finite float, bool, None): {e}") from e


def metrics_to_json(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
  """Metrics as stored: str keys, float values; TypeError otherwise."""
  if metrics is None:
    return None
  out = {}
  for k, v in metrics.items():
    try:
      out[str(k)] = float(v)  # jax and numpy scalars too.
    except (TypeError, ValueError) as e:
      raise TypeError(f"metric {k!r} is not a number: {v!r}") from e
  return out


def write_manifest(step_dir: epath.Path, *, step: int,
                   leaves: list[LeafSnapshot], process_count: int,
                   extra: Any, metrics: dict[str, Any] | None,
                   backend: backend_lib.Backend | None = None) -> dict:
  """Merges every process's shard table into `manifest.json`.

  Primary host only, after all processes wrote. Checks that the shards
  written cover every array exactly once.

  Raises:
    RuntimeError: a process's table is missing or the shards do not cover an
      array (the save is then abandoned, never finalized).
  """
  by_path = {leaf.path: dict(leaf.meta(), shards=[]) for leaf in leaves}
  files = {}
  for p in range(process_count):
    table_path = step_dir / index_file(p)
    if not table_path.exists():
      raise RuntimeError(f"process {p} left no shard table at {table_path}")
    table = json.loads(table_path.read_text())
    if table["file"]:
      files[table["file"]] = table["nbytes"]
    for entry in table["shards"]:
      leaf = by_path.get(entry.pop("path"))
      if leaf is None or leaf["kind"] not in ("array", "numpy"):
        raise RuntimeError(
            f"process {p} wrote a shard of a leaf the primary host does not"
            " have: do all processes save the same tree?")
      leaf["shards"].append(entry)
  for leaf in by_path.values():
    if leaf["kind"] in ("array", "numpy"):
      leaf["shards"].sort(key=lambda e: e["index"])
      covered = sum(_volume(e["index"]) for e in leaf["shards"])
      if covered != math.prod(leaf["shape"]):
        raise RuntimeError(
            f"leaf {leaf['path']!r}: the shards written cover {covered} of"
            f" {math.prod(leaf['shape'])} elements")
    else:
      del leaf["shards"]
  now = time.time()
  manifest = {
      "format": FORMAT_NAME,
      "format_version": FORMAT_VERSION,
      "step": step,
      "created_unix": now,
      "created": datetime.datetime.fromtimestamp(
          now, datetime.timezone.utc).isoformat(),
      "process_count": process_count,
      "byte_order": "little",
      "files": files,
      "checksum": {"algorithm": "crc32c", "block_bytes": CHECKSUM_BLOCK},
      "leaves": list(by_path.values()),
      "extra": extra,
      "metrics": metrics,
  }
  backend = backend or backend_lib.for_path(step_dir)
  backend.write_small(step_dir / MANIFEST, json.dumps(manifest, indent=1))
  for p in range(process_count):
    (step_dir / index_file(p)).unlink(missing_ok=True)
  backend.fsync(step_dir / DATA_DIR)
  backend.fsync(step_dir)
  return manifest
