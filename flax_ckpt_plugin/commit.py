"""The background part of a save, on every process: the save protocol.

    every process                          primary host only
    prepared:  barrier                     make the step's working directory
    written:   write own shards + fsync,
               barrier
    committed: barrier                     manifest, fsync, finalize
    hooks:     barrier                     run the commit hooks
    retention                              delete steps beyond max_to_keep

A process that fails a phase records it in the coordination service's
key-value store before that phase's barrier, so every process learns of it
right after the barrier and all raise together, instead of the others
waiting for a timeout at the next one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Callable, TYPE_CHECKING

from etils import epath
import numpy as np

from flax_ckpt_plugin import atomicity as atomicity_lib
from flax_ckpt_plugin import multihost
from flax_ckpt_plugin import storage
from flax_ckpt_plugin.errors import CommitHookError
from flax_ckpt_plugin.errors import ConcurrentWriterError
from flax_ckpt_plugin.errors import SaveFailedError
from flax_ckpt_plugin.multihost import log
from flax_ckpt_plugin.snapshot import LeafSnapshot

if TYPE_CHECKING:
  from flax_ckpt_plugin.manager import CheckpointManager


@dataclasses.dataclass(frozen=True)
class SaveStats:
  """One finalized save: what commit hooks receive, and `last_save_stats`."""
  step: int  # The step saved.
  blocking_secs: float  # Time the caller of `save` waited.
  commit_secs: float  # From the end of the snapshot until finalized.
  nbytes: int  # Bytes this process wrote.
  total_bytes: int = 0  # Bytes of the whole checkpoint, all processes.
  path: epath.Path | None = None  # The finalized step directory.
  finalized_at: float = 0.0  # time.time() when it became durable.

  @property
  def gbytes_per_sec(self) -> float:
    """The checkpoint's size over the commit time."""
    return self.total_bytes / 1e9 / self.commit_secs if self.commit_secs else 0.0


CommitHook = Callable[[SaveStats], None]


def steps_to_delete(steps: list[int], max_to_keep: int | None,
                    keep_every_n_steps: int | None) -> list[int]:
  """The finalized steps that retention removes (never the newest)."""
  if max_to_keep is None:
    return []
  keep = set(sorted(steps)[-max_to_keep:])
  if keep_every_n_steps:
    keep |= {s for s in steps if s % keep_every_n_steps == 0}
  return sorted(s for s in steps if s not in keep)


def checkpoint_bytes(leaves: list[LeafSnapshot]) -> int:
  """Bytes of every array leaf of the whole (global) state."""
  return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
             for leaf in leaves if leaf.dtype is not None)


def check_still_writer(mgr: CheckpointManager, consequence: str) -> None:
  """Raises ConcurrentWriterError if another job claimed the directory."""
  # pylint: disable=protected-access
  writer = atomicity_lib.current_writer(mgr.directory)
  if writer is None or writer.get("token") != mgr._writer_token:
    raise ConcurrentWriterError(
        f"another job opened {mgr.directory} for writing after this one"
        f" (its claim: {writer}); {consequence}. Two jobs must not write"
        " one directory: stop this one, or give it another directory.")


