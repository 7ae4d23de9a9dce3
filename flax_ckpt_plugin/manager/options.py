"""The option records of where a save's bytes go and of how the processes
of a job agree on it, and the clear error for a keyword that moved.

Options are grouped by what the user decides, one record each, shared by
`CheckpointCallback`, `CheckpointManager` and the clu action:

* what to keep: `retention.Retention` (`max_to_keep` is also a keyword);
* where and how the bytes are written: `Storage` (the storage backend,
  atomicity, and the pinned host memory a save copies through);
* how the processes agree on a save: `Processes` (the primary host, the
  barriers' timeout, the coordinator, the barrier keys' name);
* what to do when a process or its machine goes away:
  `tolerance.options.FaultTolerance`.

Who hears of each finalized step: `add_commit_hook` (and the manager's
keyword `hooks`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, TypeVar

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.save import atomicity as atomicity_lib


@dataclasses.dataclass(frozen=True)
class Storage:
  """Where and how a save's bytes are written.

  `CheckpointCallback(storage=...)`, `CheckpointManager(storage=...)`.

  Attributes:
    backend: the directory's storage (`backends.backend.Backend`); default:
      the one its path's scheme names (local file system, or an object
      store). `LocalBackend(direct_io=..., cache_saved=...)` tunes a local
      disk.
    atomicity: 'auto' (rename on local paths, a commit file on object
      stores), 'rename' or 'commit_file'.
    pinned_host_bytes: on accelerators, the most bytes of one save that go
      through pinned host memory, which the save call does not wait for
      (see `pinned`); None (default): all this process writes; 0: none
      (every shard then takes the plain transfer, which it waits for).
      That much host memory stays pinned for the life of the process.
  """
  backend: interface.Backend | None = None
  atomicity: atomicity_lib.Atomicity = "auto"
  pinned_host_bytes: int | None = None

  def __post_init__(self):
    if self.pinned_host_bytes is not None and (
        isinstance(self.pinned_host_bytes, bool)
        or not isinstance(self.pinned_host_bytes, int)
        or self.pinned_host_bytes < 0):
      raise ValueError("pinned_host_bytes must be an int >= 0 or None, got"
                       f" {self.pinned_host_bytes!r}")


@dataclasses.dataclass(frozen=True)
class Processes:
  """How the processes of a job agree on a save (one process: nothing to
  set).

  `CheckpointCallback(processes=...)`, `CheckpointManager(processes=...)`.

  Attributes:
    primary_host: the process that creates, finalizes and deletes steps.
    barrier_timeout_secs: how long a process waits at a barrier for the
      others before raising `TimeoutError`.
    coordinator: how processes meet (`multihost.coordinator.Coordinator`);
      default: JAX's coordination service.
    name: the start of the manager's barrier keys; default: a digest of
      the directory as given (the same string on every process). A token
      drawn by the writer at open completes the keys.
  """
  primary_host: int = 0
  barrier_timeout_secs: float = 300.0
  coordinator: coordinator_lib.Coordinator | None = None
  name: str | None = None

  def __post_init__(self):
    if isinstance(self.primary_host, bool) or not isinstance(
        self.primary_host, int) or self.primary_host < 0:
      raise ValueError("primary_host must be a process index (an int >= 0),"
                       f" got {self.primary_host!r}")
    if not self.barrier_timeout_secs > 0:
      raise ValueError("barrier_timeout_secs must be > 0, got"
                       f" {self.barrier_timeout_secs!r}")


_RETENTION = "retention=Retention({}=...)"
_STORAGE = "storage=Storage({}=...)"
_PROCESSES = "processes=Processes({}=...)"
_TOLERANCE = "tolerance=FaultTolerance({}=...)"
_RESTORE = "restore_or_initialize(state, {}=...)"

# The manager's keywords that belong to an option record: where each is.
MANAGER_MOVED = {
    **{k: _RETENTION.format(k) for k in (
        "keep_every_n_steps", "keep_best", "best_metric", "best_mode",
        "keep_without_metric")},
    **{k: _STORAGE.format(k) for k in (
        "backend", "atomicity", "pinned_host_bytes")},
    **{k: _PROCESSES.format(k) for k in (
        "primary_host", "barrier_timeout_secs", "coordinator", "name")},
    "commit_hooks": "hooks=[...]",
    "commit": ("storage=Storage(backend, atomicity, pinned_host_bytes),"
               " processes=Processes(primary_host, barrier_timeout_secs,"
               " coordinator, name) and hooks=[...]"),
}
_ADD_HOOK = "callback.add_commit_hook(hook), for each hook"

# The callback's keywords that belong to an option record (or to where the
# data iterator's state is restored): where each is.
CALLBACK_MOVED = {
    **MANAGER_MOVED,
    "commit_hooks": _ADD_HOOK,
    "hooks": _ADD_HOOK,
    "commit": ("storage=Storage(backend, atomicity, pinned_host_bytes),"
               " processes=Processes(primary_host, barrier_timeout_secs,"
               " coordinator, name) and callback.add_commit_hook(hook)"),
    **{k: _TOLERANCE.format(k) for k in (
        "save_on_preemption", "preemption_signals", "watch_peers",
        "watch_poll_secs", "elastic", "elastic_wait_secs", "local_directory",
        "local_every_steps")},
    "data_iterator": _RESTORE.format("data_iterator"),
    "restore_data_state": _RESTORE.format("restore_data_state"),
    "clock": ("flax_ckpt_plugin.manager.schedule.monotonic, which a test may"
              " replace"),
}

F = TypeVar("F", bound=Callable[..., Any])


def moved_keywords(owner: str, moved: Mapping[str, str]) -> Callable[[F], F]:
  """Makes `owner`'s function raise a clear `TypeError` for a keyword that
  moved: `moved` maps each old name to where it is now ("retention=
  Retention(keep_best=...)"). The signature shown (`inspect`, help) stays
  the function's own."""

  def wrap(fn: F) -> F:
    @functools.wraps(fn)
    def checked(*args, **kwargs):
      old = [k for k in kwargs if k in moved]
      if old:
        raise TypeError(
            f"{owner} takes no {', '.join(map(repr, old))}: "
            + "; ".join(f"{k} is {moved[k]}" for k in old)
            + " (see docs/usage.md, *Options*)")
      return fn(*args, **kwargs)
    return checked  # type: ignore[return-value]
  return wrap
