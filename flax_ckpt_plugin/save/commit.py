"""The writer's protocol, on every process: opening, and each save.

`open_for_writing` claims the directory once. The background part of each
save:

    every process                          primary host only
    prepared:  agree                       make the step's working directory
    written:   write own shards + fsync,
               agree
    committed: agree                       check the merged manifest as the
                                           reader would; write it, fsync,
                                           finalize
    hooks:     agree                       run the commit hooks

Each phase is a `meetings.agree`: a process whose part failed records it
before the phase's barrier, so every process learns of it right after the
barrier and all raise together, instead of the others waiting for a timeout
at the next one. `commit` takes everything it needs as a `CommitInputs` and
returns the `SaveStats` and what this process wrote (`writer.Written`);
the manager keeps its list of steps, applies retention with the result,
and holds the step's bytes for a restore in this process (`backends.held`).
"""

from __future__ import annotations

import functools
import json
import math
import time
from typing import Any, Callable, NamedTuple, Sequence

from etils import epath
import numpy as np

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity as atomicity_lib
from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.format import files
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin.errors import CommitHookError
from flax_ckpt_plugin.errors import SaveFailedError
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.save.leaves import LeafSnapshot
from flax_ckpt_plugin.stats import SaveStats
from flax_ckpt_plugin.multihost import keys


CommitHook = Callable[[SaveStats], None]


class CommitInputs(NamedTuple):
  """Everything one background commit reads; it touches nothing else."""
  coordinator: coordinator_lib.Coordinator
  directory: epath.Path  # The checkpoint directory.
  backend: interface.Backend  # Its storage.
  step: int
  key: str  # Unique prefix of this save's barrier and key-value keys.
  tmp: atomicity_lib.TemporaryPath  # Where the step is written.
  leaves: Sequence[LeafSnapshot]  # This process's snapshot.
  extra: Any  # JSON-ready `extra` and `metrics`.
  metrics: dict[str, Any] | None
  blocking_secs: float
  is_primary: bool
  timeout_ms: int
  # Raises ConcurrentWriterError (with the given consequence) when another
  # job claimed the directory since this one opened it.
  check_still_writer: Callable[[str], None]
  scope: files.Scope | None = None  # One process's shards (local tier).
  writers: Sequence[int] | None = None  # Who writes; None: every process.
  data_state: datastate.Encoded | None = None  # This process's, if any.
  retention: dict[str, Any] | None = None  # The policy, for the manifest.
  pinned_fallback_bytes: int = 0  # See `SaveStats`.
  unpinned_bytes: int = 0  # See `SaveStats`.
  # The primary's wait before the step is made (the deletes of earlier
  # retention, when disk use is bounded); None: none.
  before_write: Callable[[], Any] | None = None
  # Where the commit's storage operations are recorded, with their
  # deadline (the committer's waiters watch it); None: the default's.
  in_flight: deadlines.InFlight | None = None


def open_for_writing(coord: coordinator_lib.Coordinator,
                     directory: epath.Path, backend: interface.Backend,
                     base: str, *, is_primary: bool, timeout_ms: int
                     ) -> tuple[str, list[int]]:
  """Claims `directory` for a writer and lists its steps, on every process.

  The primary claims it (a new writer's token) and lists it (its finalized
  steps, after removing the unfinished ones); the others receive both, so
  that opening costs the store as many list requests with 1000 processes
  as with one. The token names every later key of the writer, so that keys
  do not depend on how many managers a process opened.

  Args:
    coord: the processes that write the directory.
    directory: the checkpoint directory (made if missing).
    backend: its storage.
    base: the manager's key prefix.
    is_primary: whether this process claims and lists.
    timeout_ms: how long the others wait for the primary.

  Returns:
    The writer's token, and the finalized steps, oldest first.

  Raises:
    TimeoutError: the primary did not share them within `timeout_ms`.
  """
  token = steps = None
  multi = coord.process_count > 1
  if is_primary:
    directory.mkdir(parents=True, exist_ok=True)
    previous = directory_lib.current_writer(directory)
    token = directory_lib.claim_directory(directory, coord.process_count,
                                          backend)
    if previous:
      log.info("took over %s from its previous writer %s", directory,
               previous)
    for entry in directory_lib.remove_unfinished(directory, backend):
      log.warning("removed unfinished checkpoint %s", entry)
    steps = directory_lib.finalized_steps(directory)
    if multi:
      coord.kv_set(keys.child(base, "writer"), token)
      meetings.share_text(coord, keys.child(base, "steps", token),
                          json.dumps(steps))
  # Reused by every opening of this directory: a barrier key may be used
  # again once all passed it, and the primary set the token before it.
  coord.barrier(keys.child(base, "open"), timeout_ms=timeout_ms)
  if not is_primary:
    token = coord.kv_get(keys.child(base, "writer"), timeout_ms=timeout_ms)
    steps = json.loads(meetings.fetch_text(
        coord, keys.child(base, "steps", token), timeout_ms))
  return token, steps


