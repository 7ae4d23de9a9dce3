"""CheckpointCallback: the one object a train loop adds.

    cb = CheckpointCallback(workdir, every_steps=1000)
    state = cb.restore_or_initialize(state)
    for step in range(int(state.step) + 1, num_steps + 1):
      state = train_step(state, batch)
      cb(step, state)
      if cb.should_stop:
        break
    cb.close()

Multi-process contract: call it on every process at every step with the same
step. All processes then make the same decision: step-based triggers are
deterministic, the `every_secs` decision is taken by the primary host and read
by the others through the coordinator at a few steps per interval (see
`triggers`), and the preemption sync point is agreed by JAX's preemption sync
manager.
"""

from __future__ import annotations

import operator
import os
import sys
from typing import Any, Callable, Iterable

from etils import epath

from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.loop.tiers import Restored
from flax_ckpt_plugin.loop.tiers import Tiers
from flax_ckpt_plugin.stats import MetricWriter
from flax_ckpt_plugin.stats import SaveMetrics
from flax_ckpt_plugin.stats import SaveStats
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.manager import options
from flax_ckpt_plugin.manager.retention import Retention
from flax_ckpt_plugin.restore.options import RestoreOptions
from flax_ckpt_plugin.loop.preemption import SignalFlag
from flax_ckpt_plugin.loop.interval import AutoInterval
from flax_ckpt_plugin.loop.triggers import Commits
from flax_ckpt_plugin.loop.triggers import Triggers
from flax_ckpt_plugin.tolerance.options import FaultTolerance

# The exit code for a job that stopped after its preemption checkpoint:
# EX_TEMPFAIL ("temporary failure; retry"), distinct from a crash (1) and from
# being killed by SIGTERM before saving (143).
PREEMPTED_EXIT_CODE = os.EX_TEMPFAIL

