"""N "processes" as threads of one test process, meeting through a fake coordinator.

    results = run_threads(3, lambda coord: work(coord))

Each thread gets its own `ThreadCoordinator` (its process index), and they
share barriers and a key-value store, with the same semantics as JAX's
coordination service as far as the package relies on them: barriers time out
with `TimeoutError`, may meet a subset of processes, and may be used again
once passed; `kv_get` waits for a key. Real multi-process tests (launcher.py)
stay on top; these run the cross-process logic in milliseconds.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Sequence

from flax_ckpt_plugin.multihost import keys


class FakeCluster:
  """The state the threads share: barriers, key-value store, a log of keys."""

  def __init__(self, process_count: int):
    self.process_count = process_count
    self.cond = threading.Condition()
    self.kv: dict[str, str] = {}
    # Per barrier key: the current generation and who arrived in it.
    self.barriers: dict[str, tuple[int, set[int]]] = {}
    self.barrier_keys: list[tuple[int, str]] = []  # (process, key), in order.
    self.preempt_at: int | None = None  # Step of a preemption sync point.

  def coordinators(self) -> list["ThreadCoordinator"]:
    return [ThreadCoordinator(self, i) for i in range(self.process_count)]


class ThreadCoordinator:
  """One fake process's view of a `FakeCluster`."""

  def __init__(self, cluster: FakeCluster, index: int):
    self.rounds = keys.Rounds()
    self.cluster = cluster
    self._index = index

  @property
  def process_index(self) -> int:
    return self._index

  @property
  def process_count(self) -> int:
    return self.cluster.process_count

  def barrier(self, key: str, *, timeout_ms: int,
              process_ids: Sequence[int] | None = None) -> None:
    c = self.cluster
    members = set(range(c.process_count) if process_ids is None
                  else process_ids)
    deadline = time.monotonic() + timeout_ms / 1000
    with c.cond:
      c.barrier_keys.append((self._index, key))
      gen, arrived = c.barriers.get(key, (0, set()))
      arrived = arrived | {self._index}
      if arrived >= members:
        c.barriers[key] = (gen + 1, set())  # Passed: reusable.
        c.cond.notify_all()
        return
      c.barriers[key] = (gen, arrived)
      while c.barriers[key][0] == gen:
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(
              f"barrier {key!r} timed out after {timeout_ms / 1000:.1f}s on"
              f" process {self._index} of {c.process_count}")
        c.cond.wait(left)

  def kv_set(self, key: str, value: str) -> None:
    with self.cluster.cond:
      self.cluster.kv[key] = value
      self.cluster.cond.notify_all()

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    c = self.cluster
    with c.cond:
      if not c.cond.wait_for(lambda: key in c.kv, timeout_ms / 1000):
        raise TimeoutError(f"waited for key {key!r} on process {self._index}")
      return c.kv[key]

  def kv_dir(self, prefix: str) -> dict[str, str]:
    with self.cluster.cond:
      return {k: v for k, v in self.cluster.kv.items()
              if k.startswith(prefix + "/")}

  def kv_delete(self, key: str) -> None:
    with self.cluster.cond:
      for k in [k for k in self.cluster.kv
                if k == key or k.startswith(key + "/")]:
        del self.cluster.kv[k]

  def reached_preemption_sync_point(self, step: int) -> bool:
    return self.cluster.preempt_at == step

  def preemption_notifier_installed(self) -> bool:
    return False


def run_threads(n: int, fn: Callable[[ThreadCoordinator], Any], *,
                timeout: float = 60.0, cluster: FakeCluster | None = None
                ) -> list[Any]:
  """Runs `fn(coord)` in `n` threads; returns each result or exception.

  A thread still running after `timeout` seconds fails the test.
  """
  cluster = cluster or FakeCluster(n)
  results: list[Any] = [None] * n

  def body(coord):
    try:
      results[coord.process_index] = fn(coord)
    except BaseException as e:  # pylint: disable=broad-except
      results[coord.process_index] = e

  threads = [threading.Thread(target=body, args=(c,), daemon=True,
                              name=f"fake-process-{c.process_index}")
             for c in cluster.coordinators()]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout)
  hung = [t.name for t in threads if t.is_alive()]
  assert not hung, f"{hung} still running after {timeout}s"
  return results


def counts(keys: list[tuple[int, str]]) -> dict[str, int]:
  """How many processes met at each barrier key."""
  return dict(collections.Counter(k for _, k in keys))
