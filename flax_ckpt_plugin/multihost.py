"""Who am I, barriers, a small key-value exchange and the preemption question.

Multi-process runs use JAX's multi-controller runtime: after
`jax.distributed.initialize()` every process holds a client of the
coordination service, whose barriers and key-value store are safe to use from
a background thread and can time out (device collectives are neither). With a
single process every barrier is a no-op and the key-value store is a dict.

Nothing here runs at import: the client is looked up on each call, so a user
may call `jax.distributed.initialize()` after importing this package.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import jax

logger = logging.getLogger("flax_ckpt_plugin")


class Barrier(Protocol):
  """Blocks until every process arrived at `key`, or raises TimeoutError."""

  def __call__(self, *, key: str, timeout_ms: int) -> None:
    ...


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def coordination_client() -> Any | None:
  """The coordination-service client of `jax.distributed`, or None."""
  # The client lives in a private module; JAX offers no public accessor.
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


def _is_deadline(exc: BaseException) -> bool:
  """Whether a coordination-service error means "the others did not come".

  A barrier that runs out of time says DEADLINE_EXCEEDED; one whose peer
  stopped sending heartbeats (killed, preempted) fails with UNAVAILABLE
  first. For the caller both mean the same: a process is gone.
  """
  text = str(exc)
  return any(s in text for s in ("DEADLINE_EXCEEDED", "heartbeat timeout",
                                 "UNAVAILABLE")) or "timed out" in text.lower()


def barrier(*, key: str, timeout_ms: int) -> None:
  """Waits until all processes reach the barrier `key`.

  Called on every process with the same key; a key must be used once. A
  no-op with one process.

  Raises:
    TimeoutError: the others did not arrive within `timeout_ms` (one may have
      died or stopped calling the library); the message names the key.
  """
  client = coordination_client()
  if client is None or process_count() == 1:
    return
  try:
    client.wait_at_barrier(key, int(timeout_ms))
  except Exception as e:  # JaxRuntimeError carries a gRPC status in its text.
    if _is_deadline(e):
      raise TimeoutError(
          f"barrier {key!r} timed out after {timeout_ms / 1000:.1f}s on"
          f" process {process_index()} of {process_count()}: another process"
          " died or did not call the checkpoint library at the same step."
      ) from e
    raise RuntimeError(
        f"barrier {key!r} failed on process {process_index()}: {e}") from e


class KeyValueStore:
  """String key-value exchange between processes.

  Backed by the coordination service when `jax.distributed` is initialized,
  else by a dict (one process sees its own writes).
  """

  def __init__(self):
    self._local: dict[str, str] = {}
    self._lock = threading.Lock()

  def set(self, key: str, value: str) -> None:
    client = coordination_client()
    if client is None:
      with self._lock:
        self._local[key] = value
      return
    client.key_value_set(key, value, allow_overwrite=True)

  def get(self, key: str, *, timeout_ms: int) -> str:
    """Blocks until `key` is set by some process.

    Raises:
      TimeoutError: nobody set `key` within `timeout_ms`.
    """
    client = coordination_client()
    if client is None:
      with self._lock:
        if key in self._local:
          return self._local[key]
      raise TimeoutError(f"key {key!r} was never set")
    try:
      return client.blocking_key_value_get(key, int(timeout_ms))
    except Exception as e:
      if _is_deadline(e):
        raise TimeoutError(
            f"waited {timeout_ms / 1000:.1f}s for key {key!r} on process"
            f" {process_index()}: the process that sets it died or fell"
            " behind.") from e
      raise

  def list_dir(self, prefix: str) -> dict[str, str]:
    """All keys under `prefix/` (without waiting)."""
    client = coordination_client()
    if client is None:
      with self._lock:
        return {k: v for k, v in self._local.items()
                if k.startswith(prefix + "/")}
    return dict(client.key_value_dir_get(prefix))

  def delete(self, key: str) -> None:
    """Deletes `key` and every key under `key/`."""
    client = coordination_client()
    if client is None:
      with self._lock:
        for k in [k for k in self._local
                  if k == key or k.startswith(key + "/")]:
          del self._local[k]
      return
    client.key_value_delete(key)


def reached_preemption_sync_point(step: int) -> bool:
  """True at the step that all processes agreed to save at before preemption.

  Uses JAX's preemption sync manager, installed by `jax.distributed.initialize`
  (it catches SIGTERM). Must be called by every process at every step. False
  when `jax.distributed` is not initialized.
  """
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  if distributed.global_state.preemption_sync_manager is None:
    return False
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(multihost_utils.reached_preemption_sync_point(int(step)))


class ProcessLogger(logging.LoggerAdapter):
  """Prefixes log lines with `[process=N][thread=NAME]` for merged logs."""

  def process(self, msg, kwargs):
    return (f"[process={jax.process_index()}]"
            f"[thread={threading.current_thread().name}] {msg}", kwargs)


log = ProcessLogger(logger, {})
