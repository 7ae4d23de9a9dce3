"""The control plane at many processes, by simulation: what the library asks
of the coordination service per save, and of its liveness watchers.

    python benchmarks/control_plane.py --processes 16 64 256 --latency-ms 0 1

N simulated processes run as threads of this one: each makes a real
`CheckpointManager` (its commit protocol, its barriers and key-value
records, on a directory in memory) over a `SimCoordinator` of an in-memory
coordination service (`Service`: JAX's operations, barriers over subsets,
key-value set/get/dir/delete and live processes with incarnations) that no
simulated process hosts, as `flax-ckpt coordinator` runs it (so `--lost 0`
can stop process 0 like any other), which
counts every call, its caller and its key-value bytes, and can answer each
call after a latency. No arrays move between devices: each process saves a
small host state, so only the protocol runs. `--watchers` runs N liveness
watchers (`liveness.Watcher`) instead and measures their calls per second;
then (`--faults`) one process stops answering, or restarts and asks to
rejoin as a relaunched process of an elastic job does, or every process
closes its watcher as at a job's end, and it measures the time until every
survivor knows, and what the service was asked. `--write-plan`
times one process's write plan (`division.plan`: who writes which bytes)
for `--leaves` arrays of a transformer-like state on a (data, model) mesh of
N processes x 8 devices, whose devices stand in for JAX's (`MeshSharding`).
`--shares` runs the survivors' choice, for their save after a loss, of who
writes which shard of their newest local step (`shares.assigned`), and
`--elastic` runs the survivors' agreements of an elastic job instead: the
newest local step they all hold (`groups.common_newest`, at a recovery) and
the vote on the step that takes a relaunched process back
(`generations.vote`, called at every step until it is agreed).

Prints one row per run (per save: operations in total and per process, the
largest fan-in of one barrier or key, the key-value bytes, the wall time)
and, with --json, writes them all.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.manager.options import Processes
from flax_ckpt_plugin.manager.options import Storage
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.multihost import groups
from flax_ckpt_plugin.arrays import division
from flax_ckpt_plugin.tolerance import generations
from flax_ckpt_plugin.tolerance import liveness

# The tests' helpers (`received_bytes`: the bytes each process receives).
TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "tests")


class _Barrier:
  """One passage of a barrier key: who must come, who came (counted as
  they come: comparing the sets at each arrival would make the
  simulation, not the protocol, O(N^2) per barrier)."""

  def __init__(self, members: frozenset[int]):
    self.members = members
    self.arrived: set[int] = set()
    self.expected = len(members)
    self.passed = threading.Event()

  def arrive(self, me: int) -> bool:
    """Counts `me` in; whether everyone came."""
    if me in self.members and me not in self.arrived:
      self.expected -= 1
    self.arrived.add(me)
    return self.expected == 0


def _directories(key: str) -> list[str]:
  """Every directory that `key` is under ("a/b/c": "a", "a/b")."""
  parts = key.split("/")
  return ["/".join(parts[:i]) for i in range(1, len(parts))]


class Service:
  """An in-memory coordination service that counts what it is asked.

  Args:
    process_count: the processes of the job.
    latency_secs: how long each call takes before it is answered.
  """

  def __init__(self, process_count: int, latency_secs: float = 0.0):
    self.process_count = process_count
    self.latency_secs = latency_secs
    self._lock = threading.Lock()
    self._kv: dict[str, str] = {}
    # Every key under each of its directories, so that listing one costs
    # what it holds, not every key (the service's own index does the same).
    self._under: collections.defaultdict[str, set[str]] = (
        collections.defaultdict(set))
    self._set_events: dict[str, threading.Event] = {}
    self._barriers: dict[str, _Barrier] = {}
    self.incarnations = list(range(process_count))
    self.dead: set[int] = set()
    self.counting = True
    self.reset()

  def reset(self) -> None:
    """Starts the counts anew."""
    with self._lock:
      self.ops: collections.Counter = collections.Counter()
      self.by_process: collections.Counter = collections.Counter()
      self.kv_bytes = 0
      # Per barrier key, the most that met in one passage; per key-value
      # key, how many reads it had.
      self.barrier_fan_in: collections.Counter = collections.Counter()
      self.reads: collections.Counter = collections.Counter()

  def _call(self, me: int, op: str, nbytes: int = 0) -> None:
    if self.latency_secs:
      time.sleep(self.latency_secs)
    if self.counting:
      with self._lock:
        self.ops[op] += 1
        self.by_process[me] += 1
        self.kv_bytes += nbytes

  def barrier(self, me: int, key: str, timeout_ms: int,
              process_ids: Sequence[int] | None) -> None:
    self._call(me, "barrier")
    members = frozenset(range(self.process_count) if process_ids is None
                        else process_ids)
    with self._lock:
      b = self._barriers.get(key)
      if b is None or b.passed.is_set():
        b = self._barriers[key] = _Barrier(members)
      if b.arrive(me):
        b.passed.set()
        self.barrier_fan_in[key] = max(self.barrier_fan_in[key],
                                       len(b.arrived))
    if not b.passed.wait(timeout_ms / 1000):
      raise TimeoutError(f"barrier {key!r} timed out after {timeout_ms} ms;"
                         f" missing {sorted(b.members - b.arrived)[:8]}")

  def kv_set(self, me: int, key: str, value: str) -> None:
    self._call(me, "kv_set", len(key) + len(value))
    with self._lock:
      if key not in self._kv:
        for d in _directories(key):
          self._under[d].add(key)
      self._kv[key] = value
      self._set_events.setdefault(key, threading.Event()).set()

  def kv_get(self, me: int, key: str, timeout_ms: int) -> str:
    with self._lock:
      event = self._set_events.setdefault(key, threading.Event())
    if not event.wait(timeout_ms / 1000):
      self._call(me, "kv_get")
      raise TimeoutError(f"key {key!r} not set within {timeout_ms} ms")
    with self._lock:
      value = self._kv[key]
      if self.counting:
        self.reads[key] += 1
    self._call(me, "kv_get", len(key) + len(value))
    return value

  def kv_dir(self, me: int, prefix: str) -> dict[str, str]:
    with self._lock:
      found = {k: self._kv[k] for k in self._under.get(prefix.rstrip("/"),
                                                        ())}
    self._call(me, "kv_dir", sum(len(k) + len(v) for k, v in found.items()))
    return found

  def kv_delete(self, me: int, key: str) -> None:
    self._call(me, "kv_delete")
    with self._lock:
      for k in [key] * (key in self._kv) + list(self._under.get(key, ())):
        del self._kv[k]
        self._set_events.pop(k, None)
        for d in _directories(k):
          self._under[d].discard(k)

  def live_processes(self, me: int, process_ids: Sequence[int] | None
                     ) -> dict[int, int]:
    self._call(me, "live_processes")
    ids = range(self.process_count) if process_ids is None else process_ids
    with self._lock:
      return {p: self.incarnations[p] for p in ids if p not in self.dead}

  def restart(self, p: int) -> "SimCoordinator":
    """Process `p` restarts: the service knows it by a new incarnation.
    Its new coordinator."""
    with self._lock:
      self.incarnations[p] += self.process_count
      self.dead.discard(p)
    return SimCoordinator(self, p)

  def coordinators(self) -> list["SimCoordinator"]:
    return [SimCoordinator(self, i) for i in range(self.process_count)]


class SimCoordinator:
  """One simulated process's view of a `Service`."""

  def __init__(self, service: Service, index: int):
    self.rounds = keys.Rounds()
    self.service, self._index = service, index

  @property
  def process_index(self) -> int:
    return self._index

  @property
  def process_count(self) -> int:
    return self.service.process_count

  def barrier(self, key: str, *, timeout_ms: int,
              process_ids: Sequence[int] | None = None) -> None:
    self.service.barrier(self._index, key, timeout_ms, process_ids)

  def kv_set(self, key: str, value: str) -> None:
    self.service.kv_set(self._index, key, value)

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    return self.service.kv_get(self._index, key, timeout_ms)

  def kv_dir(self, prefix: str) -> dict[str, str]:
    return self.service.kv_dir(self._index, prefix)

  def kv_delete(self, key: str) -> None:
    self.service.kv_delete(self._index, key)

  def live_processes(self, process_ids: Sequence[int] | None = None,
                     timeout_secs: float | None = None) -> dict[int, int]:
    del timeout_secs
    return self.service.live_processes(self._index, process_ids)

  def reached_preemption_sync_point(self, step: int) -> bool:
    del step
    return False

  def preemption_notifier_installed(self) -> bool:
    return False


