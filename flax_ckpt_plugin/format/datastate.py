"""Per-process data state: where each process's data pipeline stood.

In a multi-host job every process reads its own slice of the data, so each
has its own iterator position (Grain keeps one state per process). Each
process stores its state with the step, itself, in a file of its own
(`data/process_NNNNN.state`), and a restore gives each process its own
state back. Nothing executable is stored: a state is either bytes (stored
as they are) or a JSON value (stored as UTF-8 JSON text). The manifest
lists each process's file with its size and CRC-32C (`data_states`,
docs/format.md).

A data iterator is any object with `get_state()` and `set_state(state)`:
Grain's `DataLoaderIterator` (bytes) and its dataset iterators (dicts),
or a class of the user's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Protocol

import crc32c
from etils import epath
import numpy as np

from flax_ckpt_plugin.backends import layout
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import DataStateMismatchError
from flax_ckpt_plugin.errors import Unsuitable
from flax_ckpt_plugin.format.records import DataStateRecord as Record
from flax_ckpt_plugin.logs import log

ENCODINGS = ("bytes", "json")
# The most bytes of one process's state that a restore reads.
MAX_STATE_BYTES = 256 << 20


class DataIterator(Protocol):

  def get_state(self) -> Any:
    ...

  def set_state(self, state: Any) -> None:
    ...


@dataclasses.dataclass(frozen=True)
class Encoded:
  """One process's state as stored."""
  encoding: str  # 'bytes' | 'json'
  data: bytes


def state_file(process_index: int) -> str:
  # Not `.bin`: the data files are the step's only `.bin` files.
  return f"{layout.DATA_DIR}/process_{process_index:05d}.state"


def to_plain(value: Any) -> Any:
  """JSON's types for numpy's scalars and arrays (what loaders hand out)."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def encode(value: Any) -> Encoded:
  """Bytes as they are, anything else as JSON; TypeError if it cannot be."""
  if isinstance(value, (bytes, bytearray, memoryview)):
    return Encoded("bytes", bytes(value))
  try:
    text = json.dumps(value, allow_nan=False, default=to_plain)
  except (TypeError, ValueError) as e:
    raise TypeError(
        "a data state must be bytes or JSON-serializable (dicts, lists, str,"
        f" int, finite float, bool, None, numpy scalars): {e}") from e
  return Encoded("json", text.encode("utf-8"))


def decode(encoding: str, raw: bytes, where: str) -> Any:
  if encoding == "bytes":
    return raw
  try:
    return json.loads(raw.decode("utf-8"))
  except ValueError as e:
    raise CheckpointCorruptedError(
        f"{where}: not valid JSON ({e!s:.200})") from e


def table_entry(process_index: int, encoded: Encoded) -> dict[str, Any]:
  return {"file": state_file(process_index), "encoding": encoded.encoding,
          "nbytes": len(encoded.data), "crc32c": crc32c.crc32c(encoded.data)}


def parse(value: Any, where: str) -> dict[int, Record] | None:
  """The manifest's `data_states` (None if absent); corrupted if bad."""
  if value is None:
    return None
  if not isinstance(value, dict):
    raise CheckpointCorruptedError(f"{where}: bad 'data_states' entry")
  out = {}
  for key, entry in value.items():
    if not (isinstance(key, str) and key.isdigit() and isinstance(entry, dict)
            and entry.get("file") == state_file(int(key))
            and entry.get("encoding") in ENCODINGS
            and _is_count(entry.get("nbytes"))
            and _is_count(entry.get("crc32c"))):
      raise CheckpointCorruptedError(
          f"{where}: bad 'data_states' entry {key!r}: {entry!r:.200}")
    out[int(key)] = Record(entry["file"], entry["encoding"], entry["nbytes"],
                           entry["crc32c"])
  return out


def _is_count(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read(step_dir: epath.Path, records: dict[int, Record] | None,
         saved_by: int | None, process_index: int, process_count: int,
         backend: Any) -> Any:
  """This process's state in the step at `step_dir`, checked; None if the
  step has none for it.

  Raises:
    DataStateMismatchError: the step was saved by another process count.
    CheckpointCorruptedError: the file is missing, short or damaged.
  """
  if not records:
    return None
  if saved_by is not None and saved_by != process_count:
    raise DataStateMismatchError(
        f"{step_dir}: its data states were saved by {saved_by} processes,"
        f" and this job has {process_count}: a data position of one process"
        " of another split of the data means nothing here. Restore without"
        " the data state (restore_data_state=False) and start the data"
        " pipeline afresh, or relaunch with the same process count.")
  record = records.get(process_index)
  if record is None:
    return None
  return load(step_dir, record, backend)


def load(step_dir: epath.Path, record: Record, backend: Any) -> Any:
  """One state file, checked against its record; CheckpointCorruptedError
  (naming the file) if it is missing, short or damaged."""
  path = step_dir / record.file
  try:
    raw = backend.read_small(path, within=step_dir, limit=MAX_STATE_BYTES)
  except FileNotFoundError as e:
    raise CheckpointCorruptedError(f"{path}: missing") from e
  if len(raw) != record.nbytes or crc32c.crc32c(raw) != record.crc32c:
    raise CheckpointCorruptedError(
        f"{path}: {len(raw)} bytes that do not match the manifest's size"
        f" ({record.nbytes}) and CRC-32C: the data state is damaged")
  return decode(record.encoding, raw, str(path))


def of_step(step_dir: epath.Path, manifest: Any, coordinator: Any,
            backend: Any) -> Any:
  """This process's state in a step (see `read`); `manifest` is the
  step's `manifest.Manifest`."""
  # (A local-tier step holds its one process's state, and the local tier
  # restores only on the process count that wrote it.)
  saved_by = None if manifest.scope else manifest.process_count
  return read(step_dir, manifest.data_states, saved_by,
              coordinator.process_index, coordinator.process_count, backend)


def prepare(iterator: DataIterator, step_dir: epath.Path, manifest: Any,
            coordinator: Any, backend: Any) -> Callable[[], None]:
  """Reads this process's state for `iterator` before a restore; returns
  what gives it to the iterator, once the state restored.

  Raises:
    errors.Unsuitable: the step holds other processes' states but not
      this one's (a step the survivors of a lost process saved): a restore
      that tries steps in turn skips it.
    DataStateMismatchError, CheckpointCorruptedError: see `read`.
  """
  state = of_step(step_dir, manifest, coordinator, backend)
  if state is not None:
    return lambda: iterator.set_state(state)
  if manifest.data_states:
    raise Unsuitable(
        f"{step_dir} holds no data state of process"
        f" {coordinator.process_index} (the survivors of a lost process"
        " saved it?): an older step resumes the data exactly")
  log.warning("%s holds no data state: the data iterator is left as it is",
              step_dir)
  return lambda: None
