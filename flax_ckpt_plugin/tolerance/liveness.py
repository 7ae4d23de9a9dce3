"""Which peers are alive: a watcher thread that notices a lost process.

With `jax.config.update("jax_enable_recoverability", True)` set before
`jax.distributed.initialize`, the coordination service keeps the survivors
of a dead process running, and answers `get_live_nodes` with the live
processes and an incarnation id for each (a new one when a process
restarts). `Watcher` asks it on a daemon thread of every process, every
`poll_secs`. A peer that is missing from the answer, or back with a new
incarnation, is lost: from then on `check` raises `PeerLostError` naming
it, and every coordination call of this process (the barriers and waits of
saves, restores and `close`) returns with that error at once instead of
waiting out its timeout for a process that will never come.

How fast: the service declares a process dead once it has missed
heartbeats for `heartbeat_timeout_seconds` (an argument of
`jax.distributed.initialize`, 100 s by default); the watcher learns of it
then, plus at most one poll. How often: every `poll_secs` (0.5 s), each
poll followed by one read of the watch's records (who closes, who asks to
join), but all the calls of a job's watchers stay under
`JOB_CALLS_PER_SEC` a second, so that the service hosted by process 0
answers as many at 4,096 processes as at 200: above 200 processes the
records are read after every second poll and the period grows with the
job (`schedule`: 7.68 s at 4,096, measured by
`benchmarks/control_plane.py`).

Two traps of `get_live_nodes`, measured with JAX 0.10: it is itself a
barrier over the live processes, with no timeout, so every process polls
with the same period from the same point of the program (the callback's
creation); until the first answer (every process polling) a poll that
times out is tried again, since processes reach that point at different
times, and after it a poll that times out is tried again too (a dead
peer is only declared dead after the heartbeat timeout, which may be
longer than a call's deadline); a poll that other processes stopped
answering (they closed) is abandoned, never waited for. And a process that ends normally looks
dead to the others once it is gone: before stopping its watcher, a process
records under the watcher's key, between two of its polls, the round
after which every watcher of the job stops (one key per round, not per
process: at a job's end every process closes, and each reading every
other's record would cost the service O(N^2)), and a peer missing once
that is recorded is not reported lost. Every process must use the same
`poll_secs` and watch the same processes (the rounds of reads follow from
them): `agree_on_settings` checks that when the watch starts.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, NamedTuple

from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.errors import PeerLostError
from flax_ckpt_plugin.logs import log


def recoverability_enabled() -> bool:
  """Whether JAX keeps survivors alive when a peer dies (and polls work)."""
  import jax  # pylint: disable=g-import-not-at-top
  return bool(getattr(jax.config, "jax_enable_recoverability", False))


# How long `Watcher.close` waits for the last poll of every process, on top
# of the polls until the round every watcher stops after.
CLOSE_SECS = 10.0
# The most calls a second of every watcher of a job together: their polls
# and their reads of the watch's records.
JOB_CALLS_PER_SEC = 800


class Schedule(NamedTuple):
  """When each watcher of a job calls the service: a poll every `period`
  seconds, and a read of the watch's records after every `read_every`th
  poll (the same on every process: the rounds of reads are the stops'
  rounds, see `Watcher.close`)."""
  period: float
  read_every: int

  def calls_per_sec(self, watched: int) -> float:
    """The calls a second of `watched` watchers together."""
    return watched * (1 + 1 / self.read_every) / self.period


def schedule(poll_secs: float, watched: int) -> Schedule:
  """The schedule of each of `watched` processes' watchers: a poll every
  `poll_secs` and a read after each, while all of them together call at
  most `JOB_CALLS_PER_SEC` times a second (200 processes at 0.5 s); above,
  a read after every second poll and the period that keeps the calls
  within it (7.68 s at 4,096 processes, 18.75 s at 10,000)."""
  if 2 * watched / JOB_CALLS_PER_SEC <= poll_secs:
    return Schedule(poll_secs, 1)
  return Schedule(max(poll_secs, 1.5 * watched / JOB_CALLS_PER_SEC), 2)


def join_record(key: str, process: int) -> str:
  """The key under which `process` asks to join the processes a watcher
  of key `key` watches (`Watcher(joins=True)`)."""
  return keys.of_process(keys.child(key, "join"), process)


class _Records(NamedTuple):
  """What a read of the watch's records found: the round after which every
  watcher stops (None: no process closes), and who asks to join."""
  stop: int | None
  joining: frozenset[int]


class Watcher:
  """Polls the live processes on a daemon thread; see the module doc.

  Args:
    coord: the processes' coordinator (`Coordinator.live_processes`).
    key: a key-value prefix unique to this watch (the same on every
      process), under which its records go: the round after which every
      watcher stops (see `close`), and who asks to join (`joins`).
    poll_secs: the period of the polls (longer in a large job: `schedule`).
    on_lost: called on the watcher's thread with the lost processes, once
      they are reported (see `rescue`).
    members: the processes watched (all by default; the survivors of an
      earlier loss, see `elastic`).
    joins: with survivors: a replacement process says that it wants to
      join under `join_record(key, process)` (see `elastic`), read with
      the watch's other records.
    lost_key: set to the lost processes once they are reported (for a
      replacement process, see `elastic`).
  """

  def __init__(self, coord: coordinator_lib.Coordinator, key: str, *,
               poll_secs: float = 0.5,
               on_lost: Callable[[dict[int, str]], None] | None = None,
               members: Any = None, joins: bool = False,
               lost_key: str | None = None):
    self._coord = coord
    self._lost_key = lost_key
    self._joins = joins
    self._joining: frozenset[int] = frozenset()
    self.members = sorted(range(coord.process_count) if members is None
                          else members)
    self._on_lost = on_lost
    self.rounds = 0  # Polls answered so far.
    # The round after which every watcher stops, once read (see `close`).
    self.stopping: int | None = None
    self._key = key
    self.schedule = schedule(poll_secs, len(self.members))
    self._stop = threading.Event()
    self._closing = threading.Event()  # `close` was called.
    self._lock = threading.Lock()
    self._lost: dict[int, str] = {}
    self.lost_at: float | None = None  # time.monotonic() when noticed.
    self._thread = threading.Thread(target=self._run, daemon=True,
                                    name="flax_ckpt_plugin-liveness")

  def start(self) -> "Watcher":
    self._thread.start()
    return self

  @property
  def lost(self) -> dict[int, str]:
    """The lost processes and how each was lost (empty while all live)."""
    with self._lock:
      return dict(self._lost)

  def error(self) -> PeerLostError | None:
    lost = self.lost
    if not lost:
      return None
    return PeerLostError(lost, self._coord.process_index,
                         self._coord.process_count)

  @property
  def joining(self) -> frozenset[int]:
    """The processes that asked to join the watched ones (see `joins`)."""
    with self._lock:
      return self._joining

  @property
  def closed(self) -> bool:
    return self._stop.is_set()

  @property
  def watching(self) -> bool:
    """Whether it still polls (not closed, and its thread runs)."""
    return not self.closed and self._thread.is_alive()

  def settle(self, timeout: float) -> bool:
    """Waits until a peer is lost, the watch ends, or two polls that began
    after this call found everyone alive; True if a peer was lost.

    A poll waits while a peer is gone but not yet declared dead (it is a
    barrier over the live processes), so a process that ends because of a
    peer's death (a failed collective) learns of it here.
    """
    end, start = time.monotonic() + timeout, self.rounds
    while (not self.lost and not self.closed and self._thread.is_alive()
           and self.rounds < start + 2 and time.monotonic() < end):
      time.sleep(0.05)
    return bool(self.lost)

  def check(self) -> None:
    """Raises `PeerLostError` once a peer was lost."""
    error = self.error()
    if error is not None:
      raise error

  def raise_instead(self, error: Exception) -> None:
    """Raises `PeerLostError` in place of `error` if a peer was lost: a
    wait that a lost peer ended fails with whatever error it got."""
    lost = self.error()
    if lost is not None and not isinstance(error, type(lost)):
      raise lost from error

  def close(self) -> None:
    """Stops polling, after the same poll as every other process.

    The watcher's thread records, before its next poll, the round after
    which every watcher stops (see `_run`), and `close` waits for its
    polls up to that round, and at most `CLOSE_SECS` beyond: a poll left
    waiting for a process that stopped polling would still be inside
    JAX's client when the process exits, which aborts it. From a recorded
    stop on, a peer missing from a poll is taken as one that closes, not
    reported lost (the watch ends within a few rounds). Unless a peer was
    lost, the coordinator's calls stop obeying `check`.
    """
    if self._stop.is_set():
      return
    every_secs, read_every = self.schedule
    if self._thread.is_alive() and self._thread is not threading.current_thread():
      self._closing.set()
      self._thread.join(CLOSE_SECS + (read_every + 2) * every_secs)
    elif self.stopping is None and not self.lost:
      # No thread to record it (not started, or closing from its own
      # callback): the round two after its last, as the peers may poll on.
      self._record_stop(-(-(self.rounds + 2) // read_every) * read_every)
    self._stop.set()
    set_abort: Any = getattr(self._coord, "abort_when", None)
    if set_abort is not None and not self.lost:
      set_abort(None, replacing=self.check)

  def _record_stop(self, stop: int) -> None:
    try:
      self._coord.kv_set(keys.child(self._key, "stop", stop), "")
    except Exception:  # pylint: disable=broad-except
      pass  # The peers may then report this process lost: harmless now.

  def _read(self, tries: int = 1) -> _Records | None:
    """The watch's records, in one read of the service, asked up to
    `tries` times; None if every read failed."""
    for i in range(tries):
      try:
        found = self._coord.kv_dir(self._key)
        break
      except Exception as e:  # pylint: disable=broad-except
        if i == tries - 1:
          log.warning("process %d: could not read the watch's records (%r)",
                      self._coord.process_index, e)
          return None
        time.sleep(0.1 * (i + 1))
    stops, joining = [], set()
    for k in found:
      kind, _, name = k[len(self._key) + 1:].partition("/")
      if kind == "stop":
        stops.append(int(name))
      elif kind == "join" and self._joins:
        joining.add(int(name))
    return _Records(min(stops, default=None), frozenset(joining))

  def _stop_read(self) -> int | None:
    records = self._read()
    return None if records is None else records.stop

  def _run(self) -> None:
    first: dict[int, int] | None = None
    me = self._coord.process_index
    everyone = set(self.members)
    read_every = self.schedule.read_every
    while not self._stop.is_set():
      if self._closing.is_set() and self.stopping is None:
        # Recorded between two polls: no process can finish the next poll
        # before this one starts it, so every process's read at the
        # first round of reads after it finds the record, and all stop
        # after that round; none starts a poll the others never join.
        self.stopping = -(-(self.rounds + 1) // read_every) * read_every
        self._record_stop(self.stopping)
      try:
        live = self._coord.live_processes(self.members)
      except PeerLostError:
        return
      except Exception:  # pylint: disable=broad-except
        if (self._stop.is_set() or self.stopping is not None
            or self._stop_read() is not None):
          return  # A peer closed and stopped polling: nothing to watch.
        # No answer within the call's deadline. Before the first answer,
        # every process has not started polling yet; after it, a peer is
        # gone but not yet declared dead (the poll waits for that, up to
        # JAX's heartbeat timeout, 100 s by default). Either way: ask again.
        # (Were the service itself gone, JAX would end this process.)
        continue
      if self._stop.is_set():
        return
      if first is None:
        first = dict(live)
      lost = {p: "is gone (it stopped sending heartbeats)"
              for p in everyone - set(live) - {me}}
      lost.update({p: "restarted (it has a new incarnation)"
                   for p, inc in live.items()
                   if p != me and p in first and inc != first[p]})
      if lost and self.stopping is None:
        self.stopping = self._stop_read()
      if lost and self.stopping is None:  # (Once one closes, all end.)
        self._report(lost)
        if self._on_lost is not None:
          self._on_lost(lost)
        return
      self.rounds += 1
      if self.rounds % read_every == 0:
        # A poll is a barrier, so every process counts the same rounds and
        # reads at the same ones; a read that fails is asked again, not
        # skipped (one process alone polling on would wait for nobody).
        records = self._read(tries=5)
        if records is not None:
          if records.stop is not None:
            self.stopping = min(records.stop, self.stopping or records.stop)
          with self._lock:
            self._joining = records.joining - everyone
      if self.stopping is not None and self.rounds >= self.stopping:
        return
      self._closing.wait(self.schedule.period)

  def _report(self, lost: dict[int, str]) -> None:
    with self._lock:
      self._lost.update(lost)
      self.lost_at = time.monotonic()
    log.error("%s", self.error())
    if self._lost_key is not None:
      try:
        self._coord.kv_set(self._lost_key, json.dumps(sorted(lost)))
      except Exception:  # pylint: disable=broad-except
        pass  # Only a replacement process reads it, to learn it is late.


def watch(coord: coordinator_lib.Coordinator, name: str, *,
          poll_secs: float = 0.5,
          on_lost: Callable[[dict[int, str]], None] | None = None,
          members: Any = None, key: str | None = None, joins: bool = False,
          lost_key: str | None = None,
          settings_timeout_ms: int | None = None) -> Watcher:
  """A started watcher, which every coordination call of `coord` obeys.
  Its records go under `key` (by default, one of this process's rounds of
  `name`: a relaunched process that asks to join must know it). With
  `settings_timeout_ms`, the members first check that they watch alike
  (`agree_on_settings`, waiting that long for each other)."""
  # A round is taken with a `key` given too, so that this process's later
  # rounds of `name` do not hang on which of its watches were given one.
  round_key = keys.fresh(coord, f"flax_ckpt_plugin/liveness/{name}")
  key = key or round_key
  if settings_timeout_ms is not None:
    agree_on_settings(
        meetings.Meeting(coord, key, settings_timeout_ms),
        poll_secs=poll_secs,
        members=members)
  watcher = Watcher(coord, key, poll_secs=poll_secs, on_lost=on_lost,
                    members=members, joins=joins,
                    lost_key=lost_key).start()
  set_abort: Any = getattr(coord, "abort_when", None)
  if set_abort is not None:
    set_abort(watcher.check)
  return watcher


def agree_on_settings(meeting: meetings.Meeting, *, poll_secs: float,
                      members: Any) -> None:
  """Checks, on every member at the start of a watch of key `key`, that
  all of them watch with the same settings (`poll_secs` and the members:
  the rounds of polls and reads follow from them). The first member
  records its own, every other member compares (one read each), those
  that differ say so, and after a barrier of the members all of them know
  who differs (the processes' count of calls stays O(N)).

  Raises:
    ValueError: on every member, naming each process whose settings
      differ from the first member's, and both settings.
  """
  coord = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  members = sorted(range(coord.process_count) if members is None
                   else members)
  if len(members) < 2:
    return
  me, first = coord.process_index, members[0]
  mine = json.dumps({"poll_secs": float(poll_secs), "members": members})
  if me == first:
    coord.kv_set(keys.child(key, "settings"), mine)
    theirs = mine
  else:
    theirs = coord.kv_get(keys.child(key, "settings"), timeout_ms=timeout_ms)
  if mine != theirs:
    coord.kv_set(keys.of_process(keys.child(key, "settings_differ"), me),
                 mine)
  coord.barrier(keys.child(key, "settings"), timeout_ms=timeout_ms,
                process_ids=members)
  differ = coord.kv_dir(keys.child(key, "settings_differ"))
  if differ:
    def said(text: str) -> str:
      s = json.loads(text)
      return f"watch_poll_secs={s['poll_secs']:g} over processes {s['members']}"
    raise ValueError(
        "FaultTolerance.watch_poll_secs and the processes watched must be the"
        " same on every process (the watchers' rounds follow from them):"
        f" process {first} has {said(theirs)}, but "
        + "; ".join(f"process {p} has {said(v)}"
                    for p, v in sorted(keys.by_index(differ).items())))


def outlive(coord: coordinator_lib.Coordinator, members: Any,
            timeout_secs: float) -> None:
  """Process 0, at its exit: waits (at most `timeout_secs`) until every
  other member has left the coordination service, which process 0 hosts.

  With recoverability on, JAX's shutdown does not wait for the other
  processes, and one still shutting down when process 0 is gone is
  aborted (status -6). A poll of the live processes among (0, p) is a
  barrier over the live ones, so it returns once p is gone.
  """
  me = coord.process_index
  end = time.monotonic() + timeout_secs
  for p in members:
    while p != me and time.monotonic() < end:
      try:
        if p not in coord.live_processes([me, p], timeout_secs=2.0):
          break
      except Exception:  # pylint: disable=broad-except
        pass  # Still there: ask again.
  if time.monotonic() >= end:
    log.warning("process %d leaves before the others did (%.0fs)", me,
                timeout_secs)
