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
from typing import Any, Sequence

from etils import epath

from flax_ckpt_plugin import atomicity as atomicity_lib
from flax_ckpt_plugin import manifest as manifest_lib
from flax_ckpt_plugin import multihost
from flax_ckpt_plugin import object_store
from flax_ckpt_plugin.async_commit import AsyncCommitter
from flax_ckpt_plugin.commit import CommitHook
from flax_ckpt_plugin.commit import SaveStats
from flax_ckpt_plugin.commit import StepCommit
from flax_ckpt_plugin.errors import CheckpointExistsError
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.multihost import log
from flax_ckpt_plugin.restore import restore_tree
from flax_ckpt_plugin.snapshot import HostStaging
from flax_ckpt_plugin.snapshot import take_snapshot

# Managers opened so far per name, so that two managers in one program, or one
# directory opened twice, never share barrier keys. Every process opens its
# managers in the same order, so the counts agree across processes.
_opened: collections.Counter[str] = collections.Counter()
_opened_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """What a finalized step records besides its arrays."""
  step: int  # The step number.
  created: str  # ISO 8601, UTC.
  created_unix: float  # Seconds since the epoch; NaN if not recorded.
  extra: Any  # The JSON-serializable `extra` given to `save`.
  metrics: dict[str, Any] | None  # The `metrics` given to `save`.
  process_count: int  # Processes that wrote it.
  nbytes: int  # Bytes of array data.


