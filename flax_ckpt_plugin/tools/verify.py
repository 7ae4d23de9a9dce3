"""Checking every checksum of a finalized step, without restoring it.

`verify_step` reads each shard of a step in bounded chunks and compares the
CRC-32C of every block with the manifest (and each process's data state,
whole), going on after the first problem
so that one run reports all of them. `flax-ckpt verify` is built on it.
"""

from __future__ import annotations

import time
from typing import TextIO

import crc32c
from etils import epath
import numpy as np

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.format.records import Manifest
from flax_ckpt_plugin.format.records import ShardRecord
from flax_ckpt_plugin.restore.data_files import ByteReader

_VERIFY_CHUNK = 16 << 20  # Bytes read per call when verifying.
_PLAIN_PROGRESS_SECS = 5.0  # Between progress lines when stderr is no TTY.


def human_size(nbytes: float) -> str:
  """1023 -> '1023 B', 1536 -> '1.5 KiB', ... (powers of 1024)."""
  if nbytes < 1024:
    return f"{int(nbytes)} B"
  for unit in ("KiB", "MiB", "GiB", "TiB"):
    nbytes /= 1024
    if nbytes < 1024:
      break
  return f"{nbytes:.1f} {unit}"


class Progress:
  """A progress bar of bytes on `stream` (stderr).

  On a terminal one line is redrawn with carriage returns; otherwise a plain
  line is printed every few seconds and at the end, so logs stay readable.
  Each line starts with `name` (the command: verify, export).
  """

  def __init__(self, total: int, stream: TextIO | None, enabled: bool = True,
               name: str = "verify"):
    self.total = max(total, 0)
    self.name = name
    self.done = 0
    self.label = ""
    self._stream = stream
    self._enabled = enabled
    self._tty = enabled and stream.isatty()  # No stream: not enabled.
    self._start = self._last = time.monotonic()
    self._drawn = False

  def _line(self) -> str:
    frac = self.done / self.total if self.total else 1.0
    text = (f"{human_size(self.done)} / {human_size(self.total)}"
            f" ({frac:.0%}) {self.label}").rstrip()
    if not self._tty:
      return f"{self.name}: {text}"
    filled = int(frac * 30)
    return f"{self.name} [{'#' * filled}{'.' * (30 - filled)}] {text}"

  def update(self, nbytes: int = 0, label: str | None = None) -> None:
    self.done += nbytes
    if label is not None:
      self.label = label
    if not self._enabled:
      return
    now = time.monotonic()
    if self._tty and (now - self._last >= 0.1 or not self._drawn):
      self._stream.write("\r\033[K" + self._line())
      self._stream.flush()
      self._last, self._drawn = now, True
    elif not self._tty and now - self._last >= _PLAIN_PROGRESS_SECS:
      self._stream.write(self._line() + "\n")
      self._stream.flush()
      self._last = now

  def clear(self) -> None:
    """Erases the bar, so that other output can be written below it."""
    if self._tty and self._drawn:
      self._stream.write("\r\033[K")
      self._stream.flush()
      self._drawn = False

  def finish(self) -> None:
    if not self._enabled:
      return
    self.label = f"in {time.monotonic() - self._start:.1f}s"
    self._stream.write(("\r\033[K" if self._tty else "") + self._line() + "\n")
    self._stream.flush()


def _check_shard(reader: ByteReader, leaf: LeafRecord, shard: ShardRecord,
                 block: int, file_path: epath.Path, progress: Progress,
                 buf: np.ndarray) -> str | None:
  """Reads one shard in chunks and compares its CRC-32C per block.

  A block larger than `buf` is summed across chunks, so that memory does
  not grow with the block size a manifest claims.
  """
  sums = shard.crc32c
  start, nbytes = shard.offset, shard.nbytes
  view = memoryview(buf)
  pos, k, crc, filled = 0, 0, 0, 0  # Block k's CRC-32C over `filled` bytes.
  while True:
    n = min(len(view), nbytes - pos)
    reader.read_into(shard.file, start + pos, view[:n])
    at = 0
    while at < n or nbytes == 0:
      take = min(n - at, block - filled)
      crc = crc32c.crc32c(view[at:at + take], crc)
      at, filled = at + take, filled + take
      if filled < block and pos + at < nbytes:
        continue  # The block goes on in the next chunk.
      if crc != sums[k]:
        lo = start + k * block
        hi = min(lo + block, start + nbytes)
        progress.update(nbytes - pos)
        return (f"{file_path}: checksum mismatch at bytes [{lo}, {hi}) in"
                f" leaf {leaf.path!r} (shard {shard.index_list}): crc32c"
                f" {crc:#010x}, manifest says {sums[k]:#010x}")
      k, crc, filled = k + 1, 0, 0
      if nbytes == 0:
        break
    pos += n
    progress.update(n)
    if pos >= nbytes:
      return None


def verify_step(directory: epath.Path, step: int, manifest: Manifest,
                progress: Progress) -> tuple[str, list[str]]:
  """Reads every shard of `step`; returns ('ok'|'corrupt'|'error', problems)."""
  step_dir = directory / str(step)
  block = manifest.checksum_block_bytes
  reader = ByteReader(step_dir, manifest.files,
                      interface.for_path(step_dir))
  problems, errors, bad_files = [], [], set()
  try:
    for name in manifest.files:
      try:  # Opening checks that the file exists, is regular and is whole.
        reader.read_into(name, 0, memoryview(b""))
      except CheckpointCorruptedError as e:
        problems.append(str(e))
        bad_files.add(name)
      except OSError as e:
        errors.append(f"{step_dir / name}: {e.strerror or e}")
        bad_files.add(name)
    progress.update(label=f"step {step}")
    # Sized only now that the files are open and hold what the manifest
    # says, so that a manifest cannot make this allocate more than exists.
    largest = max((s.nbytes for leaf in manifest.leaves for s in leaf.shards
                   if s.file not in bad_files), default=0)
    buf = np.empty(max(1, min(_VERIFY_CHUNK, largest)), np.uint8)
    for leaf in manifest.leaves:
      for shard in leaf.shards:
        if shard.file in bad_files:
          progress.update(shard.nbytes)
          continue
        try:
          problem = _check_shard(reader, leaf, shard, block,
                                 step_dir / shard.file, progress, buf)
        except CheckpointCorruptedError as e:
          problem = f"leaf {leaf.path!r}: {e}"
        except OSError as e:
          errors.append(f"{step_dir / shard.file}: {e.strerror or e}")
          bad_files.add(shard.file)
          continue
        if problem:
          problems.append(problem)
    for record in (manifest.data_states or {}).values():
      try:
        datastate.load(step_dir, record, interface.for_path(step_dir))
      except CheckpointCorruptedError as e:
        problems.append(str(e))
      except OSError as e:
        errors.append(f"{step_dir / record.file}: {e.strerror or e}")
  finally:
    reader.close()
  if problems:
    return "corrupt", problems + errors
  return ("error", errors) if errors else ("ok", [])