def run_threads(coords: list[SimCoordinator],
                fn: Callable[[SimCoordinator], Any]) -> list[Any]:
  """`fn(coord)` on a thread per simulated process; their results, in
  process order; the first error raised again."""
  results: list[Any] = [None] * len(coords)
  errors: list[BaseException] = []

  def body(coord: SimCoordinator) -> None:
    try:
      results[coord.process_index] = fn(coord)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=body, args=(c,), daemon=True,
                              name=f"sim-{c.process_index}")
             for c in coords]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  return results


def _figures(service: Service, n: int, saves: int, secs: float) -> dict:
  per = [service.by_process[p] / saves for p in range(n)]
  return {
      "ops_per_save": sum(service.ops.values()) / saves,
      "ops_per_process_per_save_max": max(per),
      "ops_per_process_per_save_mean": sum(per) / n,
      "ops_by_kind_per_save": {k: v / saves for k, v in
                               sorted(service.ops.items())},
      "largest_barrier": max(service.barrier_fan_in.values(), default=0),
      "most_reads_of_one_key": max(service.reads.values(), default=0),
      "kv_bytes_per_save": service.kv_bytes / saves,
      "secs_per_save": secs / saves,
  }


def simulate_saves(n: int, *, saves: int = 3, latency_ms: float = 0.0,
                   directory: str | None = None) -> dict:
  """`saves` saves of N simulated processes, each through a real
  `CheckpointManager`; the figures per save, those of opening the
  directory apart (`opening`), and every process's list of steps."""
  service = Service(n, latency_ms / 1000)
  state = {"step": 0, "w": np.zeros(8, np.float32)}
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    opened = threading.Barrier(n)
    marks: dict[str, float] = {}
    opening: dict[str, Any] = {}  # What opening the directory asked.
    finalized: list[int] = []  # By the commit hooks (the primary's).

    def work(coord: SimCoordinator) -> list[int]:
      with CheckpointManager(
          tmp, max_to_keep=2, storage=Storage(backend=backend_lib.MEMORY),
          processes=Processes(coordinator=coord, barrier_timeout_secs=600,
                              name="sim"),
          hooks=[lambda stats: finalized.append(stats.step)]) as manager:
        if opened.wait() == 0:  # One thread starts the counts.
          opening.update(
              ops=sum(service.ops.values()),
              ops_per_process_max=max(service.by_process.values(),
                                      default=0),
              kv_bytes=service.kv_bytes,
              by_kind=dict(service.ops),
              most_reads_of_one_key=max(service.reads.values(), default=0))
          service.reset()
          marks["start"] = time.perf_counter()
        opened.wait()
        for step in range(1, saves + 1):
          manager.save(step, {**state, "step": step})
          manager.wait_until_finished()
        if opened.wait() == 0:
          marks["end"] = time.perf_counter()
          service.counting = False
        opened.wait()
        return manager.all_steps()

    steps = run_threads(service.coordinators(), work)
  figures = _figures(service, n, saves, marks["end"] - marks["start"])
  figures.update(processes=n, latency_ms=latency_ms, saves=saves,
                 opening=opening, finalized=finalized, steps=steps[0],
                 steps_agree=all(s == steps[0] for s in steps))
  return figures