class CheckpointCallback:
  """Decides when to save, saves asynchronously, and says when to stop.

  Saves at a step when any of these holds: `step` is a positive multiple of
  `every_steps`; `every_secs` have passed since the last save (or since the
  callback was made); `step` is in `on_steps`; `step == last_step`; or a
  preemption notice arrived (then, once that checkpoint is durable,
  `should_stop` turns True and the loop should exit, e.g. with
  `PREEMPTED_EXIT_CODE`). A step that is already finalized is never saved
  again, so a restarted job may call it at that step.

  Preemption notices: with `jax.distributed`, JAX's notifier catches SIGTERM
  and all processes reach its sync point at one step. A single process
  without it gets handlers for `preemption_signals` that only set a flag;
  the next call saves and stops. Other signals than SIGTERM (SLURM's
  `--signal=USR1@90`) are also caught with several processes, and passed on
  to JAX's notifier. `close()` puts the previous handlers back.

  Args:
    directory: where checkpoints live (local path, `gs://`, `s3://`).
    every_steps: save at every positive multiple of this step; or an
      `AutoInterval(mtbf_secs=...)`: at the interval that loses least time
      to saves and failures, sqrt(2 x C x MTBF) (Young/Daly), from the
      job's mean time between failures and the measured cost C of a save
      to the loop (the time the loop waited in the call that saved, plus
      the slowdown of the steps that ran while its commit was written in
      the background), the mean of the last 3 saves, over the measured
      step time; within its `min_every_steps` and `max_every_steps`. The
      primary host decides each interval from its own measures, at a save,
      and every process applies it from the next save on, so all save at
      the same steps. Until a save is measured it saves every
      `min_every_steps` steps (default 100). See docs/auto_interval.md.
      (`"auto"`, with `FaultTolerance(mtbf_secs=, min_every_steps=,
      max_every_steps=)`, is its deprecated form: it warns, for one
      release.)
    every_secs: save when this many seconds passed since the last save.
    on_steps: save at these steps.
    last_step: save at this step (the end of training).
    max_to_keep: keep the newest N finalized steps (None, the default,
      keeps all, as `CheckpointManager` and Orbax do).
    metric_writer: if given (e.g. a clu `MetricWriter`), the primary host
      writes for each finalized save, at its step: `checkpoint/blocking_secs`
      (how long the loop waited), `checkpoint/commit_secs` (snapshot to
      durable), `checkpoint/bytes` (the whole checkpoint),
      `checkpoint/gbytes_per_sec`, and `checkpoint/secs_since_last_durable`
      (wall-clock seconds from the previous durable checkpoint of this
      callback, or from its creation, to this one: the work a crash just
      before it would have lost). With `every_steps=AutoInterval(...)`, also the
      interval and why: `checkpoint/auto_every_steps` (the steps from this
      save to the next), `checkpoint/auto_next_every_steps` (the interval
      decided at this save, from the next save on), and what it rests on:
      `checkpoint/auto_cost_secs` (C), `auto_blocking_secs`,
      `auto_background_secs`, `auto_step_secs`, `auto_mtbf_secs`,
      `auto_young_daly_secs` (sqrt(2 C M)), `auto_bound` (-1: raised to
      the minimum, 1: cut to the maximum, else 0) and
      `auto_saves_measured` (0: no cost measured yet; the figures not
      measured yet are NaN). Written from the
      loop's thread, at the next call, `wait_until_finished` or `close`
      after the commit.
    retention: the rules that keep more steps (`Retention`: every N-th
      step; the best by a metric passed in `metrics=` of the calls that may
      save).
    tolerance: what to do when a process or its machine goes away
      (`FaultTolerance`: preemption, lost processes, the local tier).
    storage: where and how the bytes are written (`Storage`: the storage
      backend, atomicity, pinned host memory). On accelerators
      `restore_or_initialize` (or the first call) starts a thread that
      pins the host memory of `Storage.pinned_host_bytes` (for each tier)
      while the loop runs, about 0.5 s per GB; a save that comes before
      it is done copies the rest on the devices, so no save call waits
      for it. It stays pinned for the life of the process (see
      docs/performance.md).
    processes: how the processes agree on a save (`Processes`: the primary
      host, the barriers' timeout and keys, the coordinator).

  To run something once a step is finalized: `add_commit_hook`.

  The data iterator whose state each save stores is given to
  `restore_or_initialize`, which also gives it its state back.

  Attributes:
    manager: the `CheckpointManager` that saves and restores.
    triggers: when each tier saves.
    should_stop: True once a preemption checkpoint is durable.
    should_rebuild: True once the survivors of a loss take a relaunched
      process back (see `elastic`): call `recover` before the next step.
    restored_step: the step `restore_or_initialize` restored, or None.
    restored_extra: the `extra` saved with that step, or None.
    restored_tier: where that step came from: "local", "peer" or
      "persistent"; None when nothing was restored.
    local: the local tier, or None.
    tiers: the tiers it saves through (the manager, the local tier
      and the watch over the other processes).

  Raises:
    ValueError: `every_steps` < 1 or `every_secs` <= 0; the options of
      `AutoInterval` given both as it and as `FaultTolerance`'s deprecated
      fields, or those fields without `every_steps="auto"`; `"auto"`
      without `FaultTolerance(mtbf_secs=)`.

  As a context manager it closes on exit (restoring signal handlers and
  waiting for the running save).
  """

  def __init__(self, directory: epath.PathLike, *,
               every_steps: int | AutoInterval | None = None,
               every_secs: float | None = None,
               on_steps: Iterable[int] = (),
               last_step: int | None = None,
               max_to_keep: int | None = None,
               metric_writer: MetricWriter | None = None,
               retention: Retention | None = None,
               tolerance: FaultTolerance | None = None,
               storage: options.Storage | None = None,
               processes: options.Processes | None = None):
    tolerance = tolerance or FaultTolerance()
    self.triggers = Triggers(
        every_steps=every_steps, every_secs=every_secs, on_steps=on_steps,
        last_step=last_step, tolerance=tolerance)
    self.save_on_preemption = tolerance.save_on_preemption
    self.metric_writer = metric_writer
    self.data_iterator: datastate.DataIterator | None = None
    self.restore_data_state = True
    self.tiers = Tiers(directory, max_to_keep=max_to_keep,
                       retention=retention, storage=storage,
                       processes=processes,
                       tolerance=tolerance, exit_code=PREEMPTED_EXIT_CODE,
                       metric_writer=metric_writer)
    self.manager, self.local = self.tiers.manager, self.tiers.local
    # The step `should_save` chose, and whether it saves each tier there.
    self._chosen: tuple[int, bool, bool] | None = None
    self.should_rebuild = False
    self._metrics = SaveMetrics(metric_writer)
    if metric_writer is not None:  # Before the user's hooks.
      self.manager.add_commit_hook(self._metrics.record)
    self.triggers.start(self.manager.coordinator,
                        is_primary=self.manager.is_primary,
                        timeout_ms=self.manager.barrier_timeout_ms)
    self.should_stop = False
    self._preempted_at: int | None = None  # The step to stop after.
    self.restored_step: int | None = None
    self.restored_extra: Any = None
    self.restored_tier: str | None = None
    self._signals = SignalFlag(
        tolerance.preemption_signals if self.save_on_preemption else (),
        forward=self.manager.coordinator.preemption_notifier_installed())
    self._signals.install()
    if (not self.triggers.persistent_triggers
        and tolerance.local_every_steps is None):
      log.warning(
          "CheckpointCallback(%s) has no trigger: it saves %s. Pass"
          " every_steps=N (Orbax's save_interval_steps; Orbax saves every"
          " step by default), every_secs, on_steps or last_step.",
          self.directory, "only when a preemption notice arrives"
          if self.save_on_preemption else "nothing")

  @property
  def directory(self) -> epath.Path:
    """The checkpoint directory."""
    return self.manager.directory

  def add_commit_hook(self, hook: Callable[[SaveStats], None]) -> None:
    """See `CheckpointManager.add_commit_hook`."""
    self._check_open()
    self.manager.add_commit_hook(hook)

  def __call__(self, step: int, state: Any, *, extra: Any = None,
               metrics: dict[str, Any] | None = None) -> bool:
    """Saves `state` as `step` if a trigger fires; call every step.

    The same as `if cb.should_save(step): cb.save(step, state, ...)`.

    Args:
      step: the step number of `state` (e.g. the number of updates applied).
      state: the train state; its buffers may be donated right after.
      extra: JSON-serializable user state saved with the step (data
        iterator position, host RNG state, ...).
      metrics: numbers recorded with the step.

    Returns:
      True when a save started at this step.

    Raises:
      RuntimeError: the callback is closed.
      Exception: the error of an earlier background save (once).
    """
    self._check_open()
    try:
      self.tiers.warm_up(state)
      self.tiers.check_rebuild(step, state)
      saved = self.should_save(step)
      if saved:
        self.save(step, state, extra=extra, metrics=metrics)
      if self.tiers.rebuild_at == step:
        self.tiers.quietly("save", lambda m: m.wait_until_finished())
        self.should_rebuild = True
    except Exception as e:
      self.tiers.raise_instead(e)
      raise
    return saved

  def should_save(self, step: int) -> bool:
    """Whether a trigger fires at `step`; call it at every step.

    Called on every process at every step (the `every_secs` and preemption
    decisions are taken together). When it returns True, call `save` for
    the same step before the next call.

    Raises:
      RuntimeError: the callback is closed.
      Exception: the error of an earlier background save (once).
    """
    self._check_open()
    self.triggers.call_started()
    self.tiers.check()
    self._metrics.flush()
    self.manager.check_for_errors()
    self.tiers.quietly("save", lambda m: m.check_for_errors())
    self._chosen = None
    if self.should_stop:
      self._call_ended()
      return False
    step = operator.index(step)
    preempted = self.save_on_preemption and (
        self.manager.coordinator.reached_preemption_sync_point(step)
        or self._signals.triggered)
    persistent = (self.triggers.persistent(step, self.manager.name)
                  or preempted)
    if persistent and step in self.manager.all_steps():
      self.should_stop = preempted  # That step is already durable.
      persistent = False
    local = (self.local is not None and not preempted and step > 0
             and (self.triggers.local(step) or step == self.tiers.rebuild_at)
             # With partner copies every process takes part in the save
             # (a collective), whatever its local tier holds.
             and (self.tiers.exchange is not None
                  or step not in self.local.manager.all_steps()))
    self._call_ended()
    if not (persistent or local):
      return False
    self._preempted_at = step if preempted else None
    self._chosen = (step, persistent, local)
    return True

  def _call_ended(self) -> None:
    """The triggers hear that the step after this call starts now."""
    self.triggers.call_ended(self._commits)

  def _commits(self) -> Commits:
    """Which commits run in the background now."""
    persistent = self.manager.save_in_progress
    return Commits(persistent=persistent, any=persistent or (
        self.local is not None and self.local.manager.save_in_progress))

  def save(self, step: int, state: Any, *, extra: Any = None,
           metrics: dict[str, Any] | None = None) -> None:
    """Saves `state` as `step` now (after `should_save(step)` said so).

    At a preemption step it waits until the step is durable and sets
    `should_stop`. Arguments as for `__call__`.
    """
    self._check_open()
    step = operator.index(step)
    chosen, self._chosen = self._chosen, None
    persistent, local = (True, False) if chosen is None or chosen[0] != step \
        else chosen[1:]
    if persistent:
      self._metrics.add(step, self.triggers.save_started(
          step, self.manager.name, wait=self.manager.wait_until_finished))
    data = None if self.data_iterator is None else (
        self.data_iterator.get_state())
    if persistent:
      self.manager.save(step, state, extra=extra, metrics=metrics,
                        data_state=data)
      self.triggers.saved(self.manager.name)
    if local:
      self.tiers.save_local(step, state, extra=extra, metrics=metrics,
                            data_state=data)
    if persistent:
      self.triggers.save_ended()
    self._call_ended()
    if self._preempted_at == step:  # Durable; deletes are left to close.
      self._wait_until_durable(deletes=False)
      self.should_stop = True
      log.warning("preemption checkpoint of step %d is durable in %s; the"
                  " loop should stop", step, self.directory)

  def restore_or_initialize(
      self, state: Any, *, cast: bool = False,
      make_target: Callable[[list[Any]], Any] | None = None,
      data_iterator: datastate.DataIterator | None = None,
      restore_data_state: bool = True) -> Any:
    """The newest good finalized step restored like `state`, else `state`.

    A step that fails verification (damaged or missing files) is skipped
    with a warning, and the next older one is restored. Sets
    `restored_step` and `restored_extra` (the `extra` saved with it), or
    leaves them None when there is nothing to restore.

    In an elastic job, a process relaunched after a loss instead waits
    until the survivors take it back, and receives their state from their
    local tiers (`restored_tier` "peer"; see `elastic`), on a mesh of
    every device in the group's new order: `make_target(devices)` if given
    (as for `recover`), else `state`'s meshes with their devices replaced
    position for position.

    Args:
      state: the state to restore like (and to return when there is no
        step), as for `CheckpointManager.restore`.
      cast: convert leaves saved in another dtype than `state`'s (float32
        into bfloat16, say), as `CheckpointManager.restore` does.
      make_target: see above.
      data_iterator: this process's data iterator, or any object with
        `get_state()` / `set_state(state)` (Grain's iterators; bytes or a
        JSON value, see docs/integrations.md): it gets the state saved with the
        restored step back, and from now on each save stores this
        process's `get_state()` with the step, in both tiers. Call the
        callback after the step that consumed the batch, before the next
        batch is drawn; a prefetching loader must not run ahead of the
        step (see docs/integrations.md). (Or set `data_iterator`.)
      restore_data_state: False: restore the train state but leave the
        data iterator as it is (a job relaunched on another process count,
        whose saved data positions mean nothing to it); its state is still
        saved from now on.

    Raises:
      CheckpointCorruptedError: steps exist but none of them restores.
      StructureMismatchError: `state` does not fit the checkpoint.
      RuntimeError: the callback is closed.
    """
    self._check_open()
    if data_iterator is not None:
      self.data_iterator = data_iterator
    self.restore_data_state = restore_data_state
    found = self.tiers.restore(
        state, RestoreOptions(cast=cast), make_target=make_target,
        data_iterator=self.data_iterator if restore_data_state else None)
    return state if found is None else self._restored(found)

  def recover(self, make_target: Callable[[list[Any]], Any]
              ) -> tuple[Any, int]:
    """Goes on without a lost process, or takes its replacement back: call
    it on every survivor from the loop's handler of `PeerLostError` or the
    runtime's error, and when `should_rebuild` is set (see `elastic`).

    Args:
      make_target: given the live devices, the abstract state on them (a
        tree of `jax.ShapeDtypeStruct` with shardings on a mesh of those
        devices, like the state). It may be called with several orders of
        the devices (and once with all of the job's, in their first
        order) before the order whose meshes reuse no device list of an
        earlier generation is kept, built last; so it builds and runs
        nothing that meets other processes.

    Returns:
      The state and its step: after a loss, the newest local step that
      every survivor holds, on the live devices (the loop goes on from the
      step after it); after `should_rebuild`, the step just saved, on the
      devices of every process, the relaunched ones too.

    Raises:
      The error being handled: no process was lost, or the survivors
      cannot restore (see `elastic`); the program should then exit, and
      the survivors save what they hold and end with `PREEMPTED_EXIT_CODE`.
    """
    rebuild, step = self.should_rebuild, self.tiers.rebuild_at
    self.should_rebuild, self.tiers.rebuild_at = False, None
    if rebuild and sys.exc_info()[1] is None:
      self.wait_until_finished()  # Its error is the loop's, not the rejoin's.
      done = self.tiers.rejoin(make_target)
      if done is None:  # It failed (logged): go on as before.
        return self.tiers.peers.kept, step
    else:
      done = self.tiers.recover(
          make_target,
          self.data_iterator if self.restore_data_state else None)
    return self._restored(done), done.step

  def _restored(self, done: Restored) -> Any:
    """The callback goes on from `done.step` (with the new group of
    processes, after a loss or a rejoin)."""
    if done.regrouped:
      self.triggers.regroup(self.manager.coordinator,
                            is_primary=self.manager.is_primary)
    self.restored_step, self.restored_tier = done.step, done.tier
    self.restored_extra, self._chosen = done.extra, None
    return done.state

  def wait_until_finished(self) -> None:
    """Blocks until the running save is durable and retention's deletes
    are done; raises the save's error.

    Raises:
      RuntimeError: the callback is closed.
    """
    self._check_open()
    self._wait_until_durable(deletes=True)

  def _wait_until_durable(self, *, deletes: bool) -> None:
    try:
      self.tiers.wait_until_finished(deletes=deletes)
    finally:
      self._metrics.flush()

  def _check_open(self) -> None:
    if self.manager.closed:
      raise RuntimeError(
          f"CheckpointCallback for {self.directory} is closed (close(), or"
          " its `with` block ended): it saves nothing more. Make a new one"
          " to go on saving.")

  def close(self) -> None:
    """Restores signal handlers, waits for the running save, raises its error.

    After a preemption stop (`should_stop`) that is all it waits for: the
    machine may be going away, so nothing is read back into its page cache
    (after a normal end, a local disk's newest step is, for a restart on
    this machine: see `CheckpointManager.close`).

    Raises:
      PeerLostError: a peer was lost (see `watch_peers`).
    """
    self._signals.uninstall()
    try:
      self.tiers.close(leaving=self.should_stop)
    finally:
      self._metrics.flush()

  def __enter__(self) -> "CheckpointCallback":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc is None:
      self.close()
      return
    self._signals.uninstall()
    try:
      self.tiers.exit(exc_type, exc, tb)
    finally:
      self._metrics.flush()
