"""The options of how saves are committed, as one typed record; and the
clear error for a keyword that moved into a record.

`Commit` groups what the manager, the callback and the clu action each
take about storage and about the processes agreeing on a save: where the
bytes go (`backend`, `atomicity`, `pinned_host_bytes`), who finalizes
(`primary_host`), how the processes meet (`coordinator`,
`barrier_timeout_secs`, `name`) and who hears of each finalized step
(`hooks`). The everyday choices stay keywords of their own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence, TypeVar

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.save import atomicity as atomicity_lib
from flax_ckpt_plugin.save.commit import CommitHook


@dataclasses.dataclass(frozen=True)
class Commit:
  """How saves are written and committed, and how processes agree on them.

  `CheckpointCallback(commit=...)`, `CheckpointManager(commit=...)`.

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
    primary_host: the process that creates, finalizes and deletes steps.
    barrier_timeout_secs: how long a process waits at a barrier for the
      others before raising `TimeoutError`.
    coordinator: how processes meet (`multihost.coordinator.Coordinator`);
      default: JAX's coordination service.
    name: the start of the manager's barrier keys; default: a digest of
      the directory as given (the same string on every process). A token
      drawn by the writer at open completes the keys.
    hooks: callables run with the `SaveStats` of each step once it is
      finalized (to notify, start an evaluation, copy the step elsewhere),
      on the primary host; see `CheckpointManager.add_commit_hook`.
  """
  backend: interface.Backend | None = None
  atomicity: atomicity_lib.Atomicity = "auto"
  pinned_host_bytes: int | None = None
  primary_host: int = 0
  barrier_timeout_secs: float = 300.0
  coordinator: coordinator_lib.Coordinator | None = None
  name: str | None = None
  hooks: Sequence[CommitHook] = ()

  def __post_init__(self):
    if isinstance(self.primary_host, bool) or not isinstance(
        self.primary_host, int) or self.primary_host < 0:
      raise ValueError("primary_host must be a process index (an int >= 0),"
                       f" got {self.primary_host!r}")
    if not self.barrier_timeout_secs > 0:
      raise ValueError("barrier_timeout_secs must be > 0, got"
                       f" {self.barrier_timeout_secs!r}")
    if self.pinned_host_bytes is not None and (
        isinstance(self.pinned_host_bytes, bool)
        or not isinstance(self.pinned_host_bytes, int)
        or self.pinned_host_bytes < 0):
      raise ValueError("pinned_host_bytes must be an int >= 0 or None, got"
                       f" {self.pinned_host_bytes!r}")
    object.__setattr__(self, "hooks", tuple(self.hooks))


_RETENTION = "retention=Retention({}=...)"
_COMMIT = "commit=Commit({}=...)"
# The manager's keywords that moved into the option records: where each
# is now.
MANAGER_MOVED = {
    **{k: _RETENTION.format(k) for k in (
        "keep_every_n_steps", "keep_best", "best_metric", "best_mode",
        "keep_without_metric")},
    **{k: _COMMIT.format(k) for k in (
        "backend", "atomicity", "pinned_host_bytes", "primary_host",
        "barrier_timeout_secs", "coordinator", "name")},
    "commit_hooks": _COMMIT.format("hooks"),
}

_TOLERANCE = "tolerance=FaultTolerance({}=...)"
_RESTORE = "restore_or_initialize(state, {}=...)"
# The callback's keywords that moved into the option records (or to where
# the iterator's state is restored): where each is now.
CALLBACK_MOVED = {
    **MANAGER_MOVED,
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
            f"{owner} no longer takes {', '.join(map(repr, old))}: "
            + "; ".join(f"{k} is now {moved[k]}" for k in old)
            + " (see docs/usage.md, *Options*)")
      return fn(*args, **kwargs)
    return checked  # type: ignore[return-value]
  return wrap
