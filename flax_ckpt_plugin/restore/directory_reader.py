"""The reading side of a directory's steps: `DirectoryReader`, which a
`CheckpointManager` holds.

It keeps the list of finalized steps (a writer's: the manager adds each
step it finalizes and takes out those retention deletes; a read-only
reader lists the directory anew at each query) and the newest step known
to restore, which retention keeps. `restore` reads a step on one process
alone; `restore_together` is the same, called on every process, with the
reading of what several processes need split among them
(`shared_read`); `restore_newest_valid` is the agreement of all processes
on the newest step that restores on every one of them (`fallback`), which
sets damaged steps aside.
"""

from __future__ import annotations

import operator
import threading
import time
from typing import Any, Callable, TypeVar

from etils import epath
import numpy as np

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.backends import held as held_lib
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.restore import fallback
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.restore import data_files
from flax_ckpt_plugin.restore import read_plan
from flax_ckpt_plugin.restore import renaming
from flax_ckpt_plugin.restore.options import RestoreOptions
from flax_ckpt_plugin.restore import shared_read
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.restore.tree import plain_target
from flax_ckpt_plugin.restore.tree import restore_tree
from flax_ckpt_plugin.stats import RestoreStats
from flax_ckpt_plugin.stats import step_metadata
from flax_ckpt_plugin.stats import StepMetadata

T = TypeVar("T")


def _not_a_step(target: Any, step: int | None) -> None:
  """Raises where `target` is a step number: Orbax's habit
  `restore(manager.latest_step())` puts the step first."""
  if (isinstance(target, (int, np.integer))
      and not isinstance(target, (bool, np.bool_))):
    call = (f"restore(target, step={int(target)})" if step is None
            else "restore(target, step=...)")
    raise TypeError(
        f"restore(): the first argument is the target to restore like (a"
        f" TrainState, or an abstract one from jax.eval_shape), not a step:"
        f" got {int(target)}. Did you mean {call}? (Orbax's"
        " restore(step, args=...) takes the step first; here it is"
        " restore(target, step=...), and restore(None, step=...) gives the"
        " step as saved, in nested dicts.)")


