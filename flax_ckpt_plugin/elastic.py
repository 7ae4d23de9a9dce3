"""Recovering in place: the survivors of a lost process go on training.

Without it, a lost process ends the job (`rescue`: the survivors save what
it cannot, then exit for a relaunch of every process). With a callback made
with `elastic=True`, the loop instead catches the loss (`PeerLostError`, or
the runtime's error of a collective with the dead process) and calls
`CheckpointCallback.recover(make_target)`; every survivor then, in the same
processes:

1. learns who is lost from the watcher (`liveness`), waiting for it if the
   collective failed first; a failure that no lost peer explains is raised
   again, as it was;
2. waits for its local tier's last save (it meets nobody), and the
   survivors agree on the newest local step that all of them hold (one
   barrier of the survivors, `groups.Survivors`);
3. asks `make_target(devices)` for the abstract state on the live devices
   (shapes, dtypes, shardings on a mesh of those devices) and restores that
   step from its own local tier into it: each reads the shards its devices
   need, and places them without a collective (in data parallelism every
   survivor holds a replica of every shard); all agree that each succeeded;
4. from then on meets the survivors only: the persistent tier's saves are
   written by them (`CheckpointManager.regroup`), and a new watcher watches
   them, so that a second loss is recovered from the same way.

If the survivors hold no common local step, or one of them lacks a shard it
needs, `recover` raises the loop's error again, with a note saying why, and
the issue-17 path follows when the program exits: the survivors save what
they hold to the persistent tier and exit with `PREEMPTED_EXIT_CODE`.

What the loop keeps: the devices of the lost process are gone from every
mesh; the loop rebuilds its jitted step for the new mesh (jit does so from
the restored state's shardings) and keeps its global batch by splitting it
over the live devices (see docs/fault_tolerance.md). Process 0 hosts JAX's
coordination service: when it dies, JAX ends every process and the job is
relaunched (the local tiers serve the restart).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, NamedTuple

import jax

from flax_ckpt_plugin import coordinator as coordinator_lib
from flax_ckpt_plugin import groups
from flax_ckpt_plugin import liveness
from flax_ckpt_plugin import local_tier as local_tier_lib
from flax_ckpt_plugin import rescue as rescue_lib
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.manager import CheckpointManager

# How long `recover` waits for the watcher to report a loss, when the loop's
# error (a runtime, timeout or connection error) came first: a collective
# with a dead peer can fail before the peer misses its heartbeats. One
# heartbeat timeout is enough; JAX's default is 100 s. Other errors are
# raised again at once.
SETTLE_SECS = 120.0


class Recovered(NamedTuple):
  """What `recover` gives the callback."""
  state: Any
  step: int
  extra: Any  # The step's `extra`.
  members: list[int]  # The survivors.
  lost: dict[int, str]
  secs: float  # From the call to the restored state.
  watcher: liveness.Watcher  # Watches the survivors.
  rescue: rescue_lib.Rescue


def recover(*, manager: CheckpointManager,
            local: local_tier_lib.LocalTier | None,
            watcher: liveness.Watcher | None, rescue: rescue_lib.Rescue | None,
            make_target: Callable[[list[Any]], Any], error: BaseException,
            data_iterator: Any, poll_secs: float, exit_code: int,
            elastic_secs: float) -> Recovered:
  """Restores the newest local step on the live devices; see the module doc.

  Called by every survivor, from the loop's handler of `error`.

  Raises:
    `error`: no peer was lost, or the survivors cannot restore a step
      together (a note on it says why).
  """
  t0 = time.monotonic()
  if (watcher is None or rescue is None or local is None
      or elastic_secs is None):
    error.add_note("recover() needs a callback made with elastic=True,"
                   " local_directory= and several processes")
    raise error
  if not watcher.lost and isinstance(
      error, (RuntimeError, TimeoutError, ConnectionError)):
    # A collective or a barrier with a dead peer can fail before the
    # coordination service declares it dead (one heartbeat timeout).
    end = time.monotonic() + SETTLE_SECS
    while not watcher.lost and time.monotonic() < end and watcher.watching:
      time.sleep(0.05)
  lost = watcher.lost
  if not lost:
    error.add_note("recover(): no process was lost; the error is the loop's")
    raise error
  if not rescue.claim():
    error.add_note("recover(): too late, the survivors' save for a relaunch"
                   f" had started ({elastic_secs:.0f}s after the loss)")
    raise error
  members = sorted(set(watcher.members) - set(lost))
  group = groups.Survivors(manager.coordinator, members)
  timeout_ms = manager.barrier_timeout_ms
  key = f"{manager.name}/recover/{'-'.join(map(str, members))}"

  def restore() -> Any:
    devices = [d for d in jax.devices() if d.process_index in members]
    return (local.manager.restore(make_target(devices), step,
                                  data_iterator=data_iterator),
            local.manager.metadata(step).extra)

  try:
    local.quietly("save", lambda m: m.wait_until_finished())
    step, _ = rescue_lib.common_step(group, key, local, manager, timeout_ms)
    if step is None:
      raise RuntimeError("the survivors hold no common step in their local"
                         f" tiers ({local.directory})")
    outcome = coordinator_lib.agree(group, f"{key}/restore", restore,
                                    timeout_ms=timeout_ms)
    if outcome.failures:
      raise RuntimeError(
          f"restoring local step {step} on the live devices failed:"
          f" {coordinator_lib.describe_failures(outcome.failures)}")
    manager.regroup(group, manager.barrier_timeout_ms / 1000)
    new_watcher, new_rescue = rescue_lib.watch(
        manager, local, poll_secs=poll_secs, exit_code=exit_code,
        elastic_secs=elastic_secs, members=members)
  except Exception as e:  # pylint: disable=broad-except
    rescue.give_up()
    error.add_note(f"recover() could not go on without {sorted(lost)}: {e}")
    raise error from (e if e is not error else None)
  rescue.recovered()
  secs = time.monotonic() - t0
  (state, extra) = outcome.result
  return Recovered(state, step, extra, members, lost, secs, new_watcher,
                   new_rescue)


def announce(done: Recovered, metric_writer: Any) -> None:
  """The log line of a recovery, and its metrics (`metric_writer`: the
  callback's, on the primary; else None)."""
  log.warning("lost process(es) %s; recovered in place at step %d in %.2fs"
              " on processes %s (%d devices)", sorted(done.lost), done.step,
              done.secs, done.members,
              sum(d.process_index in done.members for d in jax.devices()))
  if metric_writer is not None:
    metric_writer.write_scalars(done.step, {
        "elastic/recover_secs": done.secs,
        "elastic/live_processes": len(done.members)})


def caught_error() -> BaseException:
  """The exception being handled (`recover` is called from a handler)."""
  error = sys.exc_info()[1]
  if error is None:
    raise RuntimeError("recover() is called from the loop's `except` block"
                       " for PeerLostError or the runtime's error")
  return error
