"""Going on without a lost process, and taking its replacement back.

Without it, a lost process ends the job (`rescue`: the survivors save what
it cannot, then exit for a relaunch of every process). A callback made with
`FaultTolerance(elastic=True)` keeps a `Peers` that does better, in the same
processes.

**Recover in place.** The loop catches the loss (`PeerLostError`, or the
runtime's error of a collective with the dead process) and calls
`CheckpointCallback.recover(make_target)`; every survivor then:

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
the rescue (`rescue`) follows when the program exits: the survivors save
what they hold to the persistent tier and exit with `PREEMPTED_EXIT_CODE`.

**Rejoin.** The group records itself in the key-value store (`Group`: its
members, a generation that counts its changes, its primary). A process
relaunched with the same id finds that it is not a member: its callback
opens its tiers by itself (it meets nobody yet), starts no watcher, and its
`restore_or_initialize` asks to join and waits. The survivors' watcher
reads the request after a poll; at the next calls of the callback they
agree on a step (`generations.vote`), save it to their local tiers, and set
`should_rebuild`; the loop calls `recover(make_target)`, and then every
process, the newcomer too, restores that step from the survivors' local
tiers over JAX collectives (`peer`) onto a mesh of all the live devices in
a new order (`generations`: one that repeats no device list of a
collective with the dead process), regroups the persistent tier, and
starts a new watcher over all of them. The newcomer reads no
byte of the persistent tier; the survivors lose no step.

What the loop keeps: the devices of the lost process are gone from every
mesh; the loop rebuilds its jitted step for the new mesh (jit does so from
the restored state's shardings) and keeps its global batch by splitting it
over the live devices (see docs/fault_tolerance.md). Process 0 hosts JAX's
coordination service: when it dies, JAX ends every process and the job is
relaunched (the local tiers serve the restart).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from typing import Any, Callable, NamedTuple, TYPE_CHECKING

import jax

from flax_ckpt_plugin.multihost import groups
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.tolerance import generations
from flax_ckpt_plugin.tolerance import peer
from flax_ckpt_plugin.tolerance import rebuild
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.logs import log

if TYPE_CHECKING:
  from flax_ckpt_plugin.manager.tier import TierManager
  from flax_ckpt_plugin.tolerance import local_tier

# How long `recover` waits for the watcher to report a loss, when the loop's
# error (a runtime, timeout or connection error) came first: a collective
# with a dead peer can fail before the peer misses its heartbeats. One
# heartbeat timeout is enough; JAX's default is 100 s. Other errors are
# raised again at once.
SETTLE_SECS = 120.0


# How long a relaunched process waits for its one poll with the survivors.
RESTART_POLL_SECS = 30.0


class Recovered(NamedTuple):
  """What `Peers.recover` and `Peers.rejoin` give the callback."""
  state: Any
  step: int
  extra: Any  # The step's `extra`.
  members: list[int]  # The group from now on.
  lost: dict[int, str]  # Empty after a rejoin.
  joined: list[int]  # The processes that rejoined (empty after a loss).
  secs: float  # From the call to the restored state.


class Phase(enum.Enum):
  """Where a `Peers` stands on taking processes back into its group."""
  REJOINING = enum.auto()  # Relaunched: waits until the survivors take it.
  WATCHING = enum.auto()  # A member; it voted on no step to take any back.
  VOTED = enum.auto()  # It voted (`Standing.proposed`); not all did yet.
  AGREED = enum.auto()  # All voted: `Standing.agreed` says when and whom.
  REFUSED = enum.auto()  # A rejoin failed: none until the group changes.


@dataclasses.dataclass(frozen=True)
class Standing:
  """A `Peers`'s phase and what it knows in it, replaced as a whole.

  Attributes:
    phase: where it stands.
    proposed: this survivor's vote, the step it proposed (VOTED, AGREED).
    agreed: the step all agreed on, and the processes taken back at it
      (AGREED).
    kept: the survivors' state at the agreed step, what they go on with
      if the rejoin fails (AGREED, REFUSED).
  """
  phase: Phase
  proposed: int | None = None
  agreed: tuple[int, list[int]] | None = None
  kept: Any = None


class Peers:
  """A callback's watch over its peers, and what it does when one is lost
  or comes back; see the module doc. Made on every process at the same
  point (the callback's creation).

  Args:
    manager: the persistent tier.
    local: this process's local tier (None: nothing to recover from).
    directory: the persistent directory (names the group's keys).
    poll_secs: the watcher's period.
    exit_code: the survivors' status after a loss they do not recover from.
    elastic_secs: None: a loss ends the job (`rescue`); else how long the
      survivors wait for the loop's `recover` before they save and leave.
    primary_host: the primary the user asked for (kept when a member).
    group: the running group this process rejoins (`joining`), or None.
    watch: starts the watch over the members and the survivors' save
      (`rescue.watch`), again at each new group.
    partners: the local tiers hold partner copies (`exchange`): a
      recovery and a rejoin restore from what the processes hold together
      (`rebuild`), not each survivor from its own tier.
  """

  def __init__(self, manager: TierManager,
               local: local_tier.LocalTier | None, directory: Any, *,
               poll_secs: float, exit_code: int, elastic_secs: float | None,
               primary_host: int, group: generations.Group | None = None,
               watch: Callable[..., tuple[Any, Any]],
               partners: bool = False):
    self._manager, self._local = manager, local
    self._partners = partners
    self._key = generations.group_key(
        generations.job_name(os.fspath(directory)))
    self._poll_secs, self._exit_code = poll_secs, exit_code
    self._elastic_secs, self._primary_host = elastic_secs, primary_host
    self._start_watch = watch
    count = manager.coordinator.process_count
    self._standing = Standing(Phase.REJOINING if group is not None
                              else Phase.WATCHING)
    self.group = group or generations.Group(tuple(range(count)), 0,
                                            primary_host)
    self.watcher = self.rescue = None
    # The device lists of the job's first meshes (`first_state`), and those
    # of this group's generation, which its first member records.
    self._first_lists: dict[str, int | None] = {}
    self._lists: dict[str, int | None] | None = None
    if not self.rejoining:
      generations.mark_opened(self._key)
      self._watch()
      if elastic_secs is not None:
        self._record()
    elif manager.coordinator.process_index in group.members:
      generations.show_restart(manager.coordinator, self._key, self.group,
                               RESTART_POLL_SECS)

  @property
  def phase(self) -> Phase:
    """Where this process stands on taking processes back."""
    return self._standing.phase

  @property
  def rejoining(self) -> bool:
    """Whether this process was relaunched and is not yet taken back."""
    return self._standing.phase is Phase.REJOINING

  @property
  def kept(self) -> Any:
    """The survivors' state at the step agreed for a rejoin (None before)."""
    return self._standing.kept

  def _member_again(self) -> None:
    """A member of a new group (after a recovery or a rejoin): no vote,
    nothing agreed or refused in it yet."""
    self._standing = Standing(Phase.WATCHING)

  def _watch(self) -> None:
    members = list(self.group.members)
    degraded = len(members) < self._manager.coordinator.process_count
    elastic = self._elastic_secs is not None
    self.watcher, self.rescue = self._start_watch(
        self._manager, self._local, poll_secs=self._poll_secs,
        exit_code=self._exit_code, elastic_secs=self._elastic_secs,
        members=members, joins=degraded and elastic,
        key=(generations.watch_key(self._key, self.group.gen)
             if self.group.gen else None),
        lost_key=(keys.Generation(self._key, self.group.gen).lost
                  if elastic else None))

  def first_state(self, state: Any) -> None:
    """The state the job starts from (`restore_or_initialize`): no later
    generation reuses a device list of its meshes (see `generations`)."""
    if not (self.rejoining or self.group.gen or self._first_lists):
      self._first_lists = generations.record_first_lists(
          self._manager.coordinator, self._key, self.group, state,
          record=self._elastic_secs is not None)

  def _choose(self, group: groups.Survivors, gen: int,
              build: Callable[[list[Any]], Any]
              ) -> tuple[list[Any], Any]:
    """The devices of generation `gen` in the order its meshes take, and
    the target `build` makes on them (`generations.choose`)."""
    devices, target, self._lists = generations.choose(
        group, self._key, gen, build, self._first_lists)
    return devices, target

  def _agreed_target(self, group: groups.Survivors, gen: int,
                     build: Callable[[list[Any]], Any], key: str,
                     where: str) -> tuple[list[Any], Any]:
    """`_choose` on every member, agreed: raises on all if it failed on
    any."""
    outcome = meetings.agree(
        meetings.Meeting(group, keys.child(key, "target"),
                         self._manager.barrier_timeout_ms),
        lambda: self._choose(group, gen, build))
    if outcome.failures:
      raise RuntimeError(
          f"building the target on {where} failed:"
          f" {meetings.describe_failures(outcome.failures)}")
    return outcome.result

  def _record(self) -> None:
    generations.record(self._manager.coordinator, self._key, self.group,
                       self._lists)

  def check(self) -> None:
    """Raises `PeerLostError` once a peer was lost."""
    if self.watcher is not None:
      self.watcher.check()

  def raise_instead(self, error: Exception) -> None:
    if self.watcher is not None:
      self.watcher.raise_instead(error)

  def close(self) -> None:
    if self.watcher is not None:
      self.watcher.close()

  def _regroup(self, members: list[int], gen: int) -> groups.Survivors:
    """Every member: the persistent tier meets `members` from now on, under
    generation `gen`; the lowest member records the group."""
    manager = self._manager
    group = groups.Survivors(manager.coordinator, members)
    primary = (self._primary_host if self._primary_host in members
               else members[0])
    manager.regroup(group, manager.barrier_timeout_ms / 1000,
                    tag=f"g{gen}-{'-'.join(map(str, members))}",
                    primary_host=primary)
    self.group = generations.Group(tuple(members), gen, primary)
    self._record()
    return group

  def recover(self, make_target: Callable[[list[Any]], Any],
              error: BaseException, data_iterator: Any) -> Recovered:
    """Restores the newest local step on the live devices; see the module
    doc. Called by every survivor, from the loop's handler of `error`.

    Raises:
      `error`: no peer was lost, or the survivors cannot restore a step
        together (a note on it says why).
    """
    t0 = time.monotonic()
    watcher, rescue, local = self.watcher, self.rescue, self._local
    if watcher is None or local is None or self._elastic_secs is None:
      error.add_note("recover() needs a callback made with tolerance="
                     "FaultTolerance(elastic=True, local_directory=...) and"
                     " several processes")
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
      error.add_note("recover(): no process was lost; the error is the"
                     " loop's")
      raise error
    if not rescue.claim():
      error.add_note("recover(): too late, the survivors' save for a"
                     f" relaunch had started ({self._elastic_secs:.0f}s"
                     " after the loss)")
      raise error
    manager = self._manager
    members = sorted(set(watcher.members) - set(lost))
    gen = self.group.gen + 1
    group = groups.Survivors(manager.coordinator, members)
    timeout_ms = manager.barrier_timeout_ms
    key = keys.Generation(self._key, gen).recover

    def restore() -> Any:
      _, target = self._choose(group, gen, make_target)
      return (local.manager.restore(target, step,
                                    data_iterator=data_iterator),
              local.manager.metadata(step).extra)

    try:
      local.quietly("save", lambda m: m.wait_until_finished())
      step, _ = groups.common_newest(
          meetings.Meeting(group, key, timeout_ms),
          local.manager.all_steps(),
          manager.latest_step())
      if step is None:
        raise RuntimeError("the survivors hold no common step in their local"
                           f" tiers ({local.directory})")
      if self._partners:
        result = self._rebuild_from_partners(
            group, gen, make_target, step, members, data_iterator,
            keys.child(key, "rebuild"), lost)
      else:
        outcome = meetings.agree(
            meetings.Meeting(group, keys.child(key, "restore"), timeout_ms),
            restore)
        if outcome.failures:
          raise RuntimeError(
              f"restoring local step {step} on the live devices failed:"
              f" {meetings.describe_failures(outcome.failures)}")
        result = outcome.result
      self._regroup(members, gen)
      self._watch()
    except Exception as e:  # pylint: disable=broad-except
      rescue.give_up()
      error.add_note(f"recover() could not go on without {sorted(lost)}:"
                     f" {e}")
      raise error from (e if e is not error else None)
    rescue.recovered()
    self._member_again()
    state, extra = result
    return self._done(Recovered(state, step, extra, members, lost, [],
                                time.monotonic() - t0))

  def _rebuild_from_partners(self, group: groups.Survivors, gen: int,
                             make_target: Callable[[list[Any]], Any],
                             step: int, holders: list[int],
                             data_iterator: Any, key: str,
                             lost: dict[int, str]) -> tuple[Any, Any]:
    """Every member: local step `step` on the devices of generation `gen`,
    from what `holders` hold, own shards and partner copies (`rebuild`).
    Raises, naming the lost processes, when no copy of some shard is
    left (its holder and every partner of it lost)."""
    timeout_ms = self._manager.barrier_timeout_ms
    devices, target = self._agreed_target(group, gen, make_target, key,
                                          "the live devices")
    try:
      state, extra, data = rebuild.restore(
          meetings.Meeting(group, key, timeout_ms), step, holders,
          self._local.manager, target, devices=devices)
    except CheckpointNotFoundError as e:
      if lost:
        resume = self._manager.latest_step()
        e.add_note(
            f"processes {sorted(lost)} were lost together, and with them"
            f" every copy of some shard of local step {step} (each"
            " process and its partners: raise FaultTolerance.replicas to"
            " survive that many losses); the job resumes from "
            + (f"step {resume} of the persistent tier" if resume is not None
               else "its start: the persistent tier holds no step"))
      raise
    if data_iterator is not None and data is not None:
      data_iterator.set_state(datastate.decode(
          data.encoding, data.data, f"local step {step}'s data state"))
    return state, extra

  def _done(self, done: Recovered) -> Recovered:
    # Newer local steps belong to the timeline the loss ended: the loop
    # computes those steps anew, and saves them anew.
    self._local.discard_newer(done.step)
    return done

  def rebuild_due(self, step: int, state: Any) -> bool:
    """Survivors, at every call of the callback: whether the group takes
    back the processes that asked to join (see `liveness.Watcher.joining`)
    at this step. Every survivor answers True at the same step.

    Each survivor that saw a request votes for the step two after its
    own; the group rebuilds at the highest vote, once every survivor voted
    (`generations.vote`: the first member counts and records the result).
    A survivor reads the votes only after its step's computation finished,
    which needs every survivor to have started that step (its collectives
    meet them all): so the first member counts every vote at the latest
    one step after the last, every member reads the result by the step
    after that, the agreed step or earlier, and no survivor passes the
    agreed step unaware.
    """
    watcher, phase = self.watcher, self._standing.phase
    if (self._elastic_secs is None or watcher is None
        or phase not in (Phase.WATCHING, Phase.VOTED)
        or (phase is Phase.WATCHING and not watcher.joining)):
      return False
    jax.block_until_ready(state)
    propose = None
    if phase is Phase.WATCHING:
      propose = step + 2
      self._standing = Standing(Phase.VOTED, proposed=propose)
    agreed = generations.vote(
        self._manager.coordinator,
        keys.Generation(self._key, self.group.gen).votes,
        self.group, step, propose, watcher.joining)
    if agreed is None:
      return False
    self._standing = Standing(Phase.AGREED, self._standing.proposed, agreed,
                              kept=state)
    return True

  def rejoin(self, make_target: Callable[[list[Any]], Any] | None,
             target: Any, data_iterator: Any) -> Recovered | None:
    """Every process of the new group: the survivors once `rebuild_due`
    (from `recover`), and each newcomer (from `restore_or_initialize`,
    with the state it would start from as `target`). Returns the agreed
    step's state on a mesh of every member's devices; on a survivor, None
    if the state did not pass (on any process; logged): the survivors go
    on as they were (`kept`), watched as before, and take no process back
    until their group changes again.

    Raises:
      Exception: (a newcomer) the survivors did not take it back within
        the barrier timeout, or the state did not pass.
    """
    t0 = time.monotonic()
    manager, local = self._manager, self._local
    coord, me = manager.coordinator, manager.coordinator.process_index
    timeout_ms = manager.barrier_timeout_ms
    key = keys.Generation(self._key, self.group.gen).key
    if local is None:
      raise RuntimeError("rejoining needs a local tier"
                         " (FaultTolerance(local_directory=...))")
    if self.rejoining:  # Waits until the survivors went on without it.
      self.group = generations.next_group_without(
          meetings.Meeting(coord, self._key, timeout_ms), self.group)
      key = keys.Generation(self._key, self.group.gen).key
      asked = generations.ask_to_join(coord, self._key, self.group)
      step, survivors, members = generations.read_plan(
          meetings.Meeting(coord, key, timeout_ms), asked)
      if me not in members:
        raise RuntimeError(f"process {me}: the group of {survivors} took"
                           f" back {members} without this process")
    else:
      step, joined = self._standing.agreed
      survivors = list(self.group.members)
      members = sorted(set(survivors) | set(joined))
      if me == survivors[0]:
        generations.record_plan(coord, key, step, survivors, members)
    gen = self.group.gen + 1
    group = groups.Survivors(coord, members)
    build = make_target or (lambda devices: generations.on_devices(target,
                                                               devices))
    try:
      devices, built = self._agreed_target(group, gen, build, key,
                                           "the group's devices")
      if self._partners:
        state, extra, _ = rebuild.restore(
            meetings.Meeting(group, keys.child(key, "rebuild"), timeout_ms),
            step,
            survivors, local.manager, built, devices=devices)
      else:
        state, extra = peer.restore(
            meetings.Meeting(group, keys.child(key, "peer"), timeout_ms),
            step,
            survivors, local, built, devices=devices)
    except Exception as e:  # pylint: disable=broad-except
      if self.rejoining:
        coord.kv_delete(asked)
        raise
      self._standing = Standing(Phase.REFUSED, kept=self._standing.kept)
      log.error("taking back processes %s at step %d failed (%r); going on"
                " with processes %s", sorted(set(members) - set(survivors)),
                step, e, survivors)
      return None
    if self.rejoining:  # A step that every member holds locally.
      # Its own steps from `step` on were computed in another timeline
      # (before its loss, on other devices): never to be restored.
      local.discard_newer(step - 1)
      local.quietly("save", lambda m: m.save(step, state, extra=extra))
      if data_iterator is not None:
        log.warning("process %d rejoined without its data iterator's"
                    " state: it was lost with the process", me)
    if not self.rejoining:  # Every survivor is here: stop watching them.
      self.watcher.close()
      self.rescue.recovered()
    self._regroup(members, gen)
    self._watch()
    generations.mark_opened(self._key)
    self._member_again()
    return self._done(Recovered(state, step, extra, members, {},
                                sorted(set(members) - set(survivors)),
                                time.monotonic() - t0))
