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
readers with numpy alone. Nothing here unpickles or executes anything.
"""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
import stat
import threading
import time
from typing import Any, Iterable

import crc32c
from etils import epath
import jax.numpy as jnp
import numpy as np

from flax_ckpt_plugin import atomicity
from flax_ckpt_plugin import datafile
from flax_ckpt_plugin import object_store
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import ConcurrentWriterError
from flax_ckpt_plugin.snapshot import LeafSnapshot

FORMAT_NAME = "flax_ckpt_plugin"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA_DIR = "data"
# Every shard carries a CRC-32C per block of this many bytes (the last block
# may be shorter), so a reader of part of a shard verifies whole blocks only.
CHECKSUM_BLOCK = 4 << 20


# Errors that mean a manifest's file name cannot name a data file.
_NOT_A_DATA_FILE = (errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
                    errno.ELOOP, errno.ENXIO)


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


class _StepDirWriter:
  """Creates this process's files in one step directory.

  On local disks the directory is opened once and checked against the
  identity the primary host recorded when it made it; files are then
  created relative to that descriptor, so if another writer replaces the
  directory by name, this process never writes into the replacement.
  """

  def __init__(self, step_dir: epath.Path,
               identity: tuple[int, int] | None):
    self._dir = step_dir
    self._fd = self._data_fd = None
    if not atomicity.is_local(step_dir):
      # Object stores: no directory to make or to hold (a prefix exists
      # once an object under it does); each file is one object, uploaded
      # when it is closed.
      self._dir = object_store.as_path(step_dir)
      return
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    self._fd = os.open(os.fspath(step_dir), flags)
    st = os.fstat(self._fd)
    if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
      self.close()
      raise ConcurrentWriterError(
          f"{step_dir} is no longer the directory this save was started in:"
          " another writer replaced it. This save is abandoned.")
    try:
      os.mkdir(DATA_DIR, dir_fd=self._fd)
    except FileExistsError:
      pass
    self._data_fd = os.open(DATA_DIR, flags, dir_fd=self._fd)

  @property
  def local(self) -> bool:
    return self._data_fd is not None

  def open(self, name: str):
    """A binary file for writing at `name` (relative to the step dir)."""
    if self._data_fd is None:
      return (self._dir / name).open("wb")
    base = name.split("/", 1)[1]  # Every file here lives in DATA_DIR.
    fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                 0o644, dir_fd=self._data_fd)
    return open(fd, "wb", buffering=0)

  def open_direct(self, name: str) -> int | None:
    """A second, O_DIRECT descriptor of `name` (opened by `open` first).

    None on object stores, or where the file system refuses direct I/O.
    """
    if self._data_fd is None:
      return None
    base = name.split("/", 1)[1]
    try:
      return os.open(base, os.O_WRONLY | datafile.O_DIRECT | os.O_CLOEXEC,
                     dir_fd=self._data_fd)
    except OSError as e:
      if e.errno != errno.EINVAL:
        raise
      return None

  def sync(self, f) -> None:
    if self._data_fd is not None:
      os.fsync(f.fileno())

  def close(self) -> None:
    for fd in (self._data_fd, self._fd):
      if fd is not None:
        os.close(fd)
    self._fd = self._data_fd = None


def write_process_files(step_dir: epath.Path, leaves: list[LeafSnapshot],
                        process_index: int, *,
                        identity: tuple[int, int] | None = None) -> int:
  """Writes this process's shards and shard table; returns the shards' bytes.

  Called on every process, each into the same temporary step directory. The
  data file is fsynced before the shard table is written.

  Args:
    step_dir: the step's temporary directory.
    leaves: this process's snapshot.
    process_index: names the files.
    identity: (st_dev, st_ino) of `step_dir` when the primary host made it
      (local disks); a different directory there raises
      `ConcurrentWriterError`.
  """
  out = _StepDirWriter(step_dir, identity)
  try:
    entries = []
    offset = 0  # The data file's size.
    name = data_file(process_index)
    shards = [(leaf, s) for leaf in leaves for s in leaf.shards]
    if shards:
      if out.local:
        offset = _write_local(out, name, shards, entries)
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


def _write_local(out: "_StepDirWriter", name: str, shards: list[Any],
                 entries: list[dict]) -> int:
  """Writes the data file on a local disk; returns its size.

  The checksums are computed by a second thread while this one writes
  (both release the GIL), so a save costs about its slower half.
  """
  bufs = [_as_bytes(shard.host()) for _, shard in shards]
  # A plain thread, not a pool: a commit that finishes while the interpreter
  # exits (see async_commit) may no longer start pool work.
  sums: list[list[int]] = []
  summer = threading.Thread(
      target=lambda: sums.extend(block_checksums(memoryview(b))
                                 for b in bufs),
      name="flax_ckpt_plugin-checksum")
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
  if len(sums) != len(bufs):
    raise RuntimeError("computing the checksums of the shards failed")
  for (leaf, shard), buf, offset, crcs in zip(shards, bufs, offsets, sums):
    entries.append(_entry(leaf, shard, name, offset, buf, crcs))
  return data.end


def _volume(index: Iterable[Iterable[int]]) -> int:
  return math.prod(stop - start for start, stop in index)


def write_manifest(step_dir: epath.Path, *, step: int,
                   leaves: list[LeafSnapshot], process_count: int,
                   extra: Any, metrics: dict[str, Any] | None) -> dict:
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
  atomicity.write_small_file(step_dir / MANIFEST,
                             json.dumps(manifest, indent=1))
  for p in range(process_count):
    (step_dir / index_file(p)).unlink(missing_ok=True)
  atomicity.fsync_path(step_dir / DATA_DIR)
  atomicity.fsync_path(step_dir)
  return manifest


def parse_dtype(name: Any, where: str) -> np.dtype:
  """A numeric dtype from its manifest name; anything else is corruption."""
  try:
    dtype = jnp.dtype(name)
  except (TypeError, ValueError) as e:
    raise CheckpointCorruptedError(f"{where}: unknown dtype {name!r}") from e
  if dtype.hasobject or dtype.names is not None or dtype.itemsize == 0:
    raise CheckpointCorruptedError(f"{where}: dtype {name!r} is not allowed")
  return dtype


def _corrupt(where: str, what: str) -> CheckpointCorruptedError:
  return CheckpointCorruptedError(f"{where}: {what}")


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _check_exact_cover(indices: list[list[list[int]]], shape: list[int],
                       lw: str) -> None:
  """Shards must tile the array: no element missing, none twice."""
  total = sum(_volume(i) for i in indices)
  if total != math.prod(shape):
    raise _corrupt(lw, f"shards cover {total} elements of"
                   f" {math.prod(shape)}")
  if not shape:
    return  # One element: the count above settles it.
  boxes = sorted(indices)  # By start along the first axis, then the rest.
  for a in range(len(boxes)):
    for b in range(a + 1, len(boxes)):
      if boxes[b][0][0] >= boxes[a][0][1]:
        break  # Starts after `a` ends along the first axis, as do the rest.
      if all(max(r[0], s[0]) < min(r[1], s[1])
             for r, s in zip(boxes[a], boxes[b])):
        raise _corrupt(lw, f"shards {boxes[a]} and {boxes[b]} overlap")


def _check_leaf(leaf: Any, where: str, files: dict[str, int],
                block: int) -> None:
  if not isinstance(leaf, dict) or not isinstance(leaf.get("path"), str):
    raise _corrupt(where, "a leaf entry has no path")
  lw = f"{where}, leaf {leaf['path']!r}"
  kind = leaf.get("kind")
  if kind in ("int", "float", "bool"):
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
    return
  if kind not in ("array", "numpy"):
    raise _corrupt(lw, f"unknown kind {kind!r}")
  dtype = parse_dtype(leaf.get("dtype"), lw)
  shape = leaf.get("shape")
  if not (isinstance(shape, list) and len(shape) <= 64 and all(
      _is_int(d) and 0 <= d < 2**62 for d in shape)):
    raise _corrupt(lw, f"bad shape {shape!r:.200}")
  shards = leaf.get("shards")
  if not isinstance(shards, list):
    raise _corrupt(lw, "no shard list")
  for s in shards:
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
  _check_exact_cover([s["index"] for s in shards], shape, lw)


def read_manifest(step_dir: epath.Path) -> dict:
  """Reads and validates `manifest.json` of a step directory.

  Raises:
    FileNotFoundError: no manifest.
    CheckpointCorruptedError: not valid JSON, not our format, an unknown
      version, or entries that do not fit together; the message names the file.
  """
  path = step_dir / MANIFEST
  try:
    raw = path.read_bytes()
  except FileNotFoundError as e:
    raise FileNotFoundError(f"no {MANIFEST} in {step_dir}") from e
  where = str(path)
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
  paths = set()
  for leaf in leaves:
    _check_leaf(leaf, where, files, checksum["block_bytes"])
    if leaf["path"] in paths:
      raise _corrupt(where, f"leaf {leaf['path']!r} appears twice")
    paths.add(leaf["path"])
  return manifest


def _safe_relative(name: str) -> bool:
  """A data file name that cannot leave the step directory."""
  parts = name.split("/")
  return (not name.startswith("/") and "\\" not in name and
          all(p not in ("", ".", "..") for p in parts))


class ByteReader:
  """Reads byte ranges of a step's data files; one open handle per file.

  Safe to use from several threads: local files are read with positional
  reads of one shared descriptor; files in object stores with one ranged
  GET per range (`object_store.ObjectFile`).
  """

  def __init__(self, step_dir: epath.Path, files: dict[str, int]):
    self._dir = step_dir
    self._sizes = files
    self._fds: dict[str, Any] = {}
    self._lock = threading.Lock()
    self.bytes_read = 0
    # Each read costs a request on object stores: readers of a few spread
    # ranges should rather fetch the span around them in one (see restore).
    self.prefers_few_reads = not atomicity.is_local(step_dir)

  def _open(self, name: str):
    with self._lock:
      return self._open_locked(name)

  def _open_locked(self, name: str):
    fd = self._fds.get(name)
    if fd is None:
      path = self._dir / name
      try:
        fd, size = self._open_new(path)
      except FileNotFoundError as e:
        raise CheckpointCorruptedError(
            f"data file {path} named by the manifest is missing") from e
      except OSError as e:
        if e.errno not in _NOT_A_DATA_FILE:
          raise  # EACCES, EIO...: the file may be fine; do not call it bad.
        raise CheckpointCorruptedError(
            f"data file {path} named by the manifest cannot be a data file:"
            f" {e.strerror}") from e
      except CheckpointCorruptedError:
        raise  # A ValueError too, but already says what is wrong.
      except ValueError as e:  # A NUL byte in the name.
        raise CheckpointCorruptedError(
            f"data file name {name!r:.100} is not a valid file name") from e
      self._fds[name] = fd
      if size < self._sizes[name]:
        raise CheckpointCorruptedError(
            f"data file {path} is truncated: {size} bytes, manifest says"
            f" {self._sizes[name]}")
    return fd

  def _open_new(self, path: epath.Path) -> tuple[Any, int]:
    """An fd (local disks) or an `object_store.ObjectFile`, and the file's size."""
    if not atomicity.is_local(path):
      f = object_store.ObjectFile(path)
      return f, f.size
    real_dir = os.path.realpath(os.fspath(self._dir))
    real = os.path.realpath(os.fspath(path))
    if os.path.commonpath([real_dir, real]) != real_dir:
      raise CheckpointCorruptedError(
          f"data file {path} leads outside the step directory")
    # O_NONBLOCK: opening a named pipe must not wait for a writer.
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      os.close(fd)
      raise CheckpointCorruptedError(
          f"data file {path} is not a regular file")
    return fd, st.st_size

  def read_into(self, name: str, offset: int, out: memoryview) -> None:
    """Fills `out` with the bytes at [offset, offset + len(out)) of `name`."""
    fd = self._open(name)
    done = 0
    while done < len(out):
      if isinstance(fd, int):
        n = os.preadv(fd, [out[done:]], offset + done)
      else:
        n = fd.read_into(offset + done, out[done:])
        if n < len(out) - done:  # Ranged GETs stop only at the end.
          done, n = done + n, 0
      if not n:
        raise CheckpointCorruptedError(
            f"data file {self._dir / name} ended at byte {offset + done},"
            f" expected {offset + len(out)}")
      done += n
    with self._lock:
      self.bytes_read += done

  def close(self) -> None:
    for fd in self._fds.values():
      if isinstance(fd, int):
        os.close(fd)
      else:
        fd.close()
    self._fds.clear()
