"""JAX's distributed runtime where `jax.distributed` does not reach: the
coordination service in a process of its own, and every trainer a client.

`jax.distributed.initialize` always starts the coordination service inside
process 0, so process 0's death ends the whole job. Here the service runs
in a process with no devices (`serve`, which `flax-ckpt coordinator` runs),
and `initialize` makes every trainer, process 0 included, a client only, with
JAX's recoverability on: any trainer can die and the others go on (see
`tolerance`). After `initialize`, JAX's own APIs (`jax.process_index()`,
`multihost_utils`, preemption sync points) work as after
`jax.distributed.initialize`.

This is the one module that touches JAX's internals for it (the global
state of `jax._src.distributed`, jaxlib's service and client), and it says
at import if the JAX installed is outside the versions it was tested with
(`TESTED_JAX`). Two things the runtime does not do, done here:

* A client's handler of a lost service cannot be a Python function (JAX
  0.10 to 0.12: the runtime fails to convert its status, `std::bad_cast`,
  and the process aborts), and its default handler aborts too.
  `initialize` installs a handler of SIGABRT that, when the service no longer accepts
  connections at its address, prints a `CoordinatorLostError` naming it
  and ends the process with `PREEMPTED_EXIT_CODE` (nothing is left half
  done: a step is finalized by one rename, or not at all); any other abort
  goes on as an abort.
* A relaunched process 0 finds its dead incarnation's device topology in
  the service (`cpu:global_topology`, which process 0 alone writes) and
  its backend would fail to start (`ALREADY_EXISTS`): `initialize`
  removes it first.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import threading
from typing import Any

import jax

from flax_ckpt_plugin.errors import CoordinatorLostError
from flax_ckpt_plugin.logs import log

# The JAX versions (major, minor) this module was tested with.
TESTED_JAX = ((0, 10), (0, 12))
# Platforms whose device topology process 0 publishes in the service.
_TOPOLOGY_PLATFORMS = ("cpu", "cuda", "rocm", "gpu", "tpu")
# The status a process ends with when the service is lost (os.EX_TEMPFAIL,
# the callback's `PREEMPTED_EXIT_CODE`: relaunch me).
_LOST_EXIT_CODE = os.EX_TEMPFAIL


def _jax_version() -> tuple[int, int]:
  major, minor = jax.__version__.split(".")[:2]
  return int(major), int(minor)


if _jax_version() not in TESTED_JAX:
  log.warning("flax_ckpt_plugin's coordinator and initialize() were tested"
              " with JAX %s; this is JAX %s",
              ", ".join(f"{a}.{b}" for a, b in TESTED_JAX), jax.__version__)


def _host_port(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]") or "::", int(port)


def check_port_free(bind: str, port: int) -> None:
  """Raises if something listens on `port` of `bind` already.

  gRPC binds with SO_REUSEPORT, so a second service on a port in use binds
  without an error and the trainers' connections are split between the
  two; a plain bind (no SO_REUSEPORT) tells first.

  Raises:
    OSError: EADDRINUSE, naming the port.
  """
  host = bind.strip("[]")
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    try:
      s.bind((host, port))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        raise
      raise OSError(errno.EADDRINUSE,
                    f"port {port} is in use on {bind}: another coordinator"
                    " (or another program) listens there; pick another"
                    " port, or stop it first") from None


def serve(port: int, num_processes: int, *, bind: str = "[::]",
          heartbeat_timeout_secs: int = 100,
          shutdown_timeout_secs: int = 300) -> Any:
  """Starts JAX's coordination service for `num_processes` trainers, with
  recoverability on, in this process; returns it (`shutdown()` ends it).

  Raises:
    OSError: the port is in use (see `check_port_free`).
  """
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  check_port_free(bind, port)
  return _jax.get_distributed_runtime_service(
      f"{bind}:{port}", num_processes,
      heartbeat_timeout=heartbeat_timeout_secs,
      shutdown_timeout=shutdown_timeout_secs, recoverable=True)


def initialize(coordinator_address: str, num_processes: int,
               process_id: int, *, heartbeat_timeout_seconds: int = 100,
               initialization_timeout: int = 300) -> None:
  """Joins a job whose coordination service runs in a process of its own
  (`flax-ckpt coordinator`), in place of `jax.distributed.initialize`.

  Every process, 0 included, connects as a client only, with JAX's
  recoverability on: any process may die and the others go on (with
  `FaultTolerance`: they save what it cannot, or recover in place), and a
  relaunched one, 0 included, rejoins. When the coordinator itself is
  lost, every process ends with `PREEMPTED_EXIT_CODE` and a message naming
  `CoordinatorLostError` and the address (see the module doc). Call it
  before anything starts JAX's backend.

  Args:
    coordinator_address: host:port of the coordinator.
    num_processes: the processes of the job (the coordinator's
      `--num-processes`).
    process_id: this process's index.
    heartbeat_timeout_seconds: the coordinator's `--heartbeat-timeout`
      (give the same): a client beats at a pace set by its own timeout,
      so one above the service's reads there as a lost process.
    initialization_timeout: how long to wait for the coordinator and the
      other processes at the start.

  Raises:
    RuntimeError: JAX's distributed system is already initialized, or its
      backend already started (as for `jax.distributed.initialize`).
    ValueError: `process_id` is not in [0, `num_processes`).
  """
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  state = distributed.global_state
  if state.client is not None:
    raise RuntimeError("JAX's distributed system is already initialized in"
                       " this process")
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("initialize() must be called before any JAX call that"
                       " starts the backend (jax.devices, a computation...)")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got"
                     f" {process_id}")
  jax.config.update("jax_enable_recoverability", True)
  client = _jax.get_distributed_runtime_client(
      coordinator_address, process_id, init_timeout=initialization_timeout,
      heartbeat_timeout=heartbeat_timeout_seconds, use_compression=True)
  # No log line before the state is set: its prefix asks JAX for the
  # process index, which starts the backend.
  client.connect()
  state.coordinator_address = coordinator_address
  state.process_id = process_id
  state.num_processes = num_processes
  state.client = client
  if process_id == 0:
    _forget_topology(client)
  state.initialize_preemption_sync_manager()
  _LOST.install(coordinator_address)
  log.info("joined the coordination service at %s as process %d of %d (a"
           " client only; recoverable)", coordinator_address, process_id,
           num_processes)


def _forget_topology(client: Any) -> None:
  """Removes the device topology a dead incarnation of process 0 published
  (a relaunch's backend would fail to publish its own); none is there at a
  job's first start."""
  for platform in _TOPOLOGY_PLATFORMS:
    key = f"{platform}:global_topology"
    try:
      found = client.key_value_dir_get_bytes(key)  # (A serialized proto.)
    except Exception:  # pylint: disable=broad-except
      found = None
    if found:  # (No log line yet: see `initialize`.)
      client.key_value_delete(key)


class _LostService:
  """The handler of SIGABRT that turns the runtime's abort on a lost service
  into `CoordinatorLostError` and `PREEMPTED_EXIT_CODE` (see the module
  doc). Installed once per process; C's `signal`, through ctypes, since
  the abort comes from a thread of the runtime, which Python's own
  handlers never run on in time."""

  def __init__(self):
    self._address: str | None = None
    self._lock = threading.Lock()
    self._handler = None  # Kept referenced: C holds its address.
    self._libc: Any = None

  def install(self, address: str) -> None:
    with self._lock:
      self._address = address
      if self._handler is not None:
        return
      self._libc = ctypes.CDLL(None, use_errno=True)
      self._libc.signal.restype = ctypes.c_void_p
      self._libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
      self._handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(self._on_abort)
      self._libc.signal(signal.SIGABRT,
                        ctypes.cast(self._handler, ctypes.c_void_p))

  def _on_abort(self, signum: int) -> None:
    del signum
    address = self._address
    if address is not None and not _answers(address):
      os.write(2, (
          f"\nflax_ckpt_plugin: {CoordinatorLostError.__name__}: the"
          f" coordination service at {address} is gone (no connection);"
          " nothing more can be saved or agreed. Finalized steps and the"
          " local tiers are intact. Exiting with status"
          f" {_LOST_EXIT_CODE} (relaunch with a new coordinator).\n"
      ).encode())
      os._exit(_LOST_EXIT_CODE)  # pylint: disable=protected-access
    # Another abort: as it would have been (SIG_DFL, from any thread).
    self._libc.signal(signal.SIGABRT, None)
    os.abort()


def _answers(address: str) -> bool:
  """Whether something accepts TCP connections at `address` (host:port)."""
  host, port = _host_port(address)
  try:
    with socket.create_connection((host, port), timeout=1.0):
      return True
  except OSError:
    return False


_LOST = _LostService()
