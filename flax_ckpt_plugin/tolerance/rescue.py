"""What the survivors of a lost process do: save what it cannot, then leave.

When the watcher (`liveness`) reports a lost peer, on its thread, every
survivor:

1. waits for its own background commits: the local tier's ends by itself,
   and the persistent tier's at once (its waits obey the watcher);
2. lists its local steps to the other survivors; they pick the newest step
   that all of them hold, unless the persistent tier has it or a newer one;
3. learns which shards of it it writes (`shares`: the lowest survivor
   holding a shard writes it); if together they hold every shard (the
   lost process's shards have replicas on survivors, as in data
   parallelism), each writes those from its local tier, and the step is
   committed to the persistent tier as a save is (`commit.commit`), with
   barriers over the survivors only;
4. ends the process with `PREEMPTED_EXIT_CODE`, so that the launcher starts
   the job again: from the exit hook at once if the program is exiting
   (its loop raised `PeerLostError`, or the error of a collective with the
   dead peer), or after `GRACE_SECS` if the main thread is still running
   (it may be stuck in such a collective, which on CPU fails only after
   `--xla_cpu_collective_timeout_seconds`). JAX's own shutdown would abort
   the process (status -6) with a peer gone, so the hook exits first.

When the survivors do not hold every shard, nothing is saved and the
local tiers (the lost process's too, if its host lives) serve the restart.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, TYPE_CHECKING

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin import exits
from flax_ckpt_plugin.save import atomicity as atomicity_lib
from flax_ckpt_plugin.save import commit as commit_lib
from flax_ckpt_plugin.multihost import groups
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.tolerance import liveness
from flax_ckpt_plugin.tolerance import shares
from flax_ckpt_plugin.logs import log

if TYPE_CHECKING:
  from flax_ckpt_plugin.manager.tier import TierManager
  from flax_ckpt_plugin.tolerance import local_tier

# How long the main thread has, once the survivors' save is done, to reach
# the exit hook by itself before the process ends anyway.
GRACE_SECS = 3.0
# The most a survivor waits for the others at each phase of the save.
TIMEOUT_SECS = 60.0
# How long process 0 (which hosts the coordination service) waits for the
# other survivors to leave before it leaves.
LEAVE_LAST_SECS = 5.0
# How long a survivor waits for its own background saves to end.
WAIT_SECS = 5.0
# How long process 0, ending well, waits for the others to leave JAX's
# coordination service, which it hosts (see `liveness.outlive`).
OUTLIVE_SECS = 30.0
# How long an exiting program waits to learn whether a peer was lost: a
# dead peer is declared dead after JAX's heartbeat timeout (100 s by
# default); when none died, two polls (about 1 s) settle it.
SETTLE_SECS = 600.0


def watch(manager: TierManager,
          local: local_tier.LocalTier | None, *, poll_secs: float,
          exit_code: int, elastic_secs: float | None = None,
          members: Any = None, key: str | None = None, joins: bool = False,
          lost_key: str | None = None
          ) -> tuple[liveness.Watcher, "Rescue"]:
  """Starts watching the peers (`members`: all by default); a loss starts
  the survivors' `Rescue`, or with `elastic_secs` waits that long for the
  loop to recover in place (`elastic`) first. `key`, `joins`, `lost_key`:
  see `liveness.watch`.

  Called on every process at the same point (see `liveness`).
  """
  rescue = Rescue(manager, local, exit_code=exit_code,
                  elastic_secs=elastic_secs)
  watcher = liveness.watch(manager.coordinator, manager.name,
                           poll_secs=poll_secs, on_lost=rescue.on_lost,
                           members=members, key=key, joins=joins,
                           lost_key=lost_key,
                           settings_timeout_ms=manager.barrier_timeout_ms)
  rescue.watching(watcher)
  return watcher, rescue


class Rescue:
  """The survivors' save and exit, for one callback; see the module doc.

  Args:
    manager: the persistent tier.
    local: this process's local tier, or None (then nothing is saved).
    exit_code: the status the process ends with after a loss.
    elastic_secs: if not None, a loss first waits this long for the loop to
      recover in place (`recovered`) or give up (`give_up`), and only then
      saves and leaves.
  """

  def __init__(self, manager: TierManager,
               local: local_tier.LocalTier | None, *, exit_code: int,
               elastic_secs: float | None = None):
    self._manager = manager
    self._local = local
    self._exit_code = exit_code
    self._elastic_secs = elastic_secs
    self._watcher: liveness.Watcher | None = None
    self._started = threading.Event()
    self._done = threading.Event()
    self._decided = threading.Event()  # The loop recovered or gave up.
    self._recovered = threading.Event()
    self._claim = threading.Lock()  # Recovering and saving exclude each other.
    self._claimed = False
    self.saved_step: int | None = None  # What the survivors saved.
    exits.before_exit(self._at_exit)  # Before JAX's shutdown.

  def watching(self, watcher: liveness.Watcher) -> None:
    self._watcher = watcher

  def claim(self) -> bool:
    """The loop starts to recover in place: False if the survivors' save
    (for a relaunch) has started already; else it waits for `recovered`
    or `give_up`, however long the recovery takes."""
    with self._claim:
      self._claimed = not self._started.is_set()
      return self._claimed

  def recovered(self) -> None:
    """The loop goes on without the lost peers: nothing to save or end."""
    self._recovered.set()
    self._decided.set()

  def give_up(self) -> None:
    """The loop could not recover: save, then leave (as without
    `elastic_secs`)."""
    self._decided.set()

  def on_lost(self, lost: dict[int, str]) -> None:
    """The watcher's thread, once peers are lost: save, then leave."""
    if self._elastic_secs is not None:
      if not self._decided.wait(self._elastic_secs):
        with self._claim:
          if not self._claimed:  # Saving from now on: no recovery.
            self._started.set()
        if self._claimed:
          self._decided.wait()
        else:
          log.error("the loop did not recover within %.0fs of the loss;"
                    " saving and leaving", self._elastic_secs)
      if self._recovered.is_set():
        return
    self._started.set()
    try:
      self._save(set(lost))
    except Exception as e:  # pylint: disable=broad-except
      log.error("the survivors' save failed: %r", e)
    finally:
      self._done.set()
    time.sleep(GRACE_SECS)
    log.error("the main thread did not end within %.0fs of the survivors'"
              " save (stuck in a collective with the lost process?);"
              " ending the process with status %d", GRACE_SECS,
              self._exit_code)
    self._leave()

  def _at_exit(self) -> None:
    """The program is exiting: if a peer is lost (or being lost), finish
    the survivors' save and end with the preemption status."""
    watcher = self._watcher
    if watcher is None or self._recovered.is_set():
      return
    if (watcher.closed and not watcher.lost) or (
        not self._started.is_set() and not watcher.settle(SETTLE_SECS)):
      # No peer is lost (or it was, and the loop recovered): the others
      # must not think this one is.
      watcher.close()
      coord = self._manager.coordinator
      if watcher.members[0] == coord.process_index == 0:
        liveness.outlive(groups.Survivors(coord, []), watcher.members,
                         OUTLIVE_SECS)
      if len(watcher.members) < coord.process_count:
        _shutdown_jax()  # After a recovery in place (see `elastic`).
      return
    self.give_up()  # Exiting: the loop did not recover.
    if self._started.wait(2.0):  # The watcher reports, then starts it.
      self._done.wait(TIMEOUT_SECS * 4)
    self._leave()

  def _members(self) -> list[int]:
    """The processes watched: the job's, or the survivors of a loss that
    the loop recovered from."""
    if self._watcher is not None:
      return self._watcher.members
    return list(range(self._manager.coordinator.process_count))

  def _leave(self) -> None:
    """Ends the process; process 0 last.

    Process 0 hosts the coordination service, and a survivor that polls it
    after it is gone is aborted by JAX (status -6) instead of ending with
    the preemption status. So every other survivor says it is leaving, and
    process 0 waits for them (at most `LEAVE_LAST_SECS`).
    """
    watcher = self._watcher
    coord = groups.Survivors(self._manager.coordinator, [])
    key = keys.child(self._manager.name, "leaving")
    try:
      if coord.process_index != 0:
        coord.kv_set(keys.of_process(key, coord.process_index), "1")
      else:
        lost = set(watcher.lost) if watcher is not None else set()
        others = {p for p in self._members() if p} - lost
        end = time.monotonic() + LEAVE_LAST_SECS
        while time.monotonic() < end and not others <= set(
            keys.by_index(coord.kv_dir(key))):
          time.sleep(0.05)
        time.sleep(0.2)  # From their mark to their exit.
    except Exception as e:  # pylint: disable=broad-except
      log.warning("leaving without the others (%r)", e)
    _leave(self._exit_code)

  def _save(self, lost: set[int]) -> None:
    manager, local = self._manager, self._local
    for m in (manager, local.manager if local else None):
      try:
        if m is not None and not m.wait_until_finished(WAIT_SECS,
                                                       deletes=False):
          log.warning("the background save to %s still runs after %.0fs;"
                      " the survivors' save goes on without it",
                      m.directory, WAIT_SECS)
      except Exception:  # pylint: disable=broad-except
        pass  # A save the loss broke; the loop raises PeerLostError.
    if local is None:
      log.warning("a peer was lost and there is no local tier to save from")
      return
    coord = manager.coordinator
    members = sorted(set(self._members()) - lost)
    group = groups.Survivors(coord, members)
    key = keys.child(manager.name, "rescue", '-'.join(map(str, members)))
    timeout_ms = int(min(TIMEOUT_SECS, manager.barrier_timeout_ms / 1000)
                     * 1000)
    step, latest = groups.common_newest(
        meetings.Meeting(group, key, timeout_ms),
        local.manager.all_steps(),
        manager.latest_step())
    if step is None or (latest is not None and latest >= step):
      log.warning("survivors %s: no local step newer than the persistent"
                  " tier's %s to save", members, latest)
      return
    found = shares.assigned(
        meetings.Meeting(group, key, timeout_ms), local.manager, step)
    if found is None:
      return
    leaves, extra, data_state = found
    primary = (manager.primary_host if manager.primary_host in members
               else members[0])
    tmp = atomicity_lib.temporary_path(manager.directory, step,
                                       manager.atomicity, manager.backend)
    stats, _ = commit_lib.commit(commit_lib.CommitInputs(
        coordinator=group, directory=manager.directory,
        backend=manager.backend, step=step, key=keys.child(key, "commit"),
        tmp=tmp, leaves=leaves, extra=extra, metrics=None,
        blocking_secs=0.0, is_primary=coord.process_index == primary,
        timeout_ms=timeout_ms, check_still_writer=manager.check_still_writer,
        writers=members, data_state=data_state,
        in_flight=deadlines.InFlight(manager.storage.io_timeout_secs,
                                     f"step {step} in {manager.directory}")))
    self.saved_step = step
    log.warning("survivors %s saved step %d from their local tiers to %s"
                " (%d bytes written here)", members, step,
                manager.directory, stats.process_bytes)


def _shutdown_jax() -> None:
  """Leaves JAX's coordination service now, while Python still runs.

  Calls that waited for the lost process when it died (a barrier of the
  save it broke waits out its whole timeout) are still inside JAX's client:
  leaving ends them with an error on their threads, where the interpreter's
  own teardown would abort the process (status 134).
  """
  try:
    import jax  # pylint: disable=g-import-not-at-top
    jax.distributed.shutdown()
  except Exception as e:  # pylint: disable=broad-except
    log.warning("leaving JAX's coordination service failed: %r", e)


def _leave(code: int) -> None:
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access