@dataclasses.dataclass(frozen=True)
class RestoreStats:
  """What one restore cost this process."""
  step: int  # The step restored.
  secs: float  # Wall-clock seconds of the whole `restore` call.
  nbytes_read: int  # Bytes this process read from data files.


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
    commit_hooks: callables run with the `SaveStats` of each step once it is
      finalized (to notify, start an evaluation, copy the step elsewhere);
      see `add_commit_hook`.

  Attributes:
    directory: the checkpoint directory (absolute, for local paths).
    name: the prefix of this manager's barrier and key-value keys.
    is_primary: whether this process is the primary host.
    read_only: whether this manager only lists and restores.
    last_save_stats: `SaveStats` of the newest save this manager finalized,
      or None.
    last_restore_stats: `RestoreStats` of the newest restore, or None.

  Every method raises `RuntimeError` after `close`. As a context manager it
  closes on exit; an error raised while closing after an exception in the
  block is attached to that exception as a note.
  """

  def __init__(self, directory: epath.PathLike, *,
               max_to_keep: int | None = None,
               keep_every_n_steps: int | None = None,
               atomicity: atomicity_lib.Atomicity = "auto",
               primary_host: int = 0,
               barrier_timeout_secs: float = 300.0,
               name: str | None = None,
               barrier: multihost.Barrier | None = None,
               read_only: bool = False,
               commit_hooks: Sequence[CommitHook] = ()):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    if keep_every_n_steps is not None and keep_every_n_steps < 1:
      raise ValueError("keep_every_n_steps must be >= 1 or None, got"
                       f" {keep_every_n_steps}")
    if not 0 <= primary_host < multihost.process_count():
      raise ValueError(f"primary_host={primary_host} is not a process index"
                       f" (process count {multihost.process_count()})")
    given = os.fspath(directory)
    # Object stores go through fsspec, never tf.io.gfile (see object_store).
    self.directory = object_store.as_path(
        os.path.abspath(given) if atomicity_lib.is_local(given) else given)
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
    # Host copies of CPU shards, reused by each save (see snapshot.py).
    self._staging = HostStaging()
    self._saves = 0
    self._closed = False
    self._lock = threading.Lock()
    self.last_save_stats: SaveStats | None = None
    self.last_restore_stats: RestoreStats | None = None
    self._fallbacks = 0  # restore_newest_valid calls: names their keys.
    self._commit_hooks: list[CommitHook] = []
    for hook in commit_hooks:
      self.add_commit_hook(hook)

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

  def add_commit_hook(self, hook: CommitHook) -> None:
    """Runs `hook(stats)` after each step this manager finalizes.

    Hooks run on the primary host only, in the background commit thread,
    once the step is durable and before retention deletes older steps, in
    the order added. Register them on every process (only the primary runs
    them). A slow hook delays the next save only if that save comes before
    the hook returns. If a hook raises, the remaining hooks and retention
    are skipped for that step, and every process raises `CommitHookError`
    on its next call into the manager; the step stays finalized.
    """
    if not callable(hook):
      raise TypeError(f"commit hook {hook!r} is not callable")
    self._commit_hooks.append(hook)

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

  def _manifest(self, step: int | None
                ) -> tuple[int, epath.Path, manifest_lib.Manifest]:
    step, step_dir = self._finalized_dir(step)
    return step, step_dir, manifest_lib.read(step_dir, step)

  def metadata(self, step: int | None = None) -> StepMetadata:
    """`extra`, metrics and timestamps of `step` (default: the newest).

    Raises:
      CheckpointNotFoundError: no such finalized step.
      CheckpointCorruptedError: its manifest is missing or damaged.
    """
    self._check_open()
    step, _, m = self._manifest(step)
    nbytes = sum(m.files.values())
    return StepMetadata(
        step=step, created="" if m.created is None else m.created,
        created_unix=math.nan if m.created_unix is None else m.created_unix,
        extra=m.extra, metrics=m.metrics,
        process_count=1 if m.process_count is None else m.process_count,
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
      ValueError: `step` is negative.
      PermissionError: the manager is read-only.
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
                           is_primary=self.is_primary, staging=self._staging)
    blocking = time.perf_counter() - t0
    save_id = self._saves
    self._saves += 1
    commit = StepCommit(self, step, save_id, leaves, extra, metrics,
                        blocking)
    self._committer.start(commit.run,
                          description=f"step {step} in {self.directory}")

  def wait_until_finished(self) -> None:
    """Blocks until the running save is finalized; raises its error."""
    self._committer.wait()

  def check_for_errors(self) -> None:
    """Raises the error of a finished background save, without waiting."""
    self._committer.check()

  @property
  def save_in_progress(self) -> bool:
    """Whether a background commit is running now."""
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
    # A restore allocates a whole state of its own: free the save staging
    # buffers first, so host memory peaks at one extra state, not two. (A
    # running commit keeps its own references; the next save maps new ones.)
    self._staging.clear()
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

    Args:
      target: what to restore into, as for `restore`.
      verify: check checksums, as for `restore`.

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
          self._set_aside([s for s, _ in skipped])
        return step, tree
      why = str(error) if error else "damaged on another process"
      log.warning("skipping step %d of %s: %s", step, self.directory, why)
      skipped.append((step, why))
    if skipped:
      raise CheckpointCorruptedError(
          f"no finalized step in {self.directory} restores: "
          + "; ".join(f"step {s}: {why}" for s, why in skipped))
    return None

  def _set_aside(self, steps: list[int]) -> None:
    """Takes damaged steps out of the list, so that training saves them anew.

    Otherwise the resumed run would never save those step numbers again (a
    finalized step is never overwritten), and a preemption at one of them
    would stop the job on the damaged copy. Local disks keep the files as
    `<step>.damaged` for a person to look at (neither a step nor unfinished,
    so never listed and never removed); on object stores the commit marker
    is removed, which makes the step unfinished, and the next writer cleans
    it up. A read-only manager changes nothing.
    """
    if self.read_only:
      return
    with self._lock:
      self._steps = [s for s in self._steps if s not in steps]
    if not self.is_primary:
      return
    for step in steps:
      step_dir = self.directory / str(step)
      try:
        if atomicity_lib.is_local(self.directory):
          aside = self.directory / f"{step}{atomicity_lib.DAMAGED_SUFFIX}"
          n = 1
          while aside.exists():
            n += 1
            aside = self.directory / f"{step}{atomicity_lib.DAMAGED_SUFFIX}{n}"
          step_dir.rename(aside)
          atomicity_lib.fsync_path(self.directory)
        else:
          aside = "unfinished (its commit marker was removed)"
          (step_dir / atomicity_lib.COMMIT_MARKER).unlink(missing_ok=True)
        log.warning("damaged step %d of %s set aside: %s", step,
                    self.directory, aside)
      except OSError as e:
        log.warning("could not set damaged step %d of %s aside: %r", step,
                    self.directory, e)

  # -- lifetime --------------------------------------------------------------

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(f"CheckpointManager for {self.directory} is closed")

  def close(self) -> None:
    """Waits for the running save and raises its error. Idempotent."""
    if self._closed:
      return
    self._closed = True
    try:
      self._committer.wait()
    finally:
      self._committer.close()
      self._staging.clear()

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
