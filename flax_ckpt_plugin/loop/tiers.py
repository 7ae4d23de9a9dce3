"""The tiers a callback saves to and restores from, opened together.

`Tiers` holds what `CheckpointCallback` saves through: the persistent
tier's `CheckpointManager`, this process's `LocalTier` (or None), and the
watch over the other processes (`elastic.Peers`, or None: one process, or
`FaultTolerance(watch_peers=False)`). The callback decides when to save
and which tier saves; the tiers open on every process at the same point,
restore the newest step from the fastest tier that has it whole
(`tier_restore`), go on after a lost process (`elastic`), and wait and close
together.

A process relaunched after a loss, which the survivors take back
(`FaultTolerance(elastic=True)`), opens its tiers by itself (it meets
nobody yet, and never claims the directory the survivors write to), then
waits for them in `restore`.

The local tier is `tolerance.local_tier`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, NamedTuple

from etils import epath
import jax

from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.manager.tier import TierManager
from flax_ckpt_plugin.manager.options import Processes
from flax_ckpt_plugin.manager.options import Storage
from flax_ckpt_plugin.manager.retention import Retention
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.multihost import groups
from flax_ckpt_plugin.restore.options import RestoreOptions
from flax_ckpt_plugin.tolerance import elastic as elastic_lib
from flax_ckpt_plugin.tolerance import exchange
from flax_ckpt_plugin.tolerance import generations
from flax_ckpt_plugin.tolerance import liveness
from flax_ckpt_plugin.tolerance import rescue
from flax_ckpt_plugin.tolerance import tier_restore
from flax_ckpt_plugin.tolerance.local_tier import LocalTier
from flax_ckpt_plugin.tolerance.options import FaultTolerance


def open_tier(directory: epath.PathLike, job: str, *,
              coordinator: coordinator_lib.Coordinator, timeout_ms: int,
              pinned_host_bytes: int | None = None) -> LocalTier | None:
  """Every process opens its local tier; None on all if any failed.

  All processes must take the same path through a restore (see
  `restore_newest`), so a tier that cannot open on one process (a path
  not writable there) is off everywhere, with an error in the log.
  """
  meeting = meetings.Meeting(
      coordinator,
      keys.fresh(coordinator, f"flax_ckpt_plugin/local/{job}/open"),
      timeout_ms)
  outcome = meetings.agree(meeting, lambda: LocalTier(
      TierManager.for_this_process(
          directory, job, coordinator=coordinator,
          pinned_host_bytes=pinned_host_bytes)))
  if not outcome.failures:
    return outcome.result
  if outcome.result is not None:
    outcome.result.manager.close()
  log.error("the local tier in %s is off: it failed to open on %s",
            directory, meetings.describe_failures(outcome.failures))
  return None


class Restored(NamedTuple):
  """A restored step, and where it came from."""
  state: Any
  step: int
  tier: str  # `tier_restore.LOCAL`, `PEER` or `PERSISTENT`.
  extra: Any  # The step's `extra`.
  regrouped: bool  # The processes met from now on changed (`elastic`).


class Tiers:
  """The persistent tier, the local tier and the peers' watch of one
  callback; made on every process at the same point.

  Args:
    directory: the persistent tier's directory.
    max_to_keep, retention, storage, processes: the persistent tier's
      manager's (`CheckpointManager`; the callback adds its hooks).
    tolerance: the local tier and the peers' watch (`FaultTolerance`).
    exit_code: the exit code of survivors that save for a relaunch.
    metric_writer: where the primary writes a recovery's figures.
  """

  def __init__(self, directory: epath.PathLike, *, max_to_keep: int | None,
               retention: Retention | None, storage: Storage | None,
               processes: Processes | None, tolerance: FaultTolerance,
               exit_code: int, metric_writer: Any = None):
    storage, processes = storage or Storage(), processes or Processes()
    coord = processes.coordinator or coordinator_lib.default()
    watch_peers = tolerance.watch_peers
    if watch_peers is None:
      watch_peers = liveness.recoverability_enabled()
    watch_peers = watch_peers and coord.process_count > 1
    elastic = tolerance.elastic
    job = generations.job_name(os.fspath(directory))
    rejoins = generations.joining(coord, generations.group_key(job)) if (
        elastic and watch_peers) else None
    if rejoins is not None:
      coord = groups.Survivors(coord, [coord.process_index])
    self.manager = TierManager(
        directory, max_to_keep=max_to_keep, retention=retention,
        storage=storage, processes=dataclasses.replace(
            processes, coordinator=coord,
            primary_host=processes.primary_host if rejoins is None
            else rejoins.opening_primary(coord.process_index)))
    self.local = None if tolerance.local_directory is None else open_tier(
        tolerance.local_directory, job, coordinator=coord,
        timeout_ms=self.manager.barrier_timeout_ms,
        pinned_host_bytes=storage.pinned_host_bytes)
    # The partner copies (see `exchange`), their failure domains shared.
    self.exchange = None
    if tolerance.replicas and self.local is not None and (
        coord.process_count > 1):
      self.exchange = exchange.Exchange(exchange.share_domains(
          coord, job, tolerance.failure_domain,
          self.manager.barrier_timeout_ms), tolerance.replicas)
    # Started here, on every process at the same point: see `liveness`.
    self.peers = elastic_lib.Peers(
        self.manager, self.local, directory,
        poll_secs=tolerance.watch_poll_secs, exit_code=exit_code,
        elastic_secs=tolerance.elastic_wait_secs if elastic else None,
        primary_host=processes.primary_host, group=rejoins,
        watch=rescue.watch, partners=bool(tolerance.replicas)
    ) if watch_peers else None
    self._metric_writer = metric_writer
    self._warmed_up = False  # See `warm_up`.
    # The step at which the group takes back a relaunched process (saved
    # to the local tier first; see `check_rebuild`).
    self.rebuild_at: int | None = None

  def quietly(self, what: str, fn: Callable[[TierManager], Any]
              ) -> None:
    """`fn` on the local tier's manager, if there is one (see
    `LocalTier.quietly`)."""
    if self.local is not None:
      self.local.quietly(what, fn)

  def save_local(self, step: int, state: Any, **kwargs: Any) -> None:
    """Starts saving `state` as `step` to the local tier, with the partner
    copies of its shards that this process receives (`exchange`), sent
    once its own copies have started. Every process takes part in the
    exchange (a collective), whatever its local tier does: if the save
    fails before it sends, the copies go anyway and are dropped. `kwargs`:
    as for `CheckpointManager.save`."""
    sent = []

    def send() -> dict[str, list[Any]]:
      sent.append(step)
      try:
        return self.exchange.send(state)
      except Exception as e:  # pylint: disable=broad-except
        # The same program everywhere: it fails alike on every process.
        log.error("the partner copies of step %d were not sent (the local"
                  " step goes without them): %r", step, e)
        return {}

    exchange = None if self.exchange is None else send
    self.quietly("save", lambda m: m.save(step, state,
                                          partner_shards=exchange, **kwargs))
    if exchange is not None and not sent:
      send()

  def warm_up(self, state: Any) -> None:
    """Once: sets up what saving `state` needs in each tier
    (`CheckpointManager.warm_up`: pinned host memory on accelerators; the
    partner copies' programs), unless `state` is abstract."""
    if self._warmed_up:
      return
    self._warmed_up = self.manager.warm_up(state)
    self.quietly("warm-up", lambda m: m.warm_up(state))
    if self.exchange is not None:  # Compiles: no collective.
      try:
        self.exchange.prepare(state)
      except Exception as e:  # pylint: disable=broad-except
        log.info("the partner copies' programs were not prepared (the"
                 " first local save compiles them): %r", e)

  def check(self) -> None:
    """Raises `PeerLostError` once a peer was lost."""
    if self.peers is not None:
      self.peers.check()

  def raise_instead(self, error: Exception) -> None:
    """Raises `PeerLostError` instead of `error` once a peer was lost."""
    if self.peers is not None:
      self.peers.raise_instead(error)

  def check_rebuild(self, step: int, state: Any) -> None:
    """Survivors, at every call of the callback: sets `rebuild_at` to
    `step` when the group takes processes back there
    (`elastic.Peers.rebuild_due`)."""
    if self.peers is not None and self.peers.rebuild_due(step, state):
      self.rebuild_at = step

  def restore(self, state: Any, options: RestoreOptions, *,
              make_target: Callable[[list[Any]], Any] | None,
              data_iterator: datastate.DataIterator | None) -> Restored | None:
    """The newest good step like `state`, from the fastest tier that has
    it whole (`tier_restore.restore_for_callback`), or None; a relaunched
    process instead waits until the survivors take it back (see
    `CheckpointCallback.restore_or_initialize`). Then starts pinning the
    saves' host memory (`warm_up`), after the restore, which it would
    otherwise compete with."""
    if self.peers is not None:
      self.peers.first_state(state)
    if self.peers is not None and self.peers.rejoining:
      found = self._announced(self.peers.rejoin(make_target, state,
                                                data_iterator),
                              tier_restore.PEER)
    else:
      found = tier_restore.restore_for_callback(
          state, self.local, self.manager, data_iterator=data_iterator,
          options=options, partners=self.exchange is not None)
      if found is None:
        log.info("no checkpoint in %s; starting from the given state",
                 self.manager.directory)
        self.warm_up(state)
        return None
      step, tier, (restored, extra) = found
      # A warning, so that a plain script shows it: a resume should never
      # go unnoticed. In words a user knows (no tiers).
      where = {"persistent": f"the newest complete checkpoint in"
                             f" {self.manager.directory}",
               "local": "this host's fast local copy (newer than any in"
                        f" {self.manager.directory})",
               "peer": "the other processes' fast local copies (newer than"
                       f" any in {self.manager.directory})"}.get(tier, tier)
      (log.warning if self.manager.is_primary else log.info)(
          "resumed: restored step %d, %s", step, where)
      found = Restored(restored, step, tier, extra, regrouped=False)
    self.warm_up(found.state)
    return found

  def recover(self, make_target: Callable[[list[Any]], Any],
              data_iterator: datastate.DataIterator | None
              ) -> Restored:
    """After a loss, from the loop's handler of its error: the newest local
    step that every survivor holds, on the live devices (see
    `CheckpointCallback.recover`)."""
    if self.peers is None:
      error = caught_error()
      error.add_note("recover() needs a callback made with tolerance="
                     "FaultTolerance(elastic=True, local_directory=...) and"
                     " several processes")
      raise error
    return self._announced(self.peers.recover(make_target, caught_error(),
                                              data_iterator),
                           tier_restore.LOCAL)

  def rejoin(self, make_target: Callable[[list[Any]], Any]
             ) -> Restored | None:
    """Once the survivors agreed to take processes back: the step just
    saved, on the devices of every process; None if that failed (logged:
    go on with `peers.kept`)."""
    done = self.peers.rejoin(make_target, None, None)
    return None if done is None else self._announced(done, tier_restore.LOCAL)

  def _announced(self, done: elastic_lib.Recovered, tier: str) -> Restored:
    """The log line of a recovery or a rejoin, and its figures (written by
    the primary)."""
    devices = sum(d.process_index in done.members for d in jax.devices())
    if done.joined:
      log.warning("process(es) %s rejoined at step %d in %.2fs: processes"
                  " %s (%d devices)", done.joined, done.step, done.secs,
                  done.members, devices)
    else:
      log.warning("lost process(es) %s; recovered in place at step %d in"
                  " %.2fs on processes %s (%d devices)", sorted(done.lost),
                  done.step, done.secs, done.members, devices)
    if self._metric_writer is not None and self.manager.is_primary:
      self._metric_writer.write_scalars(done.step, {
          ("elastic/rejoin_secs" if done.joined
           else "elastic/recover_secs"): done.secs,
          "elastic/live_processes": len(done.members)})
    return Restored(done.state, done.step, tier, done.extra, regrouped=True)

  def wait_until_finished(self, *, deletes: bool = True) -> None:
    """Blocks until each tier's running save is durable (and, with
    `deletes`, retention's deletes are done); raises its error
    (`PeerLostError` instead, once a peer was lost)."""
    try:
      self.manager.wait_until_finished(deletes=deletes)
      self.quietly("save", lambda m: m.wait_until_finished(deletes=deletes))
    except Exception as e:
      self.raise_instead(e)
      raise

  def close(self, *, leaving: bool = False) -> None:
    """Waits for each tier's running save and closes it, then stops
    watching the peers; raises the save's error, or `PeerLostError`.
    `leaving`: see `CheckpointManager.close`."""
    try:
      try:
        self.manager.close(leaving=leaving)
      finally:
        self.quietly("save", lambda m: m.close(leaving=leaving))
    except Exception as e:
      self.raise_instead(e)
      raise
    finally:
      if self.peers is not None:
        self.peers.close()
    self.check()

  def exit(self, exc_type, exc, tb) -> None:
    """Closes the tiers as the loop leaves with `exc`. The watcher goes on:
    the error may be a collective's with a peer that is dying, which the
    exit hook then learns (see `rescue`)."""
    self.manager.__exit__(exc_type, exc, tb)
    self.quietly("save", lambda m: m.close(leaving=True))


def caught_error() -> BaseException:
  """The exception being handled (`recover` is called from a handler)."""
  error = sys.exc_info()[1]
  if error is None:
    raise RuntimeError("recover() is called from the loop's `except` block"
                       " for PeerLostError or the runtime's error, or when"
                       " should_rebuild is set")
  return error
