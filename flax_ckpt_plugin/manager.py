"""CheckpointManager: numbered steps in one directory.

Multi-process contract: every method is called on every process, in the same
order, with the same arguments (the state being each process's view of the
same global arrays). Every process writes only its own shards; only the
primary host creates, finalizes and deletes step directories.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import operator
import os
import threading
import time
from typing import Any, Callable

from etils import epath

from flax_ckpt_plugin import atomicity as atomicity_lib
from flax_ckpt_plugin import multihost
from flax_ckpt_plugin import storage
from flax_ckpt_plugin.async_commit import AsyncCommitter
from flax_ckpt_plugin.errors import CheckpointExistsError
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import ConcurrentWriterError
from flax_ckpt_plugin.errors import SaveFailedError
from flax_ckpt_plugin.multihost import log
from flax_ckpt_plugin.restore import restore_tree
from flax_ckpt_plugin.snapshot import take_snapshot

# Managers opened so far per name, so that two managers in one program, or one
# directory opened twice, never share barrier keys. Every process opens its
# managers in the same order, so the counts agree across processes.
_opened: collections.Counter[str] = collections.Counter()
_opened_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """What a finalized step records besides its arrays."""
  step: int
  created: str  # ISO 8601, UTC.
  created_unix: float
  extra: Any  # The JSON-serializable `extra` given to `save`.
  metrics: dict[str, Any] | None
  process_count: int  # Processes that wrote it.
  nbytes: int  # Bytes of array data.


@dataclasses.dataclass(frozen=True)
class SaveStats:
  """Timings of one save, for logs and metric writers."""
  step: int
  blocking_secs: float  # Time the caller of `save` waited.
  commit_secs: float  # From the end of the snapshot until finalized.
  nbytes: int  # Bytes this process wrote.


@dataclasses.dataclass(frozen=True)
class RestoreStats:
  """What one restore cost this process."""
  step: int
  secs: float
  nbytes_read: int  # Bytes this process read from data files.


def steps_to_delete(steps: list[int], max_to_keep: int | None,
                    keep_every_n_steps: int | None) -> list[int]:
  """The finalized steps that retention removes (never the newest)."""
  if max_to_keep is None:
    return []
  keep = set(sorted(steps)[-max_to_keep:])
  if keep_every_n_steps:
    keep |= {s for s in steps if s % keep_every_n_steps == 0}
  return sorted(s for s in steps if s not in keep)


def _to_json(value: Any, what: str) -> Any:
  try:
    return json.loads(json.dumps(value, allow_nan=False))
  except (TypeError, ValueError) as e:
    raise TypeError(f"{what} must be JSON-serializable (dicts, lists, str,"
                    f" int, finite float, bool, None): {e}") from e


def _metrics_to_json(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
  if metrics is None:
    return None
  out = {}
  for k, v in metrics.items():
    try:
      out[str(k)] = float(v)  # jax and numpy scalars too.
    except (TypeError, ValueError) as e:
      raise TypeError(f"metric {k!r} is not a number: {v!r}") from e
  return out


class CheckpointManager:
  """Saves, lists, restores and prunes the steps of one directory.

  Called on every process. `save` blocks only for a host snapshot; a
  background thread writes and commits. An error in the background is raised
  on the next call to `save`, `restore`, `wait_until_finished` or `close`.

  Args:
    directory: where steps live; a local path, or `gs://`/`s3://`.
    max_to_keep: keep the newest N finalized steps (None keeps all).
    keep_every_n_steps: also keep every step divisible by this, forever.
    atomicity: 'auto' (rename on local paths, commit file on object stores),
      'rename' or 'commit_file'.
    primary_host: the process that creates, finalizes and deletes.
    barrier_timeout_secs: how long a process waits at a barrier for the
      others before raising `TimeoutError`.
    name: prefix of this manager's barrier keys; defaults to a digest of
      `directory` as given (which must then be the same string on every
      process).
    barrier: injectable barrier, `(*, key, timeout_ms) -> None`.
    read_only: only list and restore: never save, and never remove the
      unfinished steps that a writer may be working on (use it in an
      evaluation job that reads a training job's directory).
  """

  def __init__(self, directory: epath.PathLike, *,
               max_to_keep: int | None = None,
               keep_every_n_steps: int | None = None,
               atomicity: atomicity_lib.Atomicity = "auto",
               primary_host: int = 0,
               barrier_timeout_secs: float = 300.0,
               name: str | None = None,
               barrier: multihost.Barrier | None = None,
               read_only: bool = False):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    if keep_every_n_steps is not None and keep_every_n_steps < 1:
      raise ValueError("keep_every_n_steps must be >= 1 or None, got"
                       f" {keep_every_n_steps}")
    if not 0 <= primary_host < multihost.process_count():
      raise ValueError(f"primary_host={primary_host} is not a process index"
                       f" (process count {multihost.process_count()})")
    given = os.fspath(directory)
    if atomicity_lib.is_local(given):
      given_abs = os.path.abspath(given)
      self.directory = epath.Path(given_abs)
    else:
      self.directory = epath.Path(given)
    self.max_to_keep = max_to_keep
    self.keep_every_n_steps = keep_every_n_steps
    self.atomicity = atomicity_lib.resolve_atomicity(given, atomicity)
    self.primary_host = primary_host
    self.read_only = read_only
    self.is_primary = multihost.process_index() == primary_host
    self.barrier_timeout_ms = int(barrier_timeout_secs * 1000)
    self._barrier = barrier or multihost.barrier
    self._kv = multihost.KeyValueStore()
    base = name or hashlib.sha1(given.encode()).hexdigest()[:12]
    with _opened_lock:
      _opened[base] += 1
      self.name = f"flax_ckpt_plugin/{base}/{_opened[base]}"
    self._committer = AsyncCommitter(f"flax_ckpt_plugin-commit-{base}")
    self._saves = 0
    self._closed = False
    self._lock = threading.Lock()
    self.last_save_stats: SaveStats | None = None
    self.last_restore_stats: RestoreStats | None = None
    self._fallbacks = 0  # restore_newest_valid calls: names their keys.

    self._writer_token = None
    if not read_only:
      if self.is_primary:
        self.directory.mkdir(parents=True, exist_ok=True)
        previous = atomicity_lib.current_writer(self.directory)
        self._writer_token = atomicity_lib.claim_directory(
            self.directory, multihost.process_count())
        if previous:
          log.info("took over %s from its previous writer %s",
                   self.directory, previous)
        for entry in atomicity_lib.remove_unfinished(self.directory):
          log.warning("removed unfinished checkpoint %s", entry)
      self._barrier(key=f"{self.name}/open",
                    timeout_ms=self.barrier_timeout_ms)
    self._steps = atomicity_lib.finalized_steps(self.directory)

  # -- queries ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Finalized steps, oldest first (unfinished ones are never listed)."""
    with self._lock:
      return list(self._steps)

  def latest_step(self) -> int | None:
    """The newest finalized step, or None."""
    with self._lock:
      return self._steps[-1] if self._steps else None

  def _finalized_dir(self, step: int | None) -> tuple[int, epath.Path]:
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointNotFoundError(
            f"no finalized checkpoint in {self.directory}")
    step = operator.index(step)
    step_dir = self.directory / str(step)
    if not atomicity_lib.is_finalized(step_dir):
      raise CheckpointNotFoundError(
          f"step {step} is not a finalized checkpoint in {self.directory}"
          f" (finalized steps: {self.all_steps()})")
    return step, step_dir

  def _manifest(self, step: int | None) -> tuple[int, epath.Path, dict]:
    step, step_dir = self._finalized_dir(step)
    manifest = storage.read_manifest(step_dir)
    if manifest.get("step") != step:
      raise CheckpointCorruptedError(
          f"{step_dir / storage.MANIFEST}: records step"
          f" {manifest.get('step')!r}, but lives in the directory of step"
          f" {step}")
    return step, step_dir, manifest

  def metadata(self, step: int | None = None) -> StepMetadata:
    """`extra`, metrics and timestamps of `step` (default: the newest)."""
    self._check_open()
    step, _, m = self._manifest(step)
    nbytes = sum(m["files"].values())
    return StepMetadata(step=step, created=m.get("created", ""),
                        created_unix=m.get("created_unix", math.nan),
                        extra=m.get("extra"), metrics=m.get("metrics"),
                        process_count=m.get("process_count", 1),
                        nbytes=nbytes)

  # -- save ------------------------------------------------------------------

  def save(self, step: int, state: Any, *, extra: Any = None,
           metrics: dict[str, Any] | None = None) -> None:
    """Starts saving `state` as `step`; returns once a host snapshot exists.

    The caller may donate or overwrite the state's buffers as soon as this
    returns. Waits first if the previous save is still committing.

    Args:
      step: the step number, >= 0, not already finalized.
      state: a pytree of jax/numpy arrays and Python scalars (a `TrainState`).
      extra: JSON-serializable user state, e.g. a data iterator position;
        read back with `metadata(step).extra`.
      metrics: numbers recorded with the step.

    Raises:
      CheckpointExistsError: `step` is already finalized.
      TypeError: `extra` or `metrics` cannot be stored, or a leaf has an
        unsupported type.
      Exception: the error of an earlier background commit.
    """
    self._check_open()
    if self.read_only:
      raise PermissionError(
          f"CheckpointManager for {self.directory} is read-only")
    self._committer.check()
    step = operator.index(step)
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    extra = _to_json(extra, "extra")
    metrics = _metrics_to_json(metrics)
    t0 = time.perf_counter()
    self._committer.wait()  # Only blocks if the previous commit still runs.
    if step in self.all_steps():
      raise CheckpointExistsError(
          f"step {step} is already finalized in {self.directory}")
    leaves = take_snapshot(state, process_count=multihost.process_count(),
                           is_primary=self.is_primary)
    blocking = time.perf_counter() - t0
    save_id = self._saves
    self._saves += 1
    self._committer.start(
        lambda: self._commit(step, save_id, leaves, extra, metrics, blocking),
        description=f"step {step} in {self.directory}")

  def _phase(self, key: str, name: str, fn: Callable[[], Any],
             tmp: atomicity_lib.TemporaryPath) -> Any:
    """Runs `fn`, then meets the others at barrier `key/name`.

    A process whose `fn` failed records that in the key-value store before
    the barrier, so after it every process knows and all raise together
    instead of waiting for a timeout; the primary host removes the
    unfinished step. Failures are kept per phase: a process still finishing
    an earlier phase must not see a later phase's failure, or it would skip
    the barrier that the failing process waits at.
    """
    multi = multihost.process_count() > 1
    failed_dir = f"{key}/{name}/failed"
    result, error = None, None
    try:
      result = fn()
    except Exception as e:  # pylint: disable=broad-except
      error = e
      if multi:
        self._kv.set(f"{failed_dir}/{multihost.process_index()}",
                     f"{name}: {type(e).__name__}: {e}")
    try:
      self._barrier(key=f"{key}/{name}", timeout_ms=self.barrier_timeout_ms)
    except Exception:
      if self.is_primary:
        tmp.abandon()
      raise
    failures = self._kv.list_dir(failed_dir) if multi else {}
    if error is not None or failures:
      if self.is_primary:
        tmp.abandon()
      if error is not None:
        raise error
      raise SaveFailedError(
          f"save of step {tmp.step} to {self.directory} failed on other"
          f" processes: {sorted(failures.values())}")
    return result

  def _commit(self, step: int, save_id: int, leaves, extra, metrics,
              blocking: float) -> None:
    """Background part of a save, on every process."""
    t0 = time.perf_counter()
    key = f"{self.name}/save{save_id}/step{step}"
    tmp = atomicity_lib.temporary_path(self.directory, step, self.atomicity)
    pid, count = multihost.process_index(), multihost.process_count()

    def prepare():
      if self.is_primary:
        tmp.prepare()
        if count > 1:  # Others check that they write where it made.
          self._kv.set(f"{key}/identity", json.dumps(tmp.identity))

    self._phase(key, "prepared", prepare, tmp)
    identity = tmp.identity
    if count > 1 and not self.is_primary:
      identity = json.loads(self._kv.get(f"{key}/identity",
                                         timeout_ms=self.barrier_timeout_ms))
    nbytes = self._phase(
        key, "written",
        lambda: storage.write_process_files(tmp.path, leaves, pid,
                                            identity=identity), tmp)

    def finalize():
      if self.is_primary:
        self._check_still_writer(f"step {step} was not finalized")
        storage.write_manifest(tmp.path, step=step, leaves=leaves,
                               process_count=count, extra=extra,
                               metrics=metrics)
        tmp.finalize()

    self._phase(key, "committed", finalize, tmp)
    commit = time.perf_counter() - t0
    self.last_save_stats = SaveStats(step, blocking, commit, nbytes)
    log.info("step %d committed to %s: %.3fs blocking, %.3fs commit, %d bytes"
             " written by this process", step, self.directory, blocking,
             commit, nbytes)
    with self._lock:
      self._steps = sorted(set(self._steps) | {step})
      doomed = steps_to_delete(self._steps, self.max_to_keep,
                               self.keep_every_n_steps)
      self._steps = [s for s in self._steps if s not in doomed]
    if self.is_primary and doomed:
      self._check_still_writer(f"steps {doomed} were not deleted")
      for s in doomed:
        atomicity_lib.delete_step(self.directory, s)
        log.info("retention deleted step %d from %s", s, self.directory)

  def _check_still_writer(self, consequence: str) -> None:
    """Raises ConcurrentWriterError if another job claimed the directory."""
    writer = atomicity_lib.current_writer(self.directory)
    if writer is None or writer.get("token") != self._writer_token:
      raise ConcurrentWriterError(
          f"another job opened {self.directory} for writing after this one"
          f" (its claim: {writer}); {consequence}. Two jobs must not write"
          " one directory: stop this one, or give it another directory.")

  def wait_until_finished(self) -> None:
    """Blocks until the running save is finalized; raises its error."""
    self._committer.wait()

  def check_for_errors(self) -> None:
    """Raises the error of a finished background save, without waiting."""
    self._committer.check()

  @property
  def save_in_progress(self) -> bool:
    return self._committer.is_running

  # -- restore ---------------------------------------------------------------

  def restore(self, target: Any, step: int | None = None, *,
              verify: bool = True) -> Any:
    """Restores `step` (default: the newest finalized) like `target`.

    Args:
      target: a concrete pytree such as a `TrainState`, or an abstract one
        from `jax.eval_shape` whose `ShapeDtypeStruct` leaves may carry
        `sharding=`. Arrays come back with the target's shardings (or on the
        first local device when a `ShapeDtypeStruct` has none); Python scalars
        and numpy leaves keep their type; non-array fields come from target.
      step: which step; None for the newest.
      verify: check the CRC-32C of every block read (a partial read of a
        shard then reads the whole 4 MiB blocks around what it needs).

    Returns:
      A pytree of the target's type.

    Raises:
      CheckpointNotFoundError: no such finalized step.
      StructureMismatchError: the trees differ; names the leaf key path.
      CheckpointCorruptedError: the step's files are damaged.
    """
    self._check_open()
    self._committer.check()
    t0 = time.perf_counter()
    step, step_dir, manifest = self._manifest(step)
    tree, nbytes = restore_tree(step_dir, manifest, target, verify=verify)
    self.last_restore_stats = RestoreStats(step, time.perf_counter() - t0,
                                           nbytes)
    return tree

  def _all_agree(self, key: str, ok: bool) -> bool:
    """True if `ok` holds on every process (a barrier when several run)."""
    if multihost.process_count() == 1:
      return ok
    self._kv.set(f"{key}/{multihost.process_index()}", "1" if ok else "0")
    self._barrier(key=key, timeout_ms=self.barrier_timeout_ms)
    votes = self._kv.list_dir(key)
    return len(votes) == multihost.process_count() and all(
        v == "1" for v in votes.values())

  def restore_newest_valid(self, target: Any, *,
                           verify: bool = True) -> tuple[int, Any] | None:
    """Restores the newest finalized step that restores on every process.

    A step whose files fail verification or are missing on any process is
    skipped with a warning naming it and why, and the next older one is
    tried; all processes agree on each outcome, so they never restore
    different steps.

    Returns:
      (step, restored tree), or None when the directory has no finalized
      step.

    Raises:
      CheckpointCorruptedError: every finalized step failed; names them.
      StructureMismatchError: the target does not match (not skipped: an
        older step would not match either).
    """
    self._check_open()
    self._committer.check()
    self._fallbacks += 1
    skipped = []
    for step in reversed(self.all_steps()):
      error, tree = None, None
      try:
        tree = self.restore(target, step, verify=verify)
      except (CheckpointCorruptedError, FileNotFoundError) as e:
        error = e
      key = f"{self.name}/fallback{self._fallbacks}/step{step}"
      if self._all_agree(key, error is None):
        if skipped:
          log.warning("restored step %d of %s after skipping damaged steps"
                      " %s", step, self.directory, [s for s, _ in skipped])
        return step, tree
      why = str(error) if error else "damaged on another process"
      log.warning("skipping step %d of %s: %s", step, self.directory, why)
      skipped.append((step, why))
    if skipped:
      raise CheckpointCorruptedError(
          f"no finalized step in {self.directory} restores: "
          + "; ".join(f"step {s}: {why}" for s, why in skipped))
    return None

  # -- lifetime --------------------------------------------------------------

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(f"CheckpointManager for {self.directory} is closed")

  def close(self) -> None:
    """Waits for the running save and raises its error. Idempotent."""
    if self._closed:
      return
    self._closed = True
    self._committer.wait()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc is None:
      self.close()
      return
    try:
      self.close()
    except Exception as close_error:  # pylint: disable=broad-except
      exc.add_note(f"while closing the checkpoint manager: {close_error!r}")
