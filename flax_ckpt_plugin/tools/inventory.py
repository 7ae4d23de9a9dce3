"""What a checkpoint directory holds, as `flax-ckpt list` shows it.

`scan` finds every step-like entry (finalized, unfinished, being deleted,
set aside as damaged) with its size and time; `human_age` and `table` turn
them into text. Reads only, with `etils.epath`: local, `gs://` and `s3://`.
"""

from __future__ import annotations

import datetime
import json
import math
from typing import Any, TextIO

import crc32c
from etils import epath
import numpy as np

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format.records import Manifest
from flax_ckpt_plugin.manager.retention import Policy
from flax_ckpt_plugin.restore.data_files import ByteReader


def human_age(secs: float | None) -> str:
  """Seconds since something happened -> '12s ago', '3m ago', '2d ago'."""
  if secs is None or not math.isfinite(secs):
    return "?"
  if secs < 0:
    return "in the future"  # Clocks of writer and reader disagree.
  for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
    if secs < limit:
      return f"{int(secs // div)}{unit} ago"
  return f"{int(secs // 86400)}d ago"


def table(rows: list[list[str]], out: TextIO, indent: str = "") -> None:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  for r in rows:
    cells = [c.ljust(w) for c, w in zip(r, widths)]
    out.write(indent + "  ".join(cells).rstrip() + "\n")


def size_and_mtime(path: epath.Path) -> tuple[int, float | None]:
  """Bytes of the files under `path` and the newest mtime among them.

  Files that vanish meanwhile (a step being deleted) are skipped.
  """
  total, newest = 0, None
  backend = interface.for_path(path)
  try:
    entries = path.walk() if path.is_dir() else [(path.parent, [], [path.name])]
    for root, _, files in entries:
      for name in files:
        try:
          size, mtime = backend.size_and_mtime(root / name)
        except FileNotFoundError:
          continue
        total += size
        newest = mtime if newest is None else max(newest, mtime)
  except FileNotFoundError:
    pass
  return total, newest


def committed_unix(step_dir: epath.Path) -> float | None:
  """When the step was finalized, from its commit marker (a tiny file).

  None if the marker is unreadable, or no small regular file of the step.
  """
  try:
    raw = interface.for_path(step_dir).read_small(
        step_dir / atomicity.COMMIT_MARKER, within=step_dir,
        limit=interface.MAX_MARKER_BYTES)
    info = json.loads(raw.decode("utf-8"))
    return datetime.datetime.fromisoformat(info["committed_at"]).timestamp()
  except (OSError, ValueError, KeyError, TypeError, RecursionError):
    return None


def scan(directory: epath.Path) -> list[dict[str, Any]]:
  """Every step-like entry of `directory`, finalized or not, by step."""
  found = []
  for entry in directory.iterdir():
    name, state = entry.name, None
    step = atomicity.step_from_name(name)
    if step is not None:
      finalized = directory_lib.is_finalized(entry)
      state = "finalized" if finalized else "unfinished"
    else:
      for suffix, what in ((atomicity.TMP_SUFFIX, "unfinished"),
                           (atomicity.DELETING_SUFFIX, "deleting")):
        if name.endswith(suffix):
          step = atomicity.step_from_name(name[:-len(suffix)])
          state = what if step is not None else None
      base, sep, n = name.partition(atomicity.DAMAGED_SUFFIX)
      if sep and (n == "" or n.isdigit()):
        # Set aside by a restore that found it damaged: `<step>.damaged[N]`.
        step = atomicity.step_from_name(base)
        state = "damaged" if step is not None else None
    if state is None:
      continue
    nbytes, mtime = size_and_mtime(entry)
    when = committed_unix(entry) if state == "finalized" else None
    found.append({"step": step, "name": name, "state": state,
                  "bytes": nbytes, "time_unix": when or mtime})
  return sorted(found, key=lambda e: (e["step"], e["name"]))


def retention_view(directory: epath.Path, entries: list[dict[str, Any]]
                   ) -> Policy | None:
  """Adds `metrics` and `kept_by` to each finalized entry of `scan`.

  `kept_by` lists the rules of the writer's retention policy, as recorded
  in the newest manifest that has one, that keep the step (see
  `retention.Policy.reasons`); an empty list means the writer's
  retention deletes it. Without a recorded policy, `kept_by` is None.
  A manifest that cannot be read gives `metrics` None (`verify` names it).

  Returns:
    The recorded policy, or None.
  """
  finalized = [e for e in entries if e["state"] == "finalized"]
  policy = None
  times: dict[int, float | None] = {}
  for e in reversed(finalized):  # Newest first: its policy is the one.
    try:
      m = manifest_lib.read(directory / e["name"], e["step"])
    except (OSError, CheckpointCorruptedError):
      e["metrics"] = None
      continue
    e["metrics"] = m.metrics
    times[e["step"]] = m.created_unix
    policy = policy or Policy.from_json(m.retention)
  reasons = {} if policy is None else policy.reasons(
      [e["step"] for e in finalized],
      {e["step"]: e["metrics"] for e in finalized},
      times=times)
  for e in finalized:
    e["kept_by"] = reasons.get(e["step"]) if policy else None
  return policy


def zero_d_values(step_dir: epath.Path, m: Manifest
                   ) -> dict[str, Any]:
  """The value of each 0-d array leaf (a `TrainState`'s step), by path:
  a few bytes each, checked against their CRC-32C; a damaged one is
  left out (`verify` names it)."""
  wanted = [leaf for leaf in m.leaves if leaf.is_array and leaf.shape == ()
            and leaf.key_impl is None and len(leaf.shards) == 1]
  out = {}
  if not wanted:
    return out
  reader = ByteReader(step_dir, m.files, interface.for_path(step_dir))
  try:
    for leaf in wanted:
      shard = leaf.shards[0]
      buf = bytearray(shard.nbytes)
      try:
        reader.read_into(shard.file, shard.offset, memoryview(buf))
      except (OSError, ValueError):
        continue
      if crc32c.crc32c(bytes(buf)) == shard.crc32c[0]:
        out[leaf.path] = np.frombuffer(bytes(buf), leaf.dtype)[0].item()
  finally:
    reader.close()
  return out