def listed_by_primary(meeting: meetings.Meeting, directory: epath.Path, *,
                      is_primary: bool) -> list[int]:
  """The finalized steps, listed by the primary for all: what a new group
  of processes goes on from, after a save that broke may have finalized
  its step. Every process waits until all have them (a member that does
  not come is a `TimeoutError` on all)."""
  steps = meetings.decided_by_one(
      meeting.under("steps"),
      lambda: directory_lib.finalized_steps(directory), decides=is_primary,
      what=f"listing the steps of {directory}")
  meeting.coordinator.barrier(keys.child(meeting.key, "listed"),
                              timeout_ms=meeting.timeout_ms)
  return steps


def checkpoint_bytes(leaves: list[LeafSnapshot]) -> int:
  """Bytes of every array leaf of the whole (global) state."""
  return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
             for leaf in leaves if leaf.dtype is not None)


def _phase(meeting: meetings.Meeting, name: str, fn: Callable[[], Any], *,
           abandon: Callable[[], None] | None, what: str) -> Any:
  """Runs `fn` on every process; all raise together if any failed.

  `abandon` (the primary host's) removes the unfinished step when a phase
  failed or timed out anywhere. `what` names the save in the error.
  """
  outcome = meetings.agree(meeting.under(name), fn, on_timeout=abandon)
  if outcome.failures:
    if abandon is not None:
      abandon()
    if outcome.error is not None:
      raise outcome.error
    raise SaveFailedError(
        f"{what} failed on other processes:"
        f" {meetings.describe_failures(outcome.failures)}")
  return outcome.result


def commit(inputs: CommitInputs) -> tuple[SaveStats, writer.Written]:
  """Writes and finalizes one snapshot; the commit thread's body.

  Called on every process; only the primary host makes and finalizes the
  step directory.
  """
  coord, tmp, step, key = (inputs.coordinator, inputs.tmp, inputs.step,
                           inputs.key)
  io = inputs.in_flight or deadlines.InFlight(
      where=f"step {step} in {inputs.directory}")
  t0 = time.perf_counter()
  pid, count = coord.process_index, coord.process_count
  total_bytes = checkpoint_bytes(inputs.leaves)
  meeting = meetings.Meeting(coord, key, inputs.timeout_ms)
  def abandon():
    with io.doing(f"removing the unfinished {tmp.path}"):
      tmp.abandon()

  phase = functools.partial(
      _phase, meeting, abandon=abandon if inputs.is_primary else None,
      what=f"save of step {step} to {inputs.directory}")

  def prepare():
    if inputs.is_primary:
      if inputs.before_write is not None:  # Every process waits with it.
        inputs.before_write()
      with io.doing(f"making the step's directory {tmp.path}"):
        tmp.prepare()
      if count > 1:  # Others check that they write where it made.
        coord.kv_set(keys.child(key, "identity"), json.dumps(tmp.identity))

  phase("prepared", prepare)
  identity = tmp.identity
  if count > 1 and not inputs.is_primary:
    identity = json.loads(coord.kv_get(keys.child(key, "identity"),
                                       timeout_ms=inputs.timeout_ms))
  written = phase(
      "written",
      lambda: writer.write_process_files(tmp.path, inputs.leaves, pid,
                                          identity=identity,
                                          backend=inputs.backend,
                                          data_state=inputs.data_state,
                                          in_flight=io))

  def finalize():
    if inputs.is_primary:
      with io.doing(f"reading the claim of {inputs.directory}"):
        inputs.check_still_writer(f"step {step} was not finalized")
      with io.doing(f"reading the shard tables in {tmp.path}"):
        merged, origins = writer.merge_tables(
            tmp.path, step=step, leaves=inputs.leaves, process_count=count,
            primary=pid, extra=inputs.extra, metrics=inputs.metrics,
            backend=inputs.backend, scope=inputs.scope,
            writers=inputs.writers, retention=inputs.retention)
      text = manifest_lib.checked_text(
          merged, origins, f"step {step} in {inputs.directory}")
      with io.doing(f"writing the manifest in {tmp.path}"):
        writer.write_manifest(tmp.path, text=text, process_count=count,
                               backend=inputs.backend, writers=inputs.writers)
      # Its own operation: once a waiter gave up on this commit, it is
      # never begun, whenever a stuck call above returns.
      with io.doing(f"finalizing {tmp.path}"):
        tmp.finalize()

  phase("committed", finalize)
  secs = time.perf_counter() - t0
  nbytes = written.nbytes
  if nbytes:  # A restore on this machine reads it next.
    try:
      with io.doing(f"starting to read back step {step} of"
                    f" {inputs.directory}"):
        inputs.backend.prefetch(
            inputs.directory, inputs.directory / str(step) /
            files.data_file(pid), secs)
    except Exception as e:  # pylint: disable=broad-except
      log.warning("step %d is final; reading it back failed: %r", step, e)
  log.info("step %d committed to %s: %.3fs blocking, %.3fs commit, %d bytes"
           " written by this process", step, inputs.directory,
           inputs.blocking_secs, secs, nbytes)
  return SaveStats(step, inputs.blocking_secs, secs, nbytes,
                   total_bytes=total_bytes,
                   path=inputs.directory / str(step),
                   finalized_at=time.time(),
                   pinned_fallback_bytes=inputs.pinned_fallback_bytes,
                   unpinned_bytes=inputs.unpinned_bytes), written


