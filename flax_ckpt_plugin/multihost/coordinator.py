"""Everything that talks to other processes goes through one `Coordinator`.

A coordinator knows this process's index and the process count, meets the
others at named barriers (all of them, or a subset), and exchanges small
strings through a key-value store. The meetings built on it (`meetings`:
every process runs a piece of work and all learn together whether it failed
anywhere; one process decides for all) are how the package's processes
agree, so no process waits for a timeout to hear of a peer's error.

`JaxCoordinator` (the default) wraps the coordination service that
`jax.distributed.initialize()` starts; it is the only place in the package
that touches `jax._src`. Its barriers and key-value calls are safe from a
background thread and time out (device collectives do neither). The service
runs in process 0 and enforces a call's timeout there, so each process also
keeps its own deadline around every call: a hung process 0 is then a
`TimeoutError` here, not JAX ending the process after its heartbeat timeout
(100 s by default). With one process every barrier is a no-op and the
key-value store is a dict. Tests inject a coordinator that runs N
"processes" as threads.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable, Protocol, Sequence
from typing import TypeVar

from flax_ckpt_plugin.deadlines import DEADLINES
from flax_ckpt_plugin.deadlines import NoAnswer
from flax_ckpt_plugin.multihost import keys

T = TypeVar("T")


class Coordinator(Protocol):
  """What the package needs of the processes around it.

  Every method that meets other processes (`barrier`, and the meetings
  built on it) must be called by all of them (or all of `process_ids`)
  with the same key. A barrier key may be used again once every process
  passed it.
  """

  @property
  def process_index(self) -> int:
    """This process, in [0, process_count)."""

  @property
  def process_count(self) -> int:
    """Processes in the job."""

  def barrier(self, key: str, *, timeout_ms: int,
              process_ids: Sequence[int] | None = None) -> None:
    """Blocks until every process (or each of `process_ids`) reached `key`.

    Raises:
      TimeoutError: not all arrived within `timeout_ms`; names the key.
    """

  def kv_set(self, key: str, value: str) -> None:
    """Sets `key` (overwriting) for every process to read."""

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    """Waits until some process set `key`; TimeoutError after `timeout_ms`."""

  def kv_dir(self, prefix: str) -> dict[str, str]:
    """Every key under `prefix/` (full keys), without waiting."""

  def kv_delete(self, key: str) -> None:
    """Deletes `key` and every key under `key/`."""

  @property
  def rounds(self) -> keys.Rounds:
    """This process's count of each reused name, read by `keys.fresh`
    alone: one per process, shared by every coordinator of it."""

  def reached_preemption_sync_point(self, step: int) -> bool:
    """True on every process at the step all agreed to save before preemption."""

  def preemption_notifier_installed(self) -> bool:
    """Whether the runtime catches SIGTERM and tells every process."""

  def live_processes(self, process_ids: Sequence[int] | None = None,
                     timeout_secs: float | None = None) -> dict[int, int]:
    """The live processes (among `process_ids`, all by default) and each
    one's incarnation id (see `liveness`).

    A barrier over the live processes: all of them poll it the same way.
    """


def _is_deadline(exc: BaseException) -> bool:
  """Whether a coordination-service error means "the others did not come".

  A barrier that runs out of time says DEADLINE_EXCEEDED; one whose peer
  stopped sending heartbeats (killed, preempted) fails with UNAVAILABLE
  first. For the caller both mean the same: a process is gone.
  """
  text = str(exc)
  return any(s in text for s in ("DEADLINE_EXCEEDED", "heartbeat timeout",
                                 "UNAVAILABLE")) or "timed out" in text.lower()


def _failure(what: str, e: BaseException, secs: float,
             timeout_secs: float, where: str) -> str:
  """The message of a failed call, true to how long it took.

  A call that ran out its time "timed out"; one that failed sooner (the
  service's process was killed: the connection breaks at once) says so,
  with JAX's error, instead of claiming a timeout that never passed.
  """
  if secs >= 0.95 * timeout_secs:
    return f"{what} timed out after {secs:.1f}s on {where}"
  return (f"{what} failed after {secs:.1f}s (of a {timeout_secs:.1f}s"
          f" timeout) on {where}: {e}")


class JaxCoordinator:
  """The coordination service of `jax.distributed`, looked up at each call.

  Nothing runs at import, and the client is found anew on every call, so a
  user may call `jax.distributed.initialize()` after making a manager.
  """

  # One process, one coordination service: every instance shares the rounds
  # and the single-process store, so a coordinator made anew (per manager,
  # say) never reuses a key an earlier one used.
  rounds = keys.Rounds()
  _local: dict[str, str] = {}
  _lock = threading.Lock()

  # This process's deadline for a call: the call's own timeout plus a
  # margin for the round trip, after which process 0 is taken for hung.
  # Calls without a timeout of their own (key-value set, list, delete)
  # answer at once from a healthy service; they get `CALL_TIMEOUT_SECS`.
  MIN_MARGIN_SECS = 2.0
  MARGIN_FRACTION = 0.2
  CALL_TIMEOUT_SECS = 30.0
  # Raises to end every wait at once (a `liveness.Watcher`'s `check`).
  _abort: Callable[[], None] | None = None

  def abort_when(self, check: Callable[[], None] | None, *,
                 replacing: Callable[[], None] | None = None) -> None:
    """Every call of this coordinator from now on ends when `check` raises.

    With `replacing`, only if that is the check in place (a watcher that
    closes removes its own check, not a newer watcher's).
    """
    if replacing is None or self._abort == replacing:
      self._abort = check

  def unguarded(self) -> "JaxCoordinator":
    """This coordinator, but deaf to `abort_when`: for the survivors of a
    lost peer, who meet each other after the watcher ended every wait."""
    other = copy.copy(self)
    other._abort = None  # pylint: disable=protected-access
    return other

  def _where(self) -> str:
    return f"process {self.process_index} of {self.process_count}"

  def _call(self, what: str, fn: Callable[[], T],
            timeout_secs: float | None = None) -> T:
    """`fn()` (a call to the service), within this process's own deadline.

    Raises:
      TimeoutError: the service did not answer in time; names `what`.
    """
    if timeout_secs is None:
      timeout_secs = self.CALL_TIMEOUT_SECS
    deadline = timeout_secs + max(self.MIN_MARGIN_SECS,
                                  self.MARGIN_FRACTION * timeout_secs)
    if self._abort is not None:
      self._abort()
    try:
      return DEADLINES.call(fn, deadline, self._abort)
    except NoAnswer:
      raise TimeoutError(
          f"the coordination service (process 0) did not answer {what}"
          f" within {deadline:.1f}s on {self._where()} (the call's own"
          f" timeout: {timeout_secs:.1f}s): process 0 may be hung or gone."
          ) from None

  @staticmethod
  def _client() -> Any | None:
    # JAX offers no public accessor for the client.
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    return distributed.global_state.client

  @property
  def process_index(self) -> int:
    import jax  # pylint: disable=g-import-not-at-top
    return jax.process_index()

  @property
  def process_count(self) -> int:
    import jax  # pylint: disable=g-import-not-at-top
    return jax.process_count()

  def _multi(self) -> Any | None:
    client = self._client()
    return client if client is not None and self.process_count > 1 else None

  def barrier(self, key: str, *, timeout_ms: int,
              process_ids: Sequence[int] | None = None) -> None:
    client = self._multi()
    if client is None:
      return
    kwargs = {} if process_ids is None else {"process_ids": list(process_ids)}
    t0 = time.monotonic()
    try:
      self._call(f"barrier {key!r}",
                 lambda: client.wait_at_barrier(key, int(timeout_ms), **kwargs),
                 timeout_ms / 1000)
    except TimeoutError:  # This process's deadline: raised as it is.
      raise
    except Exception as e:  # JaxRuntimeError carries a gRPC status in its text.
      if _is_deadline(e):
        raise TimeoutError(_failure(
            f"barrier {key!r}", e, time.monotonic() - t0, timeout_ms / 1000,
            self._where()) + ": another process died or did not call the"
            " checkpoint library at the same step.") from e
      raise RuntimeError(
          f"barrier {key!r} failed on process {self.process_index}: {e}") from e

  def kv_set(self, key: str, value: str) -> None:
    client = self._multi()
    if client is None:
      with self._lock:
        self._local[key] = value
      return
    self._call(f"kv_set {key!r}", lambda: client.key_value_set(
        key, value, allow_overwrite=True))

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    client = self._multi()
    if client is None:
      with self._lock:
        if key in self._local:
          return self._local[key]
      raise TimeoutError(f"key {key!r} was never set")
    t0 = time.monotonic()
    try:
      return self._call(
          f"kv_get {key!r}",
          lambda: client.blocking_key_value_get(key, int(timeout_ms)),
          timeout_ms / 1000)
    except TimeoutError:  # This process's deadline: raised as it is.
      raise
    except Exception as e:
      if _is_deadline(e):
        raise TimeoutError(_failure(
            f"waiting for key {key!r}", e, time.monotonic() - t0,
            timeout_ms / 1000, self._where()) + ": the process that sets it"
            " died or fell behind.") from e
      raise

  def kv_dir(self, prefix: str) -> dict[str, str]:
    client = self._multi()
    if client is None:
      with self._lock:
        return {k: v for k, v in self._local.items()
                if k.startswith(prefix + "/")}
    return dict(self._call(f"kv_dir {prefix!r}",
                           lambda: client.key_value_dir_get(prefix)))

  def kv_delete(self, key: str) -> None:
    client = self._multi()
    if client is None:
      with self._lock:
        for k in [k for k in self._local
                  if k == key or k.startswith(key + "/")]:
          del self._local[k]
      return
    self._call(f"kv_delete {key!r}", lambda: client.key_value_delete(key))

  def live_processes(self, process_ids: Sequence[int] | None = None,
                     timeout_secs: float | None = None) -> dict[int, int]:
    client = self._multi()
    if client is None:
      return {self.process_index: 0}
    ids = list(range(self.process_count) if process_ids is None
               else process_ids)
    return dict(self._call("the live processes",
                           lambda: client.get_live_nodes(ids), timeout_secs))

  def preemption_notifier_installed(self) -> bool:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    return distributed.global_state.preemption_sync_manager is not None

  def reached_preemption_sync_point(self, step: int) -> bool:
    """Uses JAX's preemption sync manager; False without `jax.distributed`.

    Must be called by every process at every step.
    """
    if not self.preemption_notifier_installed():
      return False
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return bool(multihost_utils.reached_preemption_sync_point(int(step)))


_DEFAULT: JaxCoordinator | None = None
_DEFAULT_LOCK = threading.Lock()


def default() -> JaxCoordinator:
  """The process's `JaxCoordinator` (one per process, made on first use)."""
  global _DEFAULT
  with _DEFAULT_LOCK:
    if _DEFAULT is None:
      _DEFAULT = JaxCoordinator()
    return _DEFAULT
