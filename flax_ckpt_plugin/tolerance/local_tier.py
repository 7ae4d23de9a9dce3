"""The local tier: this process's own steps, on its own fast storage.

Every `local_every_steps` (see `FaultTolerance`), each process saves
every distinct shard it holds (replicas included) under
`<local_directory>/<job>/process_NNNNN/`, in the same format, through a
`CheckpointManager` of its own that meets no other process
(`TierManager.for_this_process`). On a file system in memory
(`/dev/shm`) nothing is fsynced (`local.MemoryBackend`). The newest
`keep` steps are kept. The tiers open it on every process together
(`loop.tiers.open_tier`). A relaunched
process restores from its peers' local tiers (`peer`), survivors from
their own (`elastic`, `rescue`).
"""

from __future__ import annotations

from typing import Any, Callable, TYPE_CHECKING

from etils import epath

from flax_ckpt_plugin.logs import log

if TYPE_CHECKING:  # Made by the tiers (`loop.tiers.open_tier`).
  from flax_ckpt_plugin.manager.tier import TierManager

class LocalTier:
  """This process's steps in the local tier, through `manager` (a
  `TierManager.for_this_process`). Made on every process."""

  def __init__(self, manager: TierManager):
    self.manager = manager

  @property
  def directory(self) -> epath.Path:
    return self.manager.directory

  def quietly(self, what: str, fn: Callable[[TierManager], Any]
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