def step_state(directory: epath.Path, step: int) -> str:
  """Whether a failed save's step is finalized, as a note for its error."""
  try:
    done = directory_lib.is_finalized(directory / str(step))
  except Exception as e:  # pylint: disable=broad-except  # A note, no more.
    return f"Whether step {step} was finalized is unknown: {e}."
  if done:
    return f"Step {step} is finalized in {directory}."
  return f"Step {step} was not finalized."


def run_retention(meeting: meetings.Meeting, stats: SaveStats, *,
                  delete: Callable[[], Any]) -> None:
  """Runs `delete` on every process, and has all learn how it went.

  Args:
    meeting: where the processes meet.
    stats: the step whose retention this is.
    delete: this process's part (the primary queues the deletes, and
      raises an earlier delete's error).

  Raises:
    Exception: this process's own error; or RuntimeError naming the process
      that failed (the step itself is finalized either way).
  """
  outcome = meetings.agree(meeting.under("retention"), delete)
  if outcome.error is not None:
    raise outcome.error
  if outcome.failures:
    raise RuntimeError(
        f"retention after step {stats.step} failed on another process (the"
        " step is finalized; older steps may be left):"
        f" {meetings.describe_failures(outcome.failures)}")


def run_hooks(meeting: meetings.Meeting, hooks: Sequence[CommitHook],
              stats: SaveStats, *, is_primary: bool) -> None:
  """Runs the commit hooks on the primary; every process learns whether
  one failed.

  Every process meets here, so that a failed hook is raised by all of them,
  not only by the primary (the others would otherwise wait for it at the
  next save's barriers until they time out).

  Args:
    meeting: where the processes meet.
    hooks: run in order with `stats`.
    stats: the finalized step's.
    is_primary: whether this process runs them.

  Raises:
    CommitHookError: a hook raised (on every process).
  """
  def run():
    if not is_primary:
      return
    for hook in hooks:
      try:
        hook(stats)
      except Exception as e:  # pylint: disable=broad-except
        name = getattr(hook, "__qualname__", None) or repr(hook)
        error = CommitHookError(
            f"commit hook {name} failed after step {stats.step} was"
            f" finalized in {stats.path.parent if stats.path else '?'} (the"
            f" step is durable; retention was skipped for this save):"
            f" {type(e).__name__}: {e}")
        raise error from e

  outcome = meetings.agree(meeting.under("hooks"), run)
  if outcome.error is not None:
    raise outcome.error
  for _, message in outcome.failures.values():
    raise CommitHookError(message)
