"""CheckpointManager: numbered steps in one directory.

Multi-process contract: every method is called on every process, in the same
order, with the same arguments (the state being each process's view of the
same global arrays). Every process writes only its own shards; only the
primary host creates, finalizes and deletes step directories.

This module holds the save side (snapshot, commit, hooks, retention); the
listing and the restores are those of `directory_reader.DirectoryReader`,
which a manager is. What the tolerance layer alone does to a manager
(regroup, read a step's files, save partner copies) is `tier.TierManager`'s.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import time
from typing import Any, Callable, Sequence

from etils import epath
import jax

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity as atomicity_lib
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.save import commit as commit_lib
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.save import pinned_staging
from flax_ckpt_plugin.manager import deletions as deletions_lib
from flax_ckpt_plugin.manager import options
from flax_ckpt_plugin.manager import retention as retention_lib
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin.save.async_commit import AsyncCommitter
from flax_ckpt_plugin.save.leaves import ShardData
from flax_ckpt_plugin.save.commit import CommitHook
from flax_ckpt_plugin.stats import SaveStats
from flax_ckpt_plugin.errors import CheckpointExistsError
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.restore.directory_reader import DirectoryReader
from flax_ckpt_plugin.save.staging import HostStaging
from flax_ckpt_plugin.save.snapshot import prepare
from flax_ckpt_plugin.save.snapshot import take_snapshot


class CheckpointManager(DirectoryReader):
  """Saves, lists, restores and prunes the steps of one directory.

  Called on every process. `save` blocks only for a host snapshot; a
  background thread writes and commits. An error in the background is raised
  on the next call to `save`, `restore`, `wait_until_finished` or `close`.
  Retention's deletes run on another background thread of the primary
  host, after the commit (see docs/retention.md): the next save does not wait
  for them, unless `Retention(wait_for_deletes=True)`.

  Args:
    directory: where steps live; a local path, or `gs://`/`s3://`.
    max_to_keep: keep the newest N finalized steps (None, the default,
      keeps all); the same as `Retention(max_to_keep=N)`.
    retention: what to keep (`Retention`: the newest N, every N-th step,
      the best by a metric). A step is kept if any rule keeps it, and the
      newest finalized step is never deleted (see `retention`).
    storage: where and how the bytes are written (`Storage`: the storage
      backend, atomicity, pinned host memory).
    processes: how the processes agree on a save (`Processes`: the primary
      host, the barriers' timeout and keys, the coordinator).
    hooks: callables run with the `SaveStats` of each step once it is
      finalized, on the primary host (see `add_commit_hook`).
    read_only: only list and restore: never save, and never remove the
      unfinished steps that a writer may be working on (use it in an
      evaluation job that reads a training job's directory). It lists the
      directory at every query, so it sees steps finalized after it opened,
      and it talks to other processes only in `restore_newest_valid`.
    share_reads: in restores that every process makes together
      (`restore_newest_valid`, the callback's), split the reading of what
      several processes need and share it over JAX collectives, so that
      storage serves each byte once (see docs/multihost.md: it costs host
      memory); False: each process reads all it needs itself.

  Attributes:
    directory: the checkpoint directory (absolute, for local paths).
    name: the prefix of this manager's barrier and key-value keys.
    retention: the retention policy that `max_to_keep` and `retention` make.
    storage: the `Storage` options it was made with.
    processes: the `Processes` options it was made with.
    coordinator: the `Coordinator` it meets other processes through.
    is_primary: whether this process is the primary host.
    read_only: whether this manager only lists and restores.
    last_save_stats: `SaveStats` of the newest save this manager finalized,
      or None.
    last_restore_stats: `RestoreStats` of the newest restore, or None.
    check_still_writer: raises `ConcurrentWriterError` (ending with the
      given consequence) if another job claimed the directory since this
      manager opened it (writers only).

  Saving, restoring and `metadata` raise `RuntimeError` after `close`;
  `all_steps` and `latest_step` still list. As a context manager it
  closes on exit; an error raised while closing after an exception in the
  block is attached to that exception as a note.
  """

  def __init__(self, directory: epath.PathLike, *,
               max_to_keep: int | None = None,
               retention: retention_lib.Retention | None = None,
               storage: options.Storage | None = None,
               processes: options.Processes | None = None,
               hooks: Sequence[CommitHook] = (),
               read_only: bool = False,
               share_reads: bool = True):
    self.retention = retention_lib.Policy.of(max_to_keep, retention)
    self.storage = storage = storage or options.Storage()
    self.processes = processes = processes or options.Processes()
    coordinator = processes.coordinator or coordinator_lib.default()
    if processes.primary_host >= coordinator.process_count:
      raise ValueError(
          f"primary_host={processes.primary_host} is not a process index"
          f" (process count {coordinator.process_count})")
    given = os.fspath(directory)
    # The storage backend is chosen once, by the path's scheme; object
    # stores go through fsspec, never tf.io.gfile (see object_store).
    directory, backend = interface.make_path(given, storage.backend)
    self.atomicity = atomicity_lib.resolve_atomicity(given, storage.atomicity,
                                                     backend)
    base = processes.name or hashlib.sha1(given.encode()).hexdigest()[:12]
    super().__init__(
        directory, backend, coordinator=coordinator,
        primary_host=processes.primary_host, read_only=read_only,
        share_reads=share_reads,
        barrier_timeout_ms=int(processes.barrier_timeout_secs * 1000),
        base=f"flax_ckpt_plugin/{base}",
        io_timeout_secs=storage.io_timeout_secs)
    self._make_save_side(base)
    self.last_save_stats: SaveStats | None = None
    self._commit_hooks: list[CommitHook] = []
    for hook in hooks:
      self.add_commit_hook(hook)
    self.name = self._base
    if not read_only:
      self._open_for_writing()
    self._opened_name = self.name  # `regroup` names its groups under it.

  def _make_save_side(self, base: str) -> None:
    """The threads and memory that saves use, none started yet."""
    # Retention's deletes, in the background (the primary's alone). Made
    # before the committer: at exit, its commit is waited for first, then
    # the deletes that commit queued (see `exits`: last made, first run).
    self._deletions = deletions_lib.Deletions(
        self.directory, self.backend, f"flax_ckpt_plugin-delete-{base}",
        self.storage.io_timeout_secs)
    self._committer = AsyncCommitter(f"flax_ckpt_plugin-commit-{base}")
    # Host copies of CPU shards, reused by each save (see staging.py). A
    # directory of this process alone may hold its snapshots (tmpfs).
    self._staging = HostStaging(
        arena=None if self.scope is None
        else self.backend.staging_arena(self.directory))
    # Accelerator shards' pinned host memory (see `arrays.pinned`).
    self._pinned = pinned_staging.PinnedStaging(
        self.storage.pinned_host_bytes)
    self._saves = 0
    self._writers: list[int] | None = None  # None: every process.
    # The primary's records (metrics, time) of each step, for `keep_best`
    # and the time rules (steps of earlier runs are read from their
    # manifests when first needed).
    self._records: dict[int, retention_lib.StepRecord] = {}

  def _open_for_writing(self) -> None:
    """Claims the directory for this job (every process): its token names
    every later key, and the steps found are the writer's list."""
    token, steps = commit_lib.open_for_writing(
        self.coordinator, self.directory, self.backend, self._base,
        is_primary=self.is_primary, timeout_ms=self.barrier_timeout_ms)
    self.name = keys.child(self._base, token)
    self.check_still_writer = functools.partial(
        directory_lib.check_still_writer, self.directory, token,
        writer_count=self.coordinator.process_count, backend=self.backend)
    self._listed(steps)
    # Not at the first save: that comes right after a train step, whose
    # runtime threads hold the cores a few ms more (a start waits 3-7 ms).
    # The same for the thread that compiles the staging copies' programs.
    self._committer.prepare()
    self._staging.prepare()

  def add_commit_hook(self, hook: CommitHook) -> None:
    """Runs `hook(stats)` after each step this manager finalizes.

    Hooks run on the primary host only (register them on every process),
    in the commit thread, once the step is durable and before retention, in
    the order added. If a hook raises, the remaining hooks and retention are
    skipped for that step, and every process raises `CommitHookError` on
    its next call into the manager; the step stays finalized.
    """
    if not callable(hook):
      raise TypeError(f"commit hook {hook!r} is not callable")
    self._commit_hooks.append(hook)

  # -- save ------------------------------------------------------------------

  def save(self, step: int, state: Any, *, extra: Any = None,
           metrics: dict[str, Any] | None = None,
           data_state: Any = None) -> None:
    """Starts saving `state` as `step`; returns once a host snapshot exists.

    The caller may donate or overwrite the state's buffers as soon as this
    returns. Waits first if the previous save is still committing.

    Args:
      step: the step number, >= 0, not already finalized.
      state: a pytree of jax/numpy arrays and Python scalars (a `TrainState`).
      extra: JSON-serializable user state, e.g. a data iterator position;
        read back with `metadata(step).extra`.
      metrics: numbers recorded with the step.
      data_state: this process's own data state (each process passes its
        own, e.g. its data iterator's `get_state()`): bytes, or a JSON
        value; read back on each process with `data_state(step)`.

    Raises:
      CheckpointExistsError: `step` is already finalized.
      ValueError: `step` is negative.
      PermissionError: the manager is read-only.
      TypeError: `extra` or `metrics` cannot be stored, or a leaf has an
        unsupported type.
      Exception: the error of an earlier background commit.
    """
    self._save(step, state, extra=extra, metrics=metrics,
               data_state=data_state, partner_shards=None)

  def _save(self, step: int, state: Any, *, extra: Any,
            metrics: dict[str, Any] | None, data_state: Any,
            partner_shards: Callable[[], dict[str, list[ShardData]]] | None
            ) -> None:
    """`save`; `partner_shards`: see `TierManager.save`."""
    self._check_open()
    if self.read_only:
      raise PermissionError(
          f"CheckpointManager for {self.directory} is read-only")
    self._committer.check()
    step = operator.index(step)
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    extra = writer.extra_to_json(extra)
    metrics = writer.metrics_to_json(metrics)
    encoded = None if data_state is None else datastate.encode(data_state)
    t0 = time.perf_counter()
    self._committer.wait()  # Only blocks if the previous commit still runs.
    if step in self._deletions.pending:  # Its files would go with the old.
      self._deletions.wait()
    if step in self.all_steps():
      raise CheckpointExistsError(
          f"step {step} is already finalized in {self.directory}")
    coord = self.coordinator
    inputs = commit_lib.CommitInputs(
        coordinator=coord, directory=self.directory, backend=self.backend,
        step=step,
        key=keys.child(self.name, f"save{self._saves}", f"step{step}"),
        tmp=atomicity_lib.temporary_path(self.directory, step,
                                         self.atomicity, self.backend),
        leaves=[], extra=extra, metrics=metrics,
        blocking_secs=0.0, is_primary=self.is_primary,
        timeout_ms=self.barrier_timeout_ms,
        check_still_writer=self.check_still_writer, scope=self.scope,
        data_state=encoded, writers=self._writers,
        retention=self.retention.to_json() if self.retention.deletes else None,
        before_write=(self._deletions.wait if self.retention.wait_for_deletes
                      else None),
        in_flight=deadlines.InFlight(self.storage.io_timeout_secs,
                                     f"step {step} in {self.directory}"))
    self._committer.prepare()
    # The snapshot reuses the memory that the newest step is held in.
    self._held.drop(self.storage.io_timeout_secs)
    # The snapshot last: what follows it should cost the call nothing.
    leaves = take_snapshot(state, process_count=coord.process_count,
                           is_primary=self.is_primary, staging=self._staging,
                           own_copy=self.scope is not None,
                           pinned_staging=self._pinned,
                           partner_shards=partner_shards)
    inputs = inputs._replace(
        leaves=leaves, blocking_secs=time.perf_counter() - t0,
        pinned_fallback_bytes=leaves.pinned_fallback_bytes,
        unpinned_bytes=leaves.unpinned_bytes)
    self._saves += 1
    del leaves
    # Retention's deletes wait while this save commits (see `deletions`).
    self._deletions.hold_off()
    # The commit takes the inputs out of the box, so that the snapshot is
    # freed when the commit returns, before hooks and retention run.
    try:
      self._committer.start(functools.partial(self._commit, [inputs]),
                            description=f"step {step} in {self.directory}",
                            in_flight=inputs.in_flight)
    except BaseException:
      self._deletions.go_on()
      raise

  def warm_up(self, state: Any, *, wait: bool = False) -> bool:
    """Sets up what saving `state` needs that the first save would
    otherwise do without: on accelerators, the pinned host memory its
    shards are copied into (see docs/loop.md: pinned by a thread,
    about 0.5 s per GB, once per process, while the loop runs); on the
    CPU, the compiles of its copy programs, queued.
    Optional: without it, the first save asks for that memory itself,
    copying its shards on their devices meanwhile, or has the runtime copy
    CPU shards while the programs compile. The callback calls it from
    `restore_or_initialize`.

    Args:
      state: the state that will be saved (its arrays are not read).
      wait: block until the pinned memory is pinned.

    Returns:
      Whether `state` holds arrays to take the measure of (False for an
      abstract state: call it again with a concrete one).
    """
    if self.read_only:
      return True
    try:
      sizes = prepare(
          state, process_count=self.coordinator.process_count,
          is_primary=self.is_primary, staging=self._staging,
          own_copy=self.scope is not None, pinned_staging=self._pinned)
    except (TypeError, ValueError) as e:  # The save will say it better.
      log.info("no warm-up for saving %s: %s", self.directory, e)
      return True
    self._pinned.reserve(sizes, wait=wait)
    return not any(isinstance(leaf, jax.ShapeDtypeStruct)
                   for leaf in jax.tree.leaves(state))

  def _commit(self, box: list[commit_lib.CommitInputs]) -> None:
    """The commit thread's job: commit, record, hooks, retention."""
    inputs = box.pop()
    key, step, metrics = inputs.key, inputs.step, inputs.metrics
    io = inputs.in_flight
    try:
      stats, written = commit_lib.commit(inputs)
    except BaseException as e:
      if io is None or not io.given_up:  # (Else nobody hears of it.)
        e.add_note(commit_lib.step_state(self.directory, step))
      raise
    finally:
      if io is None or not io.given_up:  # Else the next save's hold-off.
        self._deletions.go_on()
    if io is not None and io.given_up:
      # The committer gave up on this commit while a call of it was stuck:
      # a newer commit may run now, and this one's thread must touch
      # nothing (held step, records, hooks, retention). A step it still
      # finalized is listed at the next open.
      log.warning("step %d of %s: a commit given up on returned; its step"
                  " is not recorded by this manager", step, self.directory)
      return
    if written.file is not None and self._staging.arena is None:
      # (An arena's snapshot is the file's own pages in memory already.)
      self._held.hold(step, self.directory / str(step), written.file,
                      written.size, written.spans)
    del inputs, written  # The snapshot's buffers go back to staging.
    self._staging.release_spent()
    self.last_save_stats = stats
    # Its time: the retention clock's, as the step became final (a step of
    # an earlier run has its manifest's, written just before).
    self._records[step] = retention_lib.StepRecord(metrics,
                                                   retention_lib.now())
    self._finalized(step)  # The reader's checks accepted it.
    try:
      commit_lib.run_hooks(
          meetings.Meeting(self.coordinator, key, self.barrier_timeout_ms),
          self._commit_hooks,
          stats,
          is_primary=self.is_primary)
      self._retention(key, stats)
    except BaseException as e:
      e.add_note(f"Step {step} is finalized in {self.directory}.")
      raise

  def _retention(self, key: str, stats: SaveStats) -> None:
    """Decides which steps go, the same on every process, and has the
    primary queue their deletes (`deletions`); raises, on every process,
    the error of an earlier delete."""
    steps, protect = self._steps_and_protected()
    if self.retention.needs_records:
      doomed = retention_lib.decided_by_primary(
          self.retention, meetings.Meeting(
              self.coordinator, keys.child(key, "retention_plan"),
              self.barrier_timeout_ms), steps,
          protect=protect, records=self._records,
          read_record=functools.partial(
              retention_lib.recorded, self.directory, self.backend),
          is_primary=self.is_primary)
    else:  # The same on every process: it depends on the steps alone.
      doomed = self.retention.to_delete(steps, protect=protect)
    self._unlist(doomed)
    if doomed:  # Every process has the same list: all meet, or none.
      commit_lib.run_retention(
          meetings.Meeting(self.coordinator, key, self.barrier_timeout_ms),
          stats, delete=functools.partial(self._queue_deletes, doomed,
                                          stats.step))

  def _queue_deletes(self, doomed: list[int], after: int) -> None:
    """The primary queues `doomed` and raises an earlier delete's error."""
    if self.is_primary:
      # An earlier delete's error, taken before these steps are queued: an
      # error of theirs waits for a later retention.
      error = self._deletions.take_error()
      self._deletions.submit(doomed, after, self.check_still_writer)
      if error is not None:
        raise error

  def wait_until_finished(self, timeout: float | None = None, *,
                          deletes: bool = True) -> bool:
    """Blocks until the running save is finalized and retention's
    deletes are done; raises the save's error. A delete's error is raised
    by the next save whose retention deletes, on every process (see
    docs/retention.md), or by `close`.

    Args:
      timeout: at most this many seconds; None: as long as it takes.
      deletes: wait for retention's deletes too; False: for the save
        alone (a preemption stop: they are left to `close`).

    Returns:
      False, raising nothing, if either still runs after `timeout` secs.
    """
    start = time.monotonic()
    if not self._committer.join(timeout):
      return False
    left = None if timeout is None else max(
        0.0, timeout - (time.monotonic() - start))
    if deletes and not self._deletions.wait(left):
      return False
    self._committer.check()
    return True

  def _before_restore(self) -> None:
    self._committer.check()

  def _free_save_memory(self) -> None:
    self._staging.clear()

  def check_for_errors(self) -> None:
    """Raises the error of a finished background save, without waiting."""
    self._committer.check()

  @property
  def save_in_progress(self) -> bool:
    """Whether a background commit is running now."""
    return self._committer.is_running

  # -- lifetime --------------------------------------------------------------

  def close(self, *, leaving: bool = False) -> None:
    """Waits for the running save and for retention's deletes, and raises
    their errors (a delete's on the primary host). Idempotent.

    On a local disk, a writer's close then has its newest step read back
    into the page cache, so that a job restarting on this machine restores
    from memory, and waits for that (the disk's time to read the step, at
    most 10 s; see `LocalBackend`).

    Args:
      leaving: the process is about to exit and its machine may be going
        away (a preemption stop): read nothing back, and stop a read-back
        that runs; delete no more than the step being deleted (the steps
        still queued stay on disk, whole, for a later retention). Leaving
        the `with` block by an exception does the same.
    """
    if self._closed:
      return
    self._committer.refuse_on_commit_thread()  # Still open, then.
    self._closed = True
    try:
      self._committer.wait()
    finally:
      self._committer.close()
      self._pinned.close()
      self._held.release()
      if leaving:
        self._deletions.stop()
      self._deletions.wait()
      self._staging.clear()
      self.backend.close_directory(self.directory, wrote=not self.read_only,
                                   leaving=leaving)
    self._deletions.check()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc is None:
      self.close()
      return
    try:
      self.close(leaving=True)
    except Exception as close_error:  # pylint: disable=broad-except
      exc.add_note(f"while closing the checkpoint manager: {close_error!r}")