class DirectoryReader:
  """Lists and restores the steps of one directory: the restore API.

  `CheckpointManager` is a `DirectoryReader` that also saves. The save
  side's part in a restore is the reader's small interface for a writer:
  it overrides `_before_restore` (raises a background save's error) and
  `_free_save_memory` (frees the saves' host memory: a restore allocates
  a whole state of its own), keeps the list of its steps (`_listed`,
  `_finalized`, `_unlist`), holds its newest step's snapshot in `_held`
  (a restore of that step reads its bytes there) and sets
  `check_still_writer` when it opens the directory. Who meets whom
  (`coordinator`, `primary_host`, `is_primary`) is this object's, and a
  regroup changes it here for saves and restores alike.

  Args:
    directory: the checkpoint directory.
    backend: its storage backend.
    coordinator: the processes that restores meet.
    primary_host: the index of the primary host among them.
    read_only: list the directory anew at each query (a reader of a
      directory another job writes), and change nothing in it.
    share_reads: see `CheckpointManager`.
    barrier_timeout_ms: how long restores wait for the other processes.
    base: the prefix of the keys that restores meet at.
    io_timeout_secs: the deadline of each look at and read of storage.
  """

  # A local tier's steps: every distinct shard of the process it names
  # (`files.Scope`), set by a `TierManager`; None: the job's steps.
  scope: Any = None

  def __init__(self, directory: epath.Path, backend: interface.Backend, *,
               coordinator: coordinator_lib.Coordinator, primary_host: int,
               read_only: bool, share_reads: bool, barrier_timeout_ms: int,
               base: str,
               io_timeout_secs: float = deadlines.IO_TIMEOUT_SECS):
    self.directory, self.backend = directory, backend
    self.coordinator, self.primary_host = coordinator, primary_host
    self.is_primary = coordinator.process_index == primary_host
    self.read_only, self.share_reads = read_only, share_reads
    self.barrier_timeout_ms = barrier_timeout_ms
    self._base = base
    self.io_timeout_secs = io_timeout_secs
    # The newest step whose snapshot this process still holds (a
    # writer's; `backends.held`): a restore of it reads its bytes there.
    self._held = held_lib.HeldStep()
    self._closed = False
    self._lock = threading.Lock()
    self._steps: list[int] = []  # A writer's finalized steps.
    # The newest step known to restore (-1: none); retention keeps it.
    self._known_good = -1
    self.last_restore_stats: RestoreStats | None = None
    # Whether `restore` said once that `restore_together` reads less.
    self._hinted_together = False
    # Raises `ConcurrentWriterError` once another job claimed the
    # directory (a writer's, set when it opens the directory).
    self.check_still_writer: Callable[..., None] | None = None

  # -- what a writer adds ------------------------------------------------------

  def _before_restore(self) -> None:
    """Raises what must stop a restore before it starts (a writer: the
    error of its background save)."""

  def _free_save_memory(self) -> None:
    """Frees the host memory that saves keep for the next one (a
    writer's staging)."""

  @property
  def closed(self) -> bool:
    """Whether `close` was called (and did not refuse: see `close`)."""
    return self._closed

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(f"CheckpointManager for {self.directory} is closed")

  # -- queries ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Finalized steps, oldest first (unfinished ones are never listed).

    A writer knows its own steps; a read-only manager lists the directory
    anew at each call, so it sees what a training job finalized since.
    """
    if self.read_only:
      return self._bounded(
          lambda: directory_lib.finalized_steps(self.directory),
          f"listing {self.directory}")
    with self._lock:
      return list(self._steps)

  def latest_step(self) -> int | None:
    """The newest finalized step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  # -- the writer's list ------------------------------------------------------

  def _finalized(self, step: int) -> None:
    """A writer finalized `step`: listed, and known to restore (the commit
    ran the reader's checks on it)."""
    with self._lock:
      self._steps = sorted(set(self._steps) | {step})
      self._known_good = max(step, self._known_good)  # Either order agrees.

  def _listed(self, steps: list[int]) -> None:
    """The directory's finalized steps as a writer found them (at its
    open, or listed anew after a regroup)."""
    with self._lock:
      self._steps = sorted(steps)

  def _steps_and_protected(self) -> tuple[list[int], int]:
    """The writer's steps, and the newest known to restore (-1: none),
    which retention never deletes."""
    with self._lock:
      return list(self._steps), self._known_good

  def _unlist(self, steps: list[int]) -> None:
    """Takes `steps` out of the list (retention deleted them)."""
    with self._lock:
      self._steps = [s for s in self._steps if s not in steps]

  def _finalized_dir(self, step: int | None) -> tuple[int, epath.Path]:
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointNotFoundError(
            f"no finalized checkpoint in {self.directory}")
    step = operator.index(step)
    step_dir = self.directory / str(step)
    if not self._bounded(lambda: directory_lib.is_finalized(step_dir),
                         f"looking up step {step} in {self.directory}"):
      raise CheckpointNotFoundError(
          f"step {step} is not a finalized checkpoint in {self.directory}"
          f" (finalized steps: {self.all_steps()})")
    return step, step_dir

  def _manifest(self, step: int | None
                ) -> tuple[int, epath.Path, manifest_lib.Manifest]:
    step, step_dir = self._finalized_dir(step)
    return step, step_dir, self._bounded(
        lambda: manifest_lib.read(step_dir, step),
        f"reading the manifest of step {step} in {self.directory}")

  def _bounded(self, fn: Callable[[], T], what: str) -> T:
    """`fn()` (a look at the directory), with the storage's deadline."""
    return deadlines.InFlight(self.io_timeout_secs).call(fn, what)

  def metadata(self, step: int | None = None) -> StepMetadata:
    """`extra`, metrics and timestamps of `step` (default: the newest).

    Raises:
      CheckpointNotFoundError: no such finalized step.
      CheckpointCorruptedError: its manifest is missing or damaged.
    """
    self._check_open()
    return step_metadata(self._manifest(step)[2])

  def data_state(self, step: int | None = None) -> Any:
    """This process's data state saved with `step` (default: the newest):
    bytes or the JSON value it was saved as; None if it has none.

    Raises:
      CheckpointNotFoundError: no such finalized step.
      DataStateMismatchError: the step was saved by another number of
        processes (the message names both counts).
      CheckpointCorruptedError: the state's file is missing or damaged.
    """
    self._check_open()
    _, step_dir, manifest = self._manifest(step)
    return datastate.of_step(step_dir, manifest, self.coordinator,
                             self.backend)

  # -- restore ---------------------------------------------------------------

  def restore(self, target: Any, step: int | None = None, *,
              verify: bool = True,
              data_iterator: datastate.DataIterator | None = None,
              partial: bool = False, missing: str = "error",
              cast: bool = False, rename: renaming.Rename | None = None
              ) -> Any:
    """Restores `step` (default: the newest finalized) like `target`.

    Runs on this process alone (it meets no other process), so it may be
    called on one process only, e.g. in a commit hook. Called on every
    process with a target that several processes hold (replicated across
    them), each reads all of it: `restore_together` (or
    `restore_newest_valid`) reads each byte once, and the first such call
    logs that.

    Args:
      target: a concrete pytree such as a `TrainState`, or an abstract one
        from `jax.eval_shape` whose `ShapeDtypeStruct` leaves may carry
        `sharding=`. Arrays come back with the target's shardings (or on the
        first local device when a `ShapeDtypeStruct` has none); Python scalars
        and numpy leaves keep their type; non-array fields come from target.
        None: the step as saved, in plain nested dicts of numpy arrays (for
        looking at it or converting it; see docs/restoring.md).
      step: which step; None for the newest.
      verify: check the CRC-32C of every block read (a partial read of a
        shard then reads the whole 4 MiB blocks around what it needs).
      data_iterator: if given, gets this process's data state of the step
        (`set_state`), once the tree restored (see docs/integrations.md).
      partial: restore only the leaves of `target` (e.g. `{"params":
        params}` from a saved `TrainState`: key paths match whether a
        level is a dict key or an attribute); no byte of the other leaves
        is read.
      missing: "keep": a leaf of `target` that the checkpoint lacks (a
        new head for fine-tuning) keeps the target's value, and a log line
        names them; "error" (default): a `StructureMismatchError`.
      cast: where a leaf's target dtype differs from the saved one, convert
        the values while they are read, piece by piece (never a second
        full copy of the leaf): floating to floating of any width, integer
        to integer (a narrower target is checked value by value). A log
        line says how many leaves were cast. See docs/restoring.md.
      rename: the target paths of the checkpoint's leaves, applied before
        they are matched against `target` (a module renamed, a layer
        moved): rules, a mapping of regular expressions to replacements
        (the first whose pattern matches a whole checkpoint path, e.g.
        `{r"params/Dense_(\\d+)/(.*)": r"params/dense_\\1/\\2"}`; a
        replacement of None drops that leaf; a path no rule matches keeps
        its name), or a function of a checkpoint path returning its target
        path (None drops it). Mismatch messages name both paths. With
        target None, the step comes back under the new paths. See
        docs/restoring.md.

    Returns:
      A pytree of the target's type.

    Raises:
      CheckpointNotFoundError: no such finalized step.
      TypeError: `target` is a step number (Orbax's argument order); the
        message shows the call meant.
      StructureMismatchError: the trees differ; names every mismatched leaf
        by its key path (and, for dtypes that `cast=True` converts, says
        so). With `cast`: a conversion it does not make (floating to
        integer, complex to real, booleans, PRNG keys), or a saved integer
        that the target's dtype cannot hold; names the leaf and both
        dtypes.
      CheckpointCorruptedError: the step's files are damaged.
      DataStateMismatchError: see `data_state`.
      ValueError: a rename rule that is not a regular expression, or two
        checkpoint leaves renamed to one path (names them).
    """
    self._check_open()
    _not_a_step(target, step)
    return self._restore(
        target, step, RestoreOptions(verify=verify, partial=partial,
                                     missing=missing, cast=cast,
                                     rename=rename), data_iterator)

  def _restore(self, target: Any, step: int | None, options: RestoreOptions,
               data_iterator: datastate.DataIterator | None) -> Any:
    """`restore`, its options checked."""
    self._check_open()
    self._before_restore()
    self._hint_together(target)
    t0 = time.perf_counter()
    step, step_dir, manifest = self._manifest(step)
    hand_over = None if data_iterator is None else datastate.prepare(
        data_iterator, step_dir, manifest, self.coordinator, self.backend)
    if target is None:
      target = plain_target(manifest.leaves, options.rename)
    (tree, nbytes), from_memory = self._read_step(
        step, step_dir, lambda storage: restore_tree(
            step_dir, manifest, target, options, backend=storage,
            io_timeout_secs=self.io_timeout_secs))
    self.last_restore_stats = RestoreStats(
        step, time.perf_counter() - t0, nbytes, from_memory)
    if hand_over is not None:
      hand_over()
    return tree

  def restore_together(self, target: Any, step: int | None = None, *,
                       verify: bool = True,
                       data_iterator: datastate.DataIterator | None = None,
                       cast: bool = False,
                       rename: renaming.Rename | None = None) -> Any:
    """`restore`, called on every process: storage serves each byte once.

    Where the target has regions that several processes need (replicated
    arrays), they split the reading and JAX collectives give every device
    its whole region (see docs/multihost.md); otherwise the same as `restore`.
    `step` None: the newest finalized step, as the primary host sees it
    (every process restores that one).

    Raises:
      As `restore`, and an error when another process found
      the step damaged (see `restore_newest_valid`).
    """
    self._check_open()
    _not_a_step(target, step)
    return self._restore_together(
        target, step, RestoreOptions(verify=verify, cast=cast, rename=rename),
        data_iterator)

  def _restore_together(self, target: Any, step: int | None,
                        options: RestoreOptions,
                        data_iterator: datastate.DataIterator | None) -> Any:
    """`restore_together`, its options checked (neither `partial` nor
    `missing`: the processes plan every leaf alike)."""
    if not self._shares_reads(target):
      return self._restore(target, step, options, data_iterator)
    self._check_open()
    self._before_restore()
    t0 = time.perf_counter()
    key = keys.fresh(self.coordinator, keys.child(self._base, "shared"))
    step = operator.index(step) if step is not None else self._agreed_newest(
        keys.child(key, "newest"))
    step_dir = self.directory / str(step)

    def read_manifest():  # On the primary only.
      return manifest_lib.read_raw(self._finalized_dir(step)[1],
                                   self.backend)

    def before(manifest):
      return None if data_iterator is None else datastate.prepare(
          data_iterator, step_dir, manifest, self.coordinator, self.backend)

    # From the files, even where this process holds the step in memory:
    # a read of held bytes that failed its checks would be read again
    # here alone, while the others go on to the collectives.
    self._held.release()
    self._free_save_memory()
    tree, nbytes, hand_over = shared_read.restore(
        meetings.Meeting(self.coordinator, key, self.barrier_timeout_ms),
        step_dir, read_manifest, target, options, step=step,
        reads_manifest=self.is_primary, backend=self.backend, before=before,
        io_timeout_secs=self.io_timeout_secs)
    self.last_restore_stats = RestoreStats(step, time.perf_counter() - t0,
                                           nbytes)
    if hand_over is not None:
      hand_over()
    return tree

  def _read_step(self, step: int, step_dir: epath.Path,
                 read: Callable[[data_files.Storage], T]) -> tuple[T, int]:
    """`read(storage)` for a restore of `step` on this process alone, and
    the bytes it took from memory: where this process still holds the
    step's snapshot (`backends.held`), its data file comes from there,
    checked as a file's (a check that fails reads the files instead).

    A restore allocates a whole state of its own: the save's staging
    memory is freed first, so host memory peaks at one extra state, not
    two; a held snapshot is freed once read (at once, where another step
    is read). (A running commit keeps its own references; the next save
    maps new memory.)
    """
    if self._held.step != step:
      self._held.release()
    self._free_save_memory()
    try:
      result, from_memory = self._held.read(
          step, step_dir, self.backend, read, CheckpointCorruptedError,
          f"restore of {self.directory}")
    finally:
      self._held.release()
    if from_memory:
      log.info("restore of step %d of %s: %d bytes from the snapshot held in"
               " memory", step, self.directory, from_memory)
    return result, from_memory

  def _shares_reads(self, target: Any) -> bool:
    """Whether the processes share the reading of `target`: it has
    regions that several of them need (`read_plan.worth_it`)."""
    return (self.share_reads and target is not None
            and self.coordinator.process_count > 1
            and read_plan.worth_it(target))

  def _agreed_newest(self, key: str) -> int:
    """The newest finalized step as the primary host sees it, on every
    process (a process that lists the directory a moment later could see
    one more).

    Raises:
      CheckpointNotFoundError: the primary sees no finalized step.
    """
    newest = meetings.decided_by_one(
        meetings.Meeting(self.coordinator, key, self.barrier_timeout_ms),
        self.latest_step, decides=self.is_primary,
        what=f"the newest step of {self.directory}")
    if newest is None:
      raise CheckpointNotFoundError(
          f"no finalized checkpoint in {self.directory}")
    return newest

  def _hint_together(self, target: Any) -> None:
    """Logs once, where `restore` runs on several processes with a target
    that several of them hold, that each reads all of it."""
    if (self._hinted_together or self.scope is not None
        or not self._shares_reads(target)):
      return
    self._hinted_together = True
    log.warning(
        "restore() of %s: the target has arrays that several of the %d"
        " processes hold, and restore() on each process reads all of them"
        " from storage; restore_together(target) (or restore_newest_valid,"
        " or a callback's restore_or_initialize), called on every process,"
        " reads each byte once and shares it", self.directory,
        self.coordinator.process_count)

  def restore_newest_valid(self, target: Any, *, verify: bool = True,
                           data_iterator: datastate.DataIterator | None = None,
                           cast: bool = False,
                           rename: renaming.Rename | None = None
                           ) -> tuple[int, Any] | None:
    """Restores the newest finalized step that restores on every process.

    Called on every process; see docs/reliability.md. A step whose files fail
    verification or are missing on any process is skipped with a warning
    naming it and why, and the next older one is tried. All processes
    learn together how each try went, so they never restore different
    steps and never wait for a timeout to hear of an error.

    Args:
      target: what to restore into, as for `restore`.
      verify: check checksums, as for `restore`.
      data_iterator: as for `restore`; a step without this process's data
        state (but others') is skipped, and kept.
      cast: convert dtypes, as for `restore`.
      rename: checkpoint paths to target paths, as for `restore`.

    Returns:
      (step, restored tree), or None when the directory has no finalized
      step.

    Raises:
      CheckpointCorruptedError: every finalized step failed; names them.
      StructureMismatchError: the target does not match (not skipped: an
        older step would not match either).
      RestoreFailedError: another process failed for another reason than
        damage (that process raises its own error).
    """
    self._check_open()
    _not_a_step(target, None)
    return self._restore_newest_valid(
        target, RestoreOptions(verify=verify, cast=cast, rename=rename),
        data_iterator)

  def _restore_newest_valid(self, target: Any, options: RestoreOptions,
                            data_iterator: datastate.DataIterator | None
                            ) -> tuple[int, Any] | None:
    """`restore_newest_valid`, its options checked."""
    self._check_open()
    self._before_restore()
    key = keys.fresh(self.coordinator, keys.child(self._base, "restore"))
    found, skipped = fallback.restore_newest(
        meetings.Meeting(self.coordinator, key, self.barrier_timeout_ms),
        steps=self.all_steps,
        restore=lambda step: self._restore_together(
            target, step, options, data_iterator),
        is_primary=self.is_primary,
        where=str(self.directory))
    if found is not None:  # Every process restored it.
      with self._lock:
        self._known_good = max(found[0], self._known_good)
    if skipped and found is not None:
      log.warning("restored step %d of %s after skipping damaged steps %s",
                  found[0], self.directory, skipped)
      self._set_aside(skipped)
    return found

  def discard(self, steps: list[int]) -> None:
    """Deletes finalized steps, for a run that resumed before them and
    will save those step numbers anew. Writers only; called on every
    process (the primary deletes)."""
    self._forget(steps, lambda: directory_lib.delete_steps(
        self.directory, sorted(steps), self.check_still_writer, self.backend))

  def _set_aside(self, steps: list[int]) -> None:
    """Takes damaged steps out of the list, so that training saves them anew.

    Otherwise the resumed run would never save those step numbers again,
    and a preemption at one would stop on the damaged copy. A read-only
    manager changes nothing.
    """
    self._forget(steps, lambda: fallback.set_aside(self.directory, steps,
                                                   self.backend))

  def _forget(self, steps: list[int], remove: Callable[[], None]) -> None:
    """Takes `steps` out of the list; the primary runs `remove`."""
    if self.read_only or not steps:
      return
    self._unlist(steps)
    if self._held.step in steps:
      self._held.release()
    if self.is_primary:
      remove()
