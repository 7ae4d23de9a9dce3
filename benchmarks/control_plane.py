"""The control plane at many processes, by simulation: what the library asks
of the coordination service per save, and of its liveness watchers.

    python benchmarks/control_plane.py --processes 16 64 256 --latency-ms 0 1

N simulated processes run as threads of this one: each makes a real
`CheckpointManager` (its commit protocol, its barriers and key-value
records, on a directory in memory) over a `SimCoordinator` of an in-memory
coordination service (`Service`: JAX's operations, barriers over subsets,
key-value set/get/dir/delete and live processes with incarnations), which
counts every call, its caller and its key-value bytes, and can answer each
call after a latency. No arrays move between devices: each process saves a
small host state, so only the protocol runs. `--watchers` runs N liveness
watchers (`liveness.Watcher`) instead, stops one process, and measures the
calls per second and the time until every survivor knows.

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
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.backends import backend as backend_lib
from flax_ckpt_plugin.manager.options import Commit
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.tolerance import liveness


class _Barrier:
  """One passage of a barrier key: who must come, who came."""

  def __init__(self, members: frozenset[int]):
    self.members = members
    self.arrived: set[int] = set()
    self.passed = threading.Event()


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
      b.arrived.add(me)
      if b.arrived >= b.members:
        b.passed.set()
        self.barrier_fan_in[key] = max(self.barrier_fan_in[key],
                                       len(b.arrived))
    if not b.passed.wait(timeout_ms / 1000):
      raise TimeoutError(f"barrier {key!r} timed out after {timeout_ms} ms;"
                         f" missing {sorted(b.members - b.arrived)[:8]}")

  def kv_set(self, me: int, key: str, value: str) -> None:
    self._call(me, "kv_set", len(key) + len(value))
    with self._lock:
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
    start = prefix.rstrip("/") + "/"
    with self._lock:
      found = {k: v for k, v in self._kv.items() if k.startswith(start)}
    self._call(me, "kv_dir", sum(len(k) + len(v) for k, v in found.items()))
    return found

  def kv_delete(self, me: int, key: str) -> None:
    self._call(me, "kv_delete")
    with self._lock:
      for k in [k for k in self._kv if k == key or k.startswith(key + "/")]:
        del self._kv[k]
        self._set_events.pop(k, None)

  def live_processes(self, me: int, process_ids: Sequence[int] | None
                     ) -> dict[int, int]:
    self._call(me, "live_processes")
    ids = range(self.process_count) if process_ids is None else process_ids
    with self._lock:
      return {p: self.incarnations[p] for p in ids if p not in self.dead}

  def coordinators(self) -> list["SimCoordinator"]:
    return [SimCoordinator(self, i) for i in range(self.process_count)]


class SimCoordinator(coordinator_lib.Rounds):
  """One simulated process's view of a `Service`."""

  def __init__(self, service: Service, index: int):
    super().__init__()
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
  `CheckpointManager`; the figures per save (the opening of the directory
  is not counted) and every process's list of steps."""
  service = Service(n, latency_ms / 1000)
  state = {"step": 0, "w": np.zeros(8, np.float32)}
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    opened = threading.Barrier(n)
    marks: dict[str, float] = {}
    finalized: list[int] = []  # By the commit hooks (the primary's).

    def work(coord: SimCoordinator) -> list[int]:
      with CheckpointManager(
          tmp, max_to_keep=2, commit=Commit(
              coordinator=coord, backend=backend_lib.MEMORY,
              barrier_timeout_secs=600, name="sim",
              hooks=[lambda stats: finalized.append(stats.step)])) as manager:
        if opened.wait() == 0:  # One thread starts the counts.
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
                 finalized=finalized, steps=steps[0],
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


def _watch(n: int, *, poll_secs: float = 0.5,
           watch_secs: float | None = None, lost: int = 1,
           latency_ms: float = 0.0) -> dict:
  """N liveness watchers polling for `watch_secs`; then process `lost`
  stops answering, and every survivor's watcher must report it. The calls
  per second before the loss (over `watch_secs`, by default two periods
  and at least 3 s), and the time until the last survivor knew."""
  every = liveness.period(poll_secs, n)
  watch_secs = watch_secs or max(3.0, 2 * every)
  service = Service(n, latency_ms / 1000)
  coords = service.coordinators()
  knew: dict[int, float] = {}
  lock = threading.Lock()

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
  calls = service.ops["live_processes"]
  rate = calls / (time.perf_counter() - t0)
  with service._lock:  # pylint: disable=protected-access
    service.dead.add(lost)
  stopped = time.perf_counter()
  survivors = [p for p in range(n) if p != lost]
  deadline = stopped + 30 + 10 * every
  while time.perf_counter() < deadline and len(knew) < len(survivors):
    time.sleep(0.01)
  for w in watchers:
    w.close()
  return {
      "processes": n, "poll_secs": poll_secs,
      "period_secs": every, "nominal_calls_per_sec": n / every,
      "live_calls_per_sec": rate,
      "survivors_that_knew": sum(p in knew for p in survivors),
      "survivors": len(survivors),
      "secs_until_all_knew": (max(knew.values()) - stopped
                              if len(knew) == len(survivors) else None),
  }


def _rounded(counts: dict[str, float]) -> dict[str, float]:
  return {k: round(v, 1) for k, v in counts.items()}


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
  parser.add_argument("--dir", default="/dev/shm" if os.path.isdir(
      "/dev/shm") else None, help="where the steps go (a tmpfs)")
  parser.add_argument("--json", default=None, help="write all figures here")
  args = parser.parse_args(argv)
  rows = []
  for n in args.processes:
    for latency in args.latency_ms:
      if args.watchers:
        row = simulate_watchers(n, latency_ms=latency)
        print(f"N={n:6d} latency={latency:5.1f} ms: a poll every"
              f" {row['period_secs']:.2f} s,"
              f" {row['live_calls_per_sec']:9.1f} live calls/s"
              f" (nominal {row['nominal_calls_per_sec']:.0f});"
              f" {row['survivors_that_knew']}/{row['survivors']} survivors"
              f" knew of the loss in {row['secs_until_all_knew']} s",
              flush=True)
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
              f" {_rounded(row['ops_by_kind_per_save'])}", flush=True)
      rows.append(row)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
