"""The local tier: this process's own steps, on its own fast storage.

Every `local_every_steps` (see `FaultTolerance`), each process saves
every distinct shard it holds (replicas included) under
`<local_directory>/<job>/process_NNNNN/`, in the same format, through a
`CheckpointManager` of its own that meets no other process. On a file
system in memory (`/dev/shm`) nothing is fsynced
(`backend.MemoryBackend`). The newest `keep` steps are kept. A relaunched
process restores from its peers' local tiers (`peer`), survivors from
their own (`elastic`, `rescue`).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from etils import epath

from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.format import files
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.manager.manager import CheckpointManager
from flax_ckpt_plugin.manager.options import Processes
from flax_ckpt_plugin.manager.options import Storage
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import groups

class LocalTier:
  """This process's steps in the local tier. Made on every process.

  Args:
    directory: the per-host path (a local SSD, or `/dev/shm`).
    job: a name for the job (see `generations.job_name`).
    coordinator: the job's coordinator (names this process).
    keep: how many of the newest steps to keep.
    pinned_host_bytes: see `Storage`.
  """

  def __init__(self, directory: epath.PathLike, job: str, *,
               coordinator: coordinator_lib.Coordinator, keep: int = 2,
               pinned_host_bytes: int | None = None):
    pid = coordinator.process_index
    path = epath.Path(os.path.abspath(os.fspath(directory)))
    path = path / job / f"process_{pid:05d}"
    self.manager = CheckpointManager(
        path, max_to_keep=keep,
        storage=Storage(backend=backend_lib.for_local_path(path),
                        pinned_host_bytes=pinned_host_bytes),
        processes=Processes(coordinator=groups.SoloCoordinator(),
                            name=f"local/{job}/{pid}"),
        scope=files.Scope(pid, coordinator.process_count))

  @property
  def directory(self) -> epath.Path:
    return self.manager.directory

  def quietly(self, what: str, fn: Callable[[CheckpointManager], Any]
              ) -> None:
    """`fn(self.manager)`; an error is logged, never raised: the local
    tier is this process's alone, and a loop that stopped on one process
    would leave the others waiting for it in the next collective. A step
    it failed to save is simply missing there (restores fall through)."""
    try:
      fn(self.manager)
    except Exception as e:  # pylint: disable=broad-except
      log.error("the local tier's %s in %s failed (training goes on; the"
                " persistent tier is unaffected): %r", what, self.directory,
                e)

  def discard_newer(self, step: int | None) -> None:
    """Drops the local steps newer than `step` (every one, with None): a
    restore or a loss ended the timeline they belong to, and the loop
    computes those steps anew."""
    newer = [s for s in self.manager.all_steps() if step is None or s > step]
    self.quietly("discard", lambda m: m.discard(newer))


def open_tier(directory: epath.PathLike, job: str, *,
              coordinator: coordinator_lib.Coordinator, timeout_ms: int,
              pinned_host_bytes: int | None = None) -> LocalTier | None:
  """Every process opens its local tier; None on all if any failed.

  All processes must take the same path through a restore (see
  `restore_newest`), so a tier that cannot open on one process (a path
  not writable there) is off everywhere, with an error in the log.
  """
  outcome = coordinator_lib.agree(
      coordinator, f"flax_ckpt_plugin/local/{job}/open/"
      f"{coordinator.next_round(f'local/{job}/open')}",
      lambda: LocalTier(directory, job, coordinator=coordinator,
                        pinned_host_bytes=pinned_host_bytes),
      timeout_ms=timeout_ms)
  if not outcome.failures:
    return outcome.result
  if outcome.result is not None:
    outcome.result.manager.close()
  log.error("the local tier in %s is off: it failed to open on %s",
            directory, coordinator_lib.describe_failures(outcome.failures))
  return None
