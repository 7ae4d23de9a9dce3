"""The option records of where a save's bytes go and of how the processes
of a job agree on it.

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

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin import errors
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.save import atomicity as atomicity_lib


@dataclasses.dataclass(frozen=True)
class Storage:
  """Where and how a save's bytes are written.

  `CheckpointCallback(storage=...)`, `CheckpointManager(storage=...)`.

  Attributes:
    backend: the directory's storage (`Backend`); default:
      the one its path's scheme names (local file system, or an object
      store). `LocalBackend(direct_io=..., cache_saved=...)` tunes a local
      disk.
    atomicity: 'auto' (rename on local paths, a commit file on object
      stores), 'rename' or 'commit_file'.
    pinned_host_bytes: on accelerators, the most bytes of one save that go
      through pinned host memory, which the save call does not wait for
      (see docs/loop.md); None (default): all this process writes; 0: none
      (every shard then takes the plain transfer, which it waits for).
      That much host memory stays pinned for the life of the process.
    io_timeout_secs: how long one read or write of storage may take (a
      call moves at most 64 MB): one that takes longer raises
      `StorageTimeoutError` naming the file, the bytes and the step (a
      restore then fails, or `restore_newest_valid` tries the previous
      step; a save is not finalized, and the next call raises). The
      thread stuck in it is left behind, never waited for.
  """
  backend: interface.Backend | None = None
  atomicity: atomicity_lib.Atomicity = "auto"
  pinned_host_bytes: int | None = None
  io_timeout_secs: float = deadlines.IO_TIMEOUT_SECS

  def __post_init__(self):
    errors.check_count("pinned_host_bytes", self.pinned_host_bytes,
                       minimum=0, or_none=True)
    # No deadline at all (math.inf) is allowed.
    errors.check_secs("io_timeout_secs", self.io_timeout_secs, finite=False)


@dataclasses.dataclass(frozen=True)
class Processes:
  """How the processes of a job agree on a save (one process: nothing to
  set).

  `CheckpointCallback(processes=...)`, `CheckpointManager(processes=...)`.

  Attributes:
    primary_host: the process that creates, finalizes and deletes steps.
    barrier_timeout_secs: how long a process waits at a barrier for the
      others before raising `TimeoutError`.
    coordinator: how processes meet (barriers and a key-value store; see
      docs/fault_tolerance.md); default: JAX's coordination service.
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
