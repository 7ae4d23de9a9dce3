"""TierManager: a `CheckpointManager` as the tolerance layer drives it.

The callback keeps its steps in tiers (`loop.tiers`): the persistent
directory, and each process's own steps on a per-host path. What the
tolerance layer does to a tier's manager, and a user never calls, is
here rather than on the public class: go on with a group of the processes
after a loss (`regroup`), read a step's files as they are, from the
snapshot still held in memory where there is one (`read_step`), save the
partner copies of other processes' shards with a step (`save`), set
damaged steps aside (`set_aside`), and restore with options already
checked (`restore_with` and its siblings: the tiers hand the user's
`RestoreOptions` down as one value). `for_this_process` makes a local
tier's manager.
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

from etils import epath

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.format import files
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.manager import options
from flax_ckpt_plugin.manager.manager import CheckpointManager
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import groups
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.restore.directory_reader import DirectoryReader
from flax_ckpt_plugin.save import commit as commit_lib
from flax_ckpt_plugin.save.leaves import ShardData

T = TypeVar("T")


class TierManager(CheckpointManager):
  """A `CheckpointManager` of one of the callback's tiers.

  Args:
    directory: as for `CheckpointManager`.
    scope: save, for the process it names, every distinct shard that
      process holds, alone (a local tier's steps; see
      docs/fault_tolerance.md); None: the job's steps.
    **kwargs: as for `CheckpointManager`.
  """

  def __init__(self, directory: epath.PathLike, *,
               scope: files.Scope | None = None, **kwargs: Any):
    self.scope = scope  # Before the manager's staging, which it decides.
    super().__init__(directory, **kwargs)

  @classmethod
  def for_this_process(cls, directory: epath.PathLike, job: str, *,
                       coordinator: coordinator_lib.Coordinator,
                       keep: int = 2, pinned_host_bytes: int | None = None
                       ) -> TierManager:
    """A manager of this process's own steps (the local tier's).

    Under `directory/job/process_NNNNN`: every distinct shard the process
    holds, replicas included, saved and restored without meeting another
    process, the newest `keep` kept. On a file system in memory its
    backend fsyncs nothing.

    Args:
      directory: a per-host path (a local SSD, or `/dev/shm`).
      job: a name for the job, so that two jobs that share a local path
        never read each other's steps.
      coordinator: the job's coordinator (names this process).
      keep: how many of the newest steps to keep.
      pinned_host_bytes: see `Storage`.

    Returns:
      The manager, open for writing.
    """
    pid = coordinator.process_index
    path = epath.Path(os.path.abspath(os.fspath(directory)))
    path = path / job / f"process_{pid:05d}"
    return cls(path, max_to_keep=keep,
               storage=options.Storage(
                   backend=interface.for_own_path(path),
                   pinned_host_bytes=pinned_host_bytes),
               processes=options.Processes(
                   coordinator=groups.SoloCoordinator(),
                   name=f"local/{job}/{pid}"),
               scope=files.Scope(pid, coordinator.process_count))

  def save(self, step: int, state: Any, *, extra: Any = None,
           metrics: dict[str, Any] | None = None,
           data_state: Any = None,
           partner_shards: Callable[[], dict[str, list[ShardData]]]
           | None = None) -> None:
    """`CheckpointManager.save`, with the partner copies of a local tier.

    Args:
      step, state, extra, metrics, data_state: see `CheckpointManager.save`.
      partner_shards: gives the shards of other processes held here as
        partner copies (`FaultTolerance.replicas`), by leaf path; called
        once this process's own copies have started.

    Raises:
      As `CheckpointManager.save`.
    """
    self._save(step, state, extra=extra, metrics=metrics,
               data_state=data_state, partner_shards=partner_shards)

  # The restores, with their options checked (`RestoreOptions`), as the
  # tiers call them: `restore_with(target, step, options, data_iterator)`,
  # `restore_together_with(target, step, options, data_iterator)` and
  # `restore_newest_valid_with(target, options, data_iterator)`; see
  # `restore`, `restore_together` and `restore_newest_valid`.
  restore_with = DirectoryReader._restore  # pylint: disable=protected-access
  restore_together_with = DirectoryReader._restore_together  # pylint: disable=protected-access
  restore_newest_valid_with = DirectoryReader._restore_newest_valid  # pylint: disable=protected-access

  def set_aside(self, steps: list[int]) -> None:
    """Takes damaged steps out of the list, so that training saves them
    anew (see `restore_newest_valid`); a read-only manager changes
    nothing."""
    self._set_aside(steps)

  def read_step(self, step: int, fn: Callable[[interface.Backend], T]) -> T:
    """Reads `step`'s files with `fn(storage)`, on this process alone.

    Where this process still holds the step's snapshot (the newest step it
    saved; see docs/loop.md), its data file comes from memory, checked by
    the reader as a file's; if those bytes fail the checks, `fn` runs
    again on the files. `fn` must not save (a save waits for the read to
    end, and raises inside it).

    Args:
      step: a finalized step.
      fn: reads the step's files through the storage it is given.

    Returns:
      What `fn` returned.

    Raises:
      What `fn` raised reading the files.
    """
    result, _ = self._held.read(step, self.directory / str(step),
                                self.backend, fn, CheckpointCorruptedError,
                                f"reading step {step} of {self.directory}")
    return result

  def regroup(self, coordinator: Any, wait_secs: float, *, tag: str,
              primary_host: int) -> None:
    """Goes on with the processes of `coordinator` alone.

    The group is the survivors of a lost peer, or every process again once
    a replacement rejoined (see `elastic`): later saves and restores meet
    them only, and they write every byte. The save that the loss broke is
    waited for (at most `wait_secs`) and its error dropped.

    Args:
      coordinator: the group.
      wait_secs: how long to wait for the running save.
      tag: names the group's keys (the same on every member, new for each
        regroup of the job).
      primary_host: the group's primary (a member).
    """
    try:
      if not self.wait_until_finished(wait_secs):
        log.warning("the save the loss broke still runs after %.0fs",
                    wait_secs)
    except Exception as e:  # pylint: disable=broad-except
      log.info("dropped the error of the save the loss broke: %r", e)
    # (`wait_until_finished` waited for this process's deletes too: the
    # steps listed below are not being deleted.)
    self._writers = list(coordinator.members)
    self.coordinator, self.primary_host = coordinator, primary_host
    self.is_primary = coordinator.process_index == primary_host
    # Keys of their own: the members may have counted the broken save
    # differently (one whose snapshot failed did not count it), a key used
    # before names another set of processes, and a process that rejoins
    # counted no save at all.
    self.name = keys.child(self._opened_name, tag)
    self._saves = 0
    # That save may have finalized its step before it broke: the primary
    # lists the steps anew, for all.
    steps = commit_lib.listed_by_primary(
        meetings.Meeting(coordinator,
                         keys.fresh(coordinator, keys.child(self.name,
                                                            "regroup")),
                         self.barrier_timeout_ms), self.directory,
        is_primary=self.is_primary)
    self._listed(steps)