def simulate_watchers(n: int, **kwargs: Any) -> dict:
  """See `_watch`; the N log lines of the loss are left out."""
  logger = logging.getLogger("flax_ckpt_plugin")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    return _watch(n, **kwargs)
  finally:
    logger.setLevel(level)


def _schedule(poll_secs: float, n: int) -> tuple[float, int]:
  """The watchers' period and reads (`liveness.schedule`; before it, a
  period and a read after every poll)."""
  if hasattr(liveness, "schedule"):
    return tuple(liveness.schedule(poll_secs, n))
  return liveness.period(poll_secs, n), 1  # pylint: disable=no-member


def _calls(service: Service, since: float) -> dict:
  """The watchers' calls a second since `since`, in all and by kind."""
  secs = time.perf_counter() - since
  return {"calls_per_sec": sum(service.ops.values()) / secs,
          "calls_per_sec_by_kind": {k: v / secs for k, v in
                                    sorted(service.ops.items())}}


def _until(done: Callable[[], bool], secs: float) -> float | None:
  """Seconds until `done()`, polled; None if not within `secs`."""
  start = time.perf_counter()
  while not done():
    if time.perf_counter() - start > secs:
      return None
    time.sleep(0.01)
  return time.perf_counter() - start


def _watch(n: int, *, poll_secs: float = 0.5,
           watch_secs: float | None = None, lost: int = 1,
           fault: str = "stop", latency_ms: float = 0.0) -> dict:
  """N liveness watchers polling for `watch_secs` (by default two periods
  and at least 3 s), as an elastic job's are (each watches every process;
  the job's group recorded); the calls a second of all of them. Then the
  `fault`:

  - "stop": process `lost` stops answering; the time until every survivor's
    watcher reported it;
  - "restart": process `lost` restarts (a new incarnation), and its new
    self does what a
    relaunched process of an elastic job does before the survivors take it
    back (`generations.joining`, `show_restart`; then, once the survivors
    recorded their group without it and watch it, `next_group_without` and
    its request to join): the time until every survivor reported the
    restart, then until every survivor's new watcher saw the request, the
    survivors' calls meanwhile, and the relaunched process's calls;
  - "close": every process closes its watcher at once, as at a job's end:
    the time until all stopped, the calls and key-value bytes of it, and
    how many stopped at the round recorded (not by `close`'s deadline).
  """
  every, read_every = _schedule(poll_secs, n)
  watch_secs = watch_secs or max(3.0, 2 * every)
  service = Service(n, latency_ms / 1000)
  coords = service.coordinators()
  knew: dict[int, float] = {}
  lock = threading.Lock()
  key = generations.group_key("sim")
  generations.record(coords[0], key, generations.Group(tuple(range(n)), 0, 0),
                     None)

  def on_lost_of(p: int) -> Callable[[dict[int, str]], None]:
    def on_lost(_: dict[int, str]) -> None:
      with lock:
        knew.setdefault(p, time.perf_counter())
    return on_lost

  watchers = [liveness.Watcher(c, "sim/watch", poll_secs=poll_secs,
                               on_lost=on_lost_of(c.process_index))
              for c in coords]
  run_threads(coords, lambda c: watchers[c.process_index].start())
  time.sleep(every * 2)  # Every watcher had its first answer.
  service.reset()
  t0 = time.perf_counter()
  time.sleep(watch_secs)
  row = {"processes": n, "poll_secs": poll_secs, "period_secs": every,
         "read_every": read_every, "fault": fault,
         "nominal_calls_per_sec": n * (1 + 1 / read_every) / every,
         **_calls(service, t0)}
  row["live_calls_per_sec"] = row["calls_per_sec_by_kind"].get(
      "live_processes", 0.0)
  survivors = [p for p in range(n) if p != lost]
  wait = 30 + 10 * every
  if fault == "close":
    service.reset()
    t = time.perf_counter()
    run_threads(coords, lambda c: watchers[c.process_index].close())
    row.update(secs_until_all_closed=time.perf_counter() - t,
               close_calls=sum(service.ops.values()),
               close_kv_bytes=service.kv_bytes,
               # Watchers whose polls ended at the recorded round (not
               # by `close`'s deadline).
               stopped_at_the_round=sum(
                   w.stopping is not None and w.rounds >= w.stopping
                   for w in watchers))
    return row
  # The process that stops or restarts calls no more (its watcher's thread
  # ends as the process does: it records nothing).
  watchers[lost]._stop.set()  # pylint: disable=protected-access
  watchers[lost]._thread.join(10)  # pylint: disable=protected-access
  before = service.by_process[lost]  # (Its calls as the process it was.)
  if fault == "stop":
    with service._lock:  # pylint: disable=protected-access
      service.dead.add(lost)
  else:
    relaunched = service.restart(lost)
    group = generations.joining(relaunched, key)
    threading.Thread(target=generations.show_restart, daemon=True, args=(
        relaunched, key, group, 1.0)).start()
  secs = _until(lambda: len(knew) == len(survivors), wait)
  for w in watchers:
    w.close()
  row.update(survivors=len(survivors),
             survivors_that_knew=sum(p in knew for p in survivors),
             secs_until_all_knew=secs)
  if fault == "restart" and secs is not None:
    row.update(_rejoin_asked(service, coords, relaunched, key, group,
                             survivors, poll_secs, wait,
                             service.by_process[lost] - before))
  return row