class StepCommit:
  """Writes and finalizes one snapshot; `run` is the commit thread's body.

  Called on every process (by `CheckpointManager.save`); only the primary
  host makes, finalizes and deletes step directories and runs hooks.
  """

  # pylint: disable=protected-access  # The manager's own state.

  def __init__(self, mgr: CheckpointManager, step: int, save_id: int,
               leaves: list[LeafSnapshot], extra: Any, metrics: Any,
               blocking: float):
    self.mgr = mgr
    self.step = step
    self.leaves = leaves
    self.extra = extra
    self.metrics = metrics
    self.blocking = blocking
    self.key = f"{mgr.name}/save{save_id}/step{step}"
    self.tmp = atomicity_lib.temporary_path(mgr.directory, step,
                                            mgr.atomicity)

  def _phase(self, name: str, fn: Callable[[], Any]) -> Any:
    """Runs `fn`, then meets the others at barrier `key/name`.

    A process whose `fn` failed records that before the barrier, so after
    it every process knows and all raise together; the primary host removes
    the unfinished step. Failures are kept per phase: a process still
    finishing an earlier phase must not see a later phase's failure, or it
    would skip the barrier that the failing process waits at.
    """
    mgr, tmp = self.mgr, self.tmp
    multi = multihost.process_count() > 1
    failed_dir = f"{self.key}/{name}/failed"
    result, error = None, None
    try:
      result = fn()
    except Exception as e:  # pylint: disable=broad-except
      error = e
      if multi:
        mgr._kv.set(f"{failed_dir}/{multihost.process_index()}",
                    f"{name}: {type(e).__name__}: {e}")
    try:
      mgr._barrier(key=f"{self.key}/{name}", timeout_ms=mgr.barrier_timeout_ms)
    except Exception:
      if mgr.is_primary:
        tmp.abandon()
      raise
    failures = mgr._kv.list_dir(failed_dir) if multi else {}
    if error is not None or failures:
      if mgr.is_primary:
        tmp.abandon()
      if error is not None:
        raise error
      raise SaveFailedError(
          f"save of step {tmp.step} to {mgr.directory} failed on other"
          f" processes: {sorted(failures.values())}")
    return result

  def run(self) -> None:
    mgr, tmp, step, key = self.mgr, self.tmp, self.step, self.key
    t0 = time.perf_counter()
    pid, count = multihost.process_index(), multihost.process_count()

    def prepare():
      if mgr.is_primary:
        tmp.prepare()
        if count > 1:  # Others check that they write where it made.
          mgr._kv.set(f"{key}/identity", json.dumps(tmp.identity))

    self._phase("prepared", prepare)
    identity = tmp.identity
    if count > 1 and not mgr.is_primary:
      identity = json.loads(mgr._kv.get(f"{key}/identity",
                                        timeout_ms=mgr.barrier_timeout_ms))
    nbytes = self._phase(
        "written",
        lambda: storage.write_process_files(tmp.path, self.leaves, pid,
                                            identity=identity))

    def finalize():
      if mgr.is_primary:
        check_still_writer(mgr, f"step {step} was not finalized")
        storage.write_manifest(tmp.path, step=step, leaves=self.leaves,
                               process_count=count, extra=self.extra,
                               metrics=self.metrics)
        tmp.finalize()

    self._phase("committed", finalize)
    commit = time.perf_counter() - t0
    stats = SaveStats(step, self.blocking, commit, nbytes,
                      total_bytes=checkpoint_bytes(self.leaves),
                      path=mgr.directory / str(step), finalized_at=time.time())
    mgr.last_save_stats = stats
    log.info("step %d committed to %s: %.3fs blocking, %.3fs commit, %d bytes"
             " written by this process", step, mgr.directory, self.blocking,
             commit, nbytes)
    self.leaves = None  # The snapshot's buffers go back to the manager.
    with mgr._lock:
      mgr._steps = sorted(set(mgr._steps) | {step})
    self._run_hooks(stats)
    with mgr._lock:
      doomed = steps_to_delete(mgr._steps, mgr.max_to_keep,
                               mgr.keep_every_n_steps)
      mgr._steps = [s for s in mgr._steps if s not in doomed]
    if mgr.is_primary and doomed:
      check_still_writer(mgr, f"steps {doomed} were not deleted")
      for s in doomed:
        atomicity_lib.delete_step(mgr.directory, s)
        log.info("retention deleted step %d from %s", s, mgr.directory)

  def _run_hooks(self, stats: SaveStats) -> None:
    """Primary: runs the hooks; all: learn together whether one failed."""
    mgr = self.mgr
    multi = multihost.process_count() > 1
    error = None
    if mgr.is_primary:
      for hook in mgr._commit_hooks:
        try:
          hook(stats)
        except Exception as e:  # pylint: disable=broad-except
          name = getattr(hook, "__qualname__", None) or repr(hook)
          error = CommitHookError(
              f"commit hook {name} failed after step {stats.step} was"
              f" finalized in {mgr.directory} (the step is durable;"
              f" retention was skipped for this save): {type(e).__name__}:"
              f" {e}")
          error.__cause__ = e
          if multi:
            mgr._kv.set(f"{self.key}/hooks/failed", str(error))
          break
    if multi:
      # Every process meets here, so that a failed hook is raised by all
      # of them, not only by the primary (the others would otherwise wait
      # for it at the next save's barriers until they time out).
      mgr._barrier(key=f"{self.key}/hooks", timeout_ms=mgr.barrier_timeout_ms)
      if error is None:
        for message in mgr._kv.list_dir(f"{self.key}/hooks").values():
          error = CommitHookError(message)
    if error is not None:
      raise error
