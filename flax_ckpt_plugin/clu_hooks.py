"""A clu periodic action that checkpoints: for loops that run a list of hooks.

The Flax examples' train loops call a list of `clu.periodic_actions` after
every step. `CheckpointAction` is one of them:

    from clu import metric_writers, periodic_actions
    from flax_ckpt_plugin import CheckpointAction

    writer = metric_writers.create_default_writer(
        workdir, just_logging=jax.process_index() > 0)
    ckpt = CheckpointAction.create(workdir, lambda: state, every_steps=1000,
                                   last_step=num_steps, metric_writer=writer)
    state = ckpt.restore_or_initialize(state)
    hooks = [periodic_actions.ReportProgress(num_train_steps=num_steps,
                                             writer=writer), ckpt]
    for step in range(int(state.step) + 1, num_steps + 1):
      state = train_step(state, next(batches))
      for h in hooks:
        h(step)
      if ckpt.should_stop:
        break
    ckpt.close()

Needs the `clu` extra (`pip install -e '.[clu]'` in a checkout); the released clu
imports tensorflow from `clu.periodic_actions`.
"""

from __future__ import annotations

from typing import Any, Callable

from clu import periodic_actions
from etils import epath

from flax_ckpt_plugin.loop.callback import CheckpointCallback
from flax_ckpt_plugin.manager.manager import CheckpointManager
from flax_ckpt_plugin.logs import log


class CheckpointAction(periodic_actions.PeriodicAction):
  """A clu `PeriodicAction` that runs a `CheckpointCallback` at every step.

  Built on clu's extension points: `_should_trigger` is the callback's
  decision (every N steps or seconds, listed steps, the last step, a
  preemption notice), taken the same way on every process, and `_apply`
  starts the save. clu's own schedule is not used, so this action must be
  called at every step on every process, as clu's hooks are. Calling it
  returns True when a save started.

  Args:
    callback: the callback that saves.
    state_fn: returns the current train state (e.g. `lambda: state`, a
      closure over the loop's variable).
    extra_fn: returns the JSON-serializable `extra` saved with a step (a
      data iterator position), or None. Called only at the steps it saves.
    step_offset: added to the step the hook is called with. Flax's own
      examples call their hooks with the 0-based index of the batch just
      trained (`for step in range(start, num_steps): ...; hook(step)`):
      give them `step_offset=1`, so that the saved step is the number of
      updates (`state.step`) and `last_step=num_steps` saves the end.
  """

  def __init__(self, callback: CheckpointCallback,
               state_fn: Callable[[], Any],
               extra_fn: Callable[[], Any] | None = None, *,
               step_offset: int = 0):
    super().__init__()
    self.callback = callback
    self._state_fn = state_fn
    self._extra_fn = extra_fn
    self._offset = step_offset
    self._last_seen: int | None = None

  @classmethod
  def create(cls, directory: epath.PathLike, state_fn: Callable[[], Any], *,
             extra_fn: Callable[[], Any] | None = None, step_offset: int = 0,
             **callback_kwargs: Any) -> "CheckpointAction":
    """An action with a new `CheckpointCallback(directory, **callback_kwargs)`."""
    return cls(CheckpointCallback(directory, **callback_kwargs), state_fn,
               extra_fn, step_offset=step_offset)

  def _should_trigger(self, step: int, t: float) -> bool:
    del t  # The callback keeps its own clock, agreed across processes.
    self._last_seen = step + self._offset
    return self.callback.should_save(step + self._offset)

  def _apply(self, step: int, t: float) -> None:
    del t
    extra = self._extra_fn() if self._extra_fn is not None else None
    self.callback.save(step + self._offset, self._state_fn(), extra=extra)

  @property
  def should_stop(self) -> bool:
    """True once a preemption checkpoint is durable: leave the loop."""
    return self.callback.should_stop

  @property
  def manager(self) -> CheckpointManager:
    """The callback's `CheckpointManager`."""
    return self.callback.manager

  def restore_or_initialize(self, state: Any, *, cast: bool = False,
                            data_iterator: Any = None,
                            restore_data_state: bool = True) -> Any:
    """See `CheckpointCallback.restore_or_initialize`."""
    return self.callback.restore_or_initialize(
        state, cast=cast, data_iterator=data_iterator,
        restore_data_state=restore_data_state)

  @property
  def restored_step(self) -> int | None:
    """The step `restore_or_initialize` restored, or None."""
    return self.callback.restored_step

  @property
  def restored_extra(self) -> Any:
    """The `extra` saved with the restored step, or None."""
    return self.callback.restored_extra

  def wait_until_finished(self) -> None:
    """Blocks until the running save is durable; raises its error."""
    self.callback.wait_until_finished()

  def close(self) -> None:
    """Closes the callback: waits for the last save, raises its error.

    Warns when the run ended one step short of the callback's `last_step`
    (hooks called with 0-based batch indices: see `step_offset`).
    """
    last = self.callback.triggers.last_step
    if last is not None and self._last_seen == last - 1:
      log.warning(
          "the last step this action saw is %d, one short of last_step=%d:"
          " the final state was not saved. If the loop calls its hooks with"
          " the 0-based index of the batch just trained (as Flax's examples"
          " do), create the action with step_offset=1.", last - 1, last)
    self.callback.close()