def _rejoin_asked(service: Service, coords: list[SimCoordinator],
                  relaunched: SimCoordinator, key: str,
                  group: generations.Group, survivors: list[int],
                  poll_secs: float, wait: float,
                  relaunched_calls: int) -> dict:
  """The survivors of a restart regroup without it (the first records the
  group, each starts a watcher of the survivors that reads requests to
  join) and the relaunched process asks to join: the time until every
  survivor's watcher saw the request, and the calls of it."""
  service.reset()
  t = time.perf_counter()
  regrouped = generations.Group(tuple(survivors), group.gen + 1, survivors[0])
  watch_key = generations.watch_key(key, regrouped.gen)
  watchers = [liveness.Watcher(coords[p], watch_key, poll_secs=poll_secs,
                               members=survivors, joins=True)
              for p in survivors]
  generations.record(coords[survivors[0]], key, regrouped, None)
  for w in watchers:
    w.start()

  def ask() -> None:
    joined = generations.next_group_without(
        meetings.Meeting(relaunched, key, 600_000), group)
    generations.ask_to_join(relaunched, key, joined)

  asking = threading.Thread(target=ask, daemon=True)
  asking.start()
  me = relaunched.process_index
  secs = _until(lambda: all(w.joining == {me} for w in watchers), wait)
  asking.join()
  calls = sum(service.ops.values()) - service.by_process[me]
  asked = service.by_process[me]
  for w in watchers:
    w.close()
  return {"secs_until_all_saw_the_request": secs,
          "rejoin_calls_per_survivor": calls / len(survivors),
          "relaunched_calls": relaunched_calls + asked}


def simulate_elastic(n: int, *, latency_ms: float = 0.0,
                     seed: int = 0) -> dict:
  """The N - 1 survivors of process N - 1 agree on their newest common
  local step (as a recovery does), then vote
  on the step that takes the lost one back: each survivor notices the
  request at a step of its own (0 to 3) and calls the vote at every step
  from then on, the steps kept in lockstep as a loop's collectives keep
  them (a barrier outside the service, not counted). Figures per survivor:
  the service's operations and key-value bytes of each agreement."""
  service = Service(n, latency_ms / 1000)
  coords = service.coordinators()
  members = list(range(n - 1))
  rng = np.random.default_rng(seed)
  noticed = {p: int(rng.integers(0, 4)) for p in members}
  steps_held = {p: sorted({3, 4, 5} | ({6} if p % 2 else set()))
                for p in members}
  group = generations.Group(tuple(members), 1, 0)
  lockstep = threading.Barrier(len(members))
  phases: dict[str, dict[str, float]] = {}

  def recover(coord: SimCoordinator) -> Any:
    survivors = groups.Survivors(coord, members)
    common = getattr(groups, "common_newest", None)
    if common is not None:
      return common(
          meetings.Meeting(survivors, "sim/1/recover", 600_000),
          steps_held[coord.process_index],
          None)
    from flax_ckpt_plugin.tolerance import rescue  # pylint: disable=g-import-not-at-top

    class _Tier:  # (Before groups.common_newest: the same, by the tiers.)
      class manager:  # pylint: disable=invalid-name
        all_steps = staticmethod(lambda: steps_held[coord.process_index])
      latest_step = staticmethod(lambda: None)
    return rescue.common_step(survivors, "sim/1/recover", _Tier, _Tier,
                              600_000)

  def vote(coord: SimCoordinator) -> Any:
    me, proposed = coord.process_index, False
    for step in range(8):
      lockstep.wait()
      if step < noticed[me]:
        continue
      propose = None if proposed else step + 2
      proposed = True
      agreed = generations.vote(coord, "sim/1/votes", group, step, propose,
                                [n - 1])
      if agreed is not None:
        result = agreed
        # The others go on to the agreed step too (no more calls).
        for _ in range(step + 1, 8):
          lockstep.wait()
        return result
    raise RuntimeError("no step agreed")

  for name, fn in (("common_step", recover), ("vote", vote)):
    service.reset()
    t = time.perf_counter()
    results = run_threads(coords[:n - 1], fn)
    secs = time.perf_counter() - t
    if len({json.dumps(r) for r in results}) != 1:
      raise AssertionError(f"{name}: the survivors disagree: {results[:4]}")
    per = [service.by_process[p] for p in members]
    phases[name] = {
        "result": results[0], "secs": secs,
        "ops": sum(service.ops.values()), "ops_per_process_max": max(per),
        "kv_bytes": service.kv_bytes,
        "kv_bytes_per_process": service.kv_bytes / len(members),
        "ops_by_kind": dict(service.ops)}
  return {"processes": n, "latency_ms": latency_ms, **phases}


