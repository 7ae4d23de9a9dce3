"""What a save, a restore and a finalized step report to the user."""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Protocol

from etils import epath


@dataclasses.dataclass(frozen=True)
class SaveStats:
  """One finalized save: what commit hooks receive, and `last_save_stats`."""
  step: int  # The step saved.
  blocking_secs: float  # Time the caller of `save` waited.
  commit_secs: float  # From the end of the snapshot until finalized.
  process_bytes: int  # Bytes of array data this process wrote.
  total_bytes: int = 0  # Bytes of array data of the whole checkpoint.
  path: epath.Path | None = None  # The finalized step directory.
  finalized_at: float = 0.0  # time.time() when it became durable.
  # Bytes of this process's accelerator shards copied on their devices
  # (the commit moved them to the host) because the runtime refused pinned
  # host memory, at this save or lately (see docs/loop.md); 0 otherwise.
  pinned_fallback_bytes: int = 0
  # Bytes of this process's accelerator shards copied on their devices
  # (the commit moved them to the host) because their pinned host memory
  # was not pinned yet: a save before the reservation was done (see
  # `CheckpointManager.warm_up`; the first save of a process without a
  # warm-up).
  unpinned_bytes: int = 0

  @property
  def gbytes_per_sec(self) -> float:
    """The checkpoint's size over the commit time."""
    return self.total_bytes / 1e9 / self.commit_secs if self.commit_secs else 0.0


@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """What a finalized step records besides its arrays."""
  step: int  # The step number.
  created: str  # ISO 8601, UTC.
  created_unix: float  # Seconds since the epoch; NaN if not recorded.
  extra: Any  # The JSON-serializable `extra` given to `save`.
  metrics: dict[str, Any] | None  # The `metrics` given to `save`.
  process_count: int  # Processes that wrote it.
  total_bytes: int  # Bytes of array data of the whole checkpoint.


@dataclasses.dataclass(frozen=True)
class RestoreStats:
  """What one restore cost this process."""
  step: int  # The step restored.
  secs: float  # Wall-clock seconds of the whole `restore` call.
  nbytes_read: int  # Bytes this process read from data files.
  # Of those, the bytes taken from the snapshot of the step that this
  # process saved and still held in memory (see docs/loop.md).
  nbytes_from_memory: int = 0


def step_metadata(m: Any) -> StepMetadata:
  """A step's `StepMetadata`, from its `manifest.Manifest`; informational
  fields the manifest lacks get defaults."""
  return StepMetadata(
      step=m.step, created="" if m.created is None else m.created,
      created_unix=math.nan if m.created_unix is None else m.created_unix,
      extra=m.extra, metrics=m.metrics,
      process_count=1 if m.process_count is None else m.process_count,
      total_bytes=m.total_bytes)


class MetricWriter(Protocol):
  """What the callback needs of a metric writer (clu's `MetricWriter` fits)."""

  def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
    ...


class SaveMetrics:
  """A callback's metrics of each finalized save, for its metric writer.

  `record` is a commit hook (the commit thread); `flush` writes from the
  loop's thread, since metric writers are not promised to be thread-safe.
  """

  def __init__(self, writer: MetricWriter | None):
    self._writer = writer
    self._finished: collections.deque[tuple[SaveStats, float]] = (
        collections.deque())
    self._last_durable = time.time()
    self._more: dict[int, dict[str, float]] = {}  # By step, see `add`.

  def add(self, step: int, scalars: dict[str, float]) -> None:
    """More scalars to write with the save of `step` (from the loop's
    thread)."""
    if self._writer is not None and scalars:
      self._more[step] = scalars

  def record(self, stats: SaveStats) -> None:
    since = stats.finalized_at - self._last_durable
    self._last_durable = stats.finalized_at
    self._finished.append((stats, since))

  def flush(self) -> None:
    while self._finished:
      stats, since = self._finished.popleft()
      more = self._more.pop(stats.step, {})
      for step in [s for s in self._more if s < stats.step]:
        del self._more[step]  # Saves that failed.
      self._writer.write_scalars(stats.step,
                                 {**save_metrics(stats, since), **more})


def save_metrics(stats: SaveStats, secs_since_last_durable: float
                 ) -> dict[str, float]:
  """The scalars written per save (names under 'checkpoint/')."""
  return {
      "checkpoint/blocking_secs": stats.blocking_secs,
      "checkpoint/commit_secs": stats.commit_secs,
      "checkpoint/bytes": float(stats.total_bytes),
      "checkpoint/gbytes_per_sec": stats.gbytes_per_sec,
      "checkpoint/secs_since_last_durable": secs_since_last_durable,
  }