def simulate_shares(n: int, *, leaves: int = 100,
                    directory: str | None = None) -> dict:
  """The survivors' save for a relaunch, its first part: the N - 1
  survivors of process N - 1 learn which shards of their newest local step
  each writes (`shares.assigned`, the lowest holder of each shard), from
  local steps of `leaves` arrays that every survivor holds whole (data
  parallelism). Each survivor's local tier is a copy (hard links) of one
  step written by a real local-tier manager. Figures: the service's
  operations and key-value bytes, per survivor and in all, and which
  survivors write anything."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin.tolerance import rescue  # pylint: disable=g-import-not-at-top
  try:
    from flax_ckpt_plugin.tolerance import shares  # pylint: disable=g-import-not-at-top
    assign = shares.assigned
  except ImportError:  # (Before `shares`: the same, in `rescue`.)
    assign = rescue._assigned  # pylint: disable=protected-access
  service = Service(n, 0.0)
  members = list(range(n - 1))
  state = {f"w{k:05d}": np.full((4, 4), k, np.float32)
           for k in range(leaves)}
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    first = os.path.join(tmp, "local", "0")
    with CheckpointManager(
        first, storage=Storage(backend=backend_lib.MEMORY),
        processes=Processes(coordinator=groups.SoloCoordinator(),
                            name="sim-local")) as manager:
      manager.save(7, state)
    for p in members[1:]:
      os.makedirs(os.path.join(tmp, "local", str(p)))
      subprocess.run(["cp", "-al", os.path.join(first, "7"),
                      os.path.join(tmp, "local", str(p), "7")], check=True)

    class Tier:  # What the survivors' save reads of a local tier's
      # manager (and, in older trees, of the tier).

      def __init__(self, p: int):
        self.directory = epath.Path(os.path.join(tmp, "local", str(p)))
        self.backend = backend_lib.MEMORY
        self.coordinator = groups.SoloCoordinator()
        self.manager = self

      def read_step(self, step: int, fn):  # Nothing held: the files.
        del step
        return fn(self.backend)

    def work(coord: SimCoordinator) -> list[int]:
      group = groups.Survivors(coord, members)
      found = assign(
          meetings.Meeting(group, "sim/rescue", 600_000),
          Tier(coord.process_index),
          7)
      assert found is not None, "the survivors found a shard missing"
      return sum(len(leaf.shards) for leaf in found[0])

    t = time.perf_counter()
    written = run_threads(service.coordinators()[:n - 1], work)
    secs = time.perf_counter() - t
  per = [service.by_process[p] for p in members]
  per_bytes = service.kv_bytes / len(members)
  return {"processes": n, "leaves": leaves, "secs": secs,
          "ops": sum(service.ops.values()), "ops_per_process_max": max(per),
          "ops_per_process_of_the_others": max(per[1:], default=0),
          "kv_bytes": service.kv_bytes, "kv_bytes_per_process": per_bytes,
          "writers": [p for p, w in zip(members, written) if w],
          "shards_written": sum(written)}


class FakeDevice:
  """A device of a simulated job: all the write plan reads of one."""
  __slots__ = ("id", "process_index")

  def __init__(self, id_: int, process_index: int):
    self.id, self.process_index = id_, process_index

  def __repr__(self):
    return f"FakeDevice({self.id}, process {self.process_index})"


class MeshSharding:
  """A stand-in for `jax.sharding.NamedSharding` over devices no JAX
  process can have: a mesh of `devices` (row-major over `axes`, a tuple of
  (name, size)) and a spec naming, per dimension of an array, the mesh axes
  it is cut along (None, a name or a tuple of names). Its
  `devices_indices_map` gives each device its slices as JAX does. Compared and hashed by identity (as cheap as
  JAX's cached hash)."""

  def __init__(self, devices: Sequence[FakeDevice],
               axes: tuple[tuple[str, int], ...], spec: tuple[Any, ...]):
    self.devices, self.axes, self.spec = tuple(devices), axes, spec
    self.device_set = frozenset(self.devices)
    self._maps: dict[tuple[int, ...], dict[Any, tuple[slice, ...]]] = {}
    self.cpu_secs = 0.0  # Spent listing indices (JAX's part, not the plan's).

  def devices_indices_map(self, shape: tuple[int, ...]
                          ) -> dict[Any, tuple[slice, ...]]:
    shape = tuple(shape)
    if len(self.spec) > len(shape):  # As JAX: a spec longer than the rank.
      raise ValueError(f"spec {self.spec} is longer than shape {shape}")
    if shape not in self._maps:
      t = time.process_time()
      sizes = dict(self.axes)
      out = {}
      for n, device in enumerate(self.devices):
        coord, rest = {}, n
        for name, size in reversed(self.axes):
          coord[name], rest = rest % size, rest // size
        index = []
        for dim, size in enumerate(shape):
          names = self.spec[dim] if dim < len(self.spec) else None
          names = (() if names is None else
                   (names,) if isinstance(names, str) else tuple(names))
          part, parts = 0, 1
          for name in names:
            part, parts = part * sizes[name] + coord[name], parts * sizes[name]
          step = -(-size // parts)  # (Uneven: the last ones short.)
          index.append(slice(min(part * step, size),
                             min((part + 1) * step, size)))
        out[device] = tuple(index)
      self._maps[shape] = out
      self.cpu_secs += time.process_time() - t
    return self._maps[shape]


def transformer_arrays(n: int, leaves: int, devices_per_process: int = 8,
                       model: int = 8) -> list[tuple[Any, tuple[int, ...],
                                                     np.dtype]]:
  """`leaves` arrays of a transformer-like state with Adam on a (data,
  model) mesh of `n` processes x `devices_per_process` devices, the model
  axis `model` devices wide (within a process when it is at most
  `devices_per_process`): kernels cut along both axes (FSDP with tensor
  parallelism), kernels cut along the model axis alone and replicated over
  data, biases cut along the model axis, norm scales and step counts
  replicated everywhere."""
  devices = [FakeDevice(i, i // devices_per_process)
             for i in range(n * devices_per_process)]
  data = n * devices_per_process // model
  axes = (("data", data), ("model", model))
  both = MeshSharding(devices, axes, ("data", "model"))
  tensor = MeshSharding(devices, axes, (None, "model"))
  vector = MeshSharding(devices, axes, ("model",))
  replicated = MeshSharding(devices, axes, ())
  f32 = np.dtype(np.float32)
  rows = data * 2  # Every kernel's first dimension divides by the data axis.
  layer = [(both, (rows, 4096), f32), (tensor, (4096, 1024), f32),
           (vector, (4096,), f32), (replicated, (4096,), f32),
           (replicated, (), np.dtype(np.int32))]
  return [layer[k % len(layer)] for k in range(leaves)]


def time_partners(n: int, *, replicas: int = 1, per_host: int = 1,
                  shards: int = 8) -> dict:
  """The partner plan (`tolerance.partners`) of N processes, `per_host` a
  host (the default failure domain), each holding `shards` shards of equal
  size that no other process holds (FSDP): the ring one process builds,
  the copies of every holder set (what the whole job plans; a process
  plans its own sets and its predecessors'), and how evenly the bytes
  received spread."""
  from flax_ckpt_plugin.tolerance import partners  # pylint: disable=g-import-not-at-top
  if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
  from helpers import received_bytes  # pylint: disable=g-import-not-at-top
  domains = [f"host{p // per_host}" for p in range(n)]
  t = time.process_time()
  ring = partners.Ring(domains)
  ring_secs = time.process_time() - t
  t = time.process_time()
  received = received_bytes(
      ring, [((p,), 1) for p in range(n) for _ in range(shards)], replicas)
  copies_secs = time.process_time() - t
  mean = sum(received) / n
  same_domain = sum(
      ring.domains[c.receiver] == ring.domains[p]
      for p in range(n) for c in ring.copies((p,), replicas))
  # The only coordination the copies add: the domains, shared once when
  # the tiers open (a save adds none: the plan follows from the shardings).
  open_ops = None
  try:
    from flax_ckpt_plugin.tolerance import exchange  # pylint: disable=g-import-not-at-top
    share = getattr(exchange, "share_domains", None)
  except ImportError:
    share = None
  if share is not None:
    service = Service(n, 0.0)
    shared = run_threads(service.coordinators(), lambda c: len(share(
        c, "sim", domains[c.process_index], 600_000)))
    assert shared == [n] * n, "a process missed another's domain"
    open_ops = max(service.by_process.values())
  return {"processes": n, "replicas": replicas, "per_host": per_host,
          "domains_ops_per_process_at_open": open_ops,
          "ring_cpu_secs": ring_secs, "copies_cpu_secs_all": copies_secs,
          "copies_cpu_secs_per_process": copies_secs / n,
          "received_max_over_mean": max(received) / mean,
          "received_min_over_mean": min(received) / mean,
          "copies_in_own_domain": same_domain}


def time_write_plan(n: int, leaves: int, process: int | None = None
                    ) -> dict:
  """One process's write plan for `transformer_arrays(n, leaves)`, timed
  from cold caches (as a job's first save), and the pieces it gets."""
  arrays = tuple(transformer_arrays(n, leaves))
  process = n // 2 if process is None else process
  for cache in (division.plan, getattr(division, "_held", None),
                getattr(division, "_grid", None)):
    if cache is not None:
      cache.cache_clear()
  t = time.process_time()
  planned = division.plan(arrays, process, n)
  secs = time.process_time() - t
  listing = sum(s.cpu_secs for s in {id(a[0]): a[0] for a in arrays}.values())
  return {"processes": n, "devices": n * 8, "leaves": leaves,
          "plan_cpu_secs": secs,
          # Of which the stand-in shardings' own listing of every device's
          # indices (JAX's part with real shardings).
          "indices_cpu_secs": listing,
          "pieces": sum(len(p) for p in planned),
          "bytes": int(sum(division._volume(p.index) * d.itemsize  # pylint: disable=protected-access
                           for pieces, (_, _, d) in zip(planned, arrays)
                           for p in pieces))}


class _MeshOf:
  """What a restore's read plan reads of a mesh (names, device array)."""

  def __init__(self, sharding: MeshSharding):
    self.axis_names = tuple(name for name, _ in sharding.axes)
    self.devices = np.empty([size for _, size in sharding.axes], object)
    for k, device in enumerate(sharding.devices):
      self.devices.flat[k] = device


def time_read_plan(n: int, leaves: int, process: int | None = None) -> dict:
  """One process's plan of a restore made together (`read_plan`: who reads
  which rows of the leaves several processes need) for
  `transformer_arrays(n, leaves)`, timed as a restore makes it: once per
  leaf, in order, with one load and, where the library has it, one memo.
  JAX's `replica_axes` is replaced by its arithmetic on the stand-ins."""
  from flax_ckpt_plugin.restore import read_plan  # pylint: disable=g-import-not-at-top
  del process  # Every process makes the same plan.
  arrays = transformer_arrays(n, leaves)
  meshes: dict[int, _MeshOf] = {}
  load: dict[Any, int] = {}
  statics: dict[Any, Any] = {}
  shared, whole = 0, {}  # Leaves shared; leaves read whole, per process.
  t = time.process_time()
  listing0 = sum(s.cpu_secs for s in {id(a[0]): a[0]
                                       for a in arrays}.values())
  for sharding, shape, dtype in arrays:
    if not shape:
      continue  # 0-d leaves are read by every process.
    if id(sharding) not in meshes:
      meshes[id(sharding)] = _MeshOf(sharding)
    mesh = meshes[id(sharding)]
    used = {a for e in sharding.spec for a in
            ((e,) if isinstance(e, str) else e or ())}
    spare = tuple(a for a in mesh.axis_names if a not in used)
    replicas = int(np.prod([size for name, size in sharding.axes
                            if name in spare]))
    key = (id(sharding), shape, dtype)
    if hasattr(read_plan, "_planned"):  # Once per kind of leaf.
      if key not in statics:
        statics[key] = _static_of(read_plan, sharding, mesh, spare, shape,
                                  dtype, replicas)
      plan = (None if statics[key] is None
              else read_plan._planned(statics[key], load))  # pylint: disable=protected-access
    else:  # A read_plan without `_planned`: every leaf looks at every device.
      plan = read_plan._gathered(  # pylint: disable=protected-access
          _by_region(sharding, shape), mesh, spare, shape, dtype, None,
          replicas, load)
    shared += plan is not None
    if plan is not None and len(plan.index) == plan.rows:  # Read whole:
      reader = next(iter(plan.parts)).process_index  # by one process.
      whole[reader] = whole.get(reader, 0) + 1
  secs = time.process_time() - t
  listing = sum(s.cpu_secs for s in {id(a[0]): a[0]
                                      for a in arrays}.values()) - listing0
  return {"processes": n, "devices": n * 8, "leaves": leaves,
          "plan_cpu_secs": secs, "indices_cpu_secs": listing,
          "shared_leaves": shared, "read_whole_by": whole}


def _by_region(sharding: MeshSharding, shape: tuple[int, ...]) -> dict:
  from flax_ckpt_plugin.format.treepaths import normalize_index  # pylint: disable=g-import-not-at-top
  out: dict = {}
  for device, index in sharding.devices_indices_map(shape).items():
    out.setdefault(normalize_index(index, shape), []).append(device)
  return out


def _static_of(read_plan, sharding, mesh, spare, shape, dtype, replicas):
  by_region = _by_region(sharding, shape)
  if all(len({d.process_index for d in ds}) < 2 for ds in by_region.values()):
    return None
  return read_plan._analyzed(by_region, mesh, spare, shape, dtype, None,  # pylint: disable=protected-access
                             replicas)


def _rounded(counts: dict[str, float]) -> dict[str, float]:
  return {k: round(v, 1) for k, v in counts.items()}


def _watch_line(row: dict, latency: float) -> str:
  line = (f"N={row['processes']:6d} latency={latency:5.1f} ms: a poll every"
          f" {row['period_secs']:.2f} s, a read after every"
          f" {row['read_every']}: {row['calls_per_sec']:7.1f} calls/s (nominal"
          f" {row['nominal_calls_per_sec']:.0f}; by kind"
          f" {_rounded(row['calls_per_sec_by_kind'])}); ")
  if row["fault"] == "close":
    return line + (f"all closed in {row['secs_until_all_closed']:.2f} s,"
                   f" {row['close_calls']} calls,"
                   f" {row['close_kv_bytes'] / 1e3:.1f} kB of key-value,"
                   f" {row['stopped_at_the_round']} stopped at the recorded"
                   " round")
  line += (f"{row['survivors_that_knew']}/{row['survivors']} survivors knew"
           f" of the {row['fault']} in {row['secs_until_all_knew']} s")
  if "secs_until_all_saw_the_request" in row:
    line += (f"; all saw its request to join in"
             f" {row['secs_until_all_saw_the_request']} s (the survivors"
             f" {row['rejoin_calls_per_survivor']:.1f} calls each meanwhile, the"
             f" relaunched process {row['relaunched_calls']} calls)")
  return line


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n", 1)[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, nargs="+",
                      default=[16, 64, 256])
  parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0])
  parser.add_argument("--saves", type=int, default=3)
  parser.add_argument("--watchers", action="store_true",
                      help="simulate the liveness watchers instead")
  parser.add_argument("--faults", nargs="+", default=["stop"],
                      choices=("stop", "restart", "close"),
                      help="with --watchers: what happens after the"
                      " steady polls (see _watch)")
  parser.add_argument("--lost", type=int, default=1,
                      help="with --watchers: the process that stops or"
                      " restarts (0 too: the service is a process of its"
                      " own, as with flax-ckpt coordinator)")
  parser.add_argument("--shares", action="store_true",
                      help="simulate the survivors' choice of who writes"
                      " what instead")
  parser.add_argument("--elastic", action="store_true",
                      help="simulate the survivors' agreements instead")
  parser.add_argument("--write-plan", action="store_true",
                      help="time one process's write plan instead")
  parser.add_argument("--read-plan", action="store_true",
                      help="time one process's plan of a restore made"
                      " together instead")
  parser.add_argument("--partners", action="store_true",
                      help="time the partner plan of the local tier instead")
  parser.add_argument("--replicas", type=int, default=1)
  parser.add_argument("--per-host", type=int, default=1)
  parser.add_argument("--leaves", type=int, default=100_000)
  parser.add_argument("--dir", default="/dev/shm" if os.path.isdir(
      "/dev/shm") else None, help="where the steps go (a tmpfs)")
  parser.add_argument("--json", default=None, help="write all figures here")
  args = parser.parse_args(argv)
  rows = []
  for n in args.processes:
    if args.partners:
      row = time_partners(n, replicas=args.replicas, per_host=args.per_host)
      print(f"N={n:6d} ({args.per_host} a host), replicas={args.replicas}:"
            f" the ring took {row['ring_cpu_secs']:.4f} s of CPU, the copies"
            f" of every holder set {row['copies_cpu_secs_all']:.3f} s"
            f" ({row['copies_cpu_secs_per_process'] * 1e6:.1f} us a"
            f" process); bytes received per process"
            f" {row['received_min_over_mean']:.3f}-"
            f"{row['received_max_over_mean']:.3f} x the mean;"
            f" {row['copies_in_own_domain']} copies in their sender's"
            " domain; the domains shared at open in"
            f" {row['domains_ops_per_process_at_open']} operations a"
            " process, none added to a save", flush=True)
      rows.append(row)
      continue
    if args.read_plan:
      row = time_read_plan(n, args.leaves)
      print(f"N={n:6d} ({row['devices']} devices), {args.leaves} leaves:"
            f" one process's read plan took {row['plan_cpu_secs']:.3f} s of"
            f" CPU (of which {row['indices_cpu_secs']:.3f} s listing every"
            f" device's indices); {row['shared_leaves']} leaves shared",
            flush=True)
      rows.append(row)
      continue
    if args.write_plan:
      row = time_write_plan(n, args.leaves)
      print(f"N={n:6d} ({row['devices']} devices), {args.leaves} leaves:"
            f" one process's write plan took {row['plan_cpu_secs']:.3f} s of"
            f" CPU (of which {row['indices_cpu_secs']:.3f} s listing every"
            f" device's indices); it writes {row['pieces']} pieces,"
            f" {row['bytes'] / 1e6:.1f} MB", flush=True)
      rows.append(row)
      continue
    if args.shares:
      row = simulate_shares(n, leaves=min(args.leaves, 10_000),
                            directory=args.dir)
      print(f"N={n:6d}, {row['leaves']} leaves: who writes what:"
            f" {row['ops']} ops, per survivor at most"
            f" {row['ops_per_process_max']} (the first), of the others"
            f" {row['ops_per_process_of_the_others']},"
            f" {row['kv_bytes'] / 1e6:.2f} MB of key-value"
            f" ({row['kv_bytes_per_process'] / 1e3:.2f} kB a survivor),"
            f" {row['secs']:.2f} s; {len(row['writers'])} writer(s),"
            f" {row['shards_written']} shards", flush=True)
      rows.append(row)
      continue
    for latency in args.latency_ms:
      if args.elastic:
        row = simulate_elastic(n, latency_ms=latency)
        for name in ("common_step", "vote"):
          f = row[name]
          print(f"N={n:6d} latency={latency:5.1f} ms: {name:11s}"
                f" {f['ops']:8d} ops, per survivor at most"
                f" {f['ops_per_process_max']:3d},"
                f" {f['kv_bytes'] / 1e3:10.1f} kB of key-value"
                f" ({f['kv_bytes_per_process'] / 1e3:7.2f} kB a survivor),"
                f" {f['secs']:6.2f} s; agreed {f['result']}", flush=True)
        rows.append(row)
        continue
      if args.watchers:
        for fault in args.faults:
          row = simulate_watchers(n, latency_ms=latency, fault=fault,
                                  lost=args.lost)
          print(_watch_line(row, latency), flush=True)
          rows.append(row)
        continue
      else:
        row = simulate_saves(n, saves=args.saves, latency_ms=latency,
                             directory=args.dir)
        print(f"N={n:6d} latency={latency:5.1f} ms: per save"
              f" {row['ops_per_save']:9.0f} ops"
              f" ({row['ops_per_save'] / n:5.1f} x N),"
              f" per process max {row['ops_per_process_per_save_max']:5.1f},"
              f" largest barrier {row['largest_barrier']},"
              f" most reads of one key {row['most_reads_of_one_key']},"
              f" {row['kv_bytes_per_save'] / 1e3:9.1f} kB of key-value,"
              f" {row['secs_per_save']:7.3f} s; by kind"
              f" {_rounded(row['ops_by_kind_per_save'])}; opening the"
              f" directory: {row['opening']['ops']} ops, per process at most"
              f" {row['opening']['ops_per_process_max']},"
              f" {row['opening']['kv_bytes'] / 1e3:.1f} kB", flush=True)
      rows.append(row)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
