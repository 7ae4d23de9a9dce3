"""Exceptions raised by flax_ckpt_plugin.

Each subclasses a built-in so that `except ValueError` / `except
FileNotFoundError` in user code keeps working.
"""

from __future__ import annotations

import errno
import math
from typing import Any

# `deadlines.StorageTimeoutError` (storage did not answer in time) lives
# with the deadlines it comes from, the lowest module of all.

# The errnos that mean a name cannot be a file of ours (a socket, a loop of
# links, a directory); others (EACCES, EIO) say nothing of the file itself.
NOT_A_FILE = (errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP,
              errno.ENXIO)

# The errnos of a read that the storage could not serve: a medium error
# (EIO), a file system's own checksum or consistency check (EBADMSG and
# EUCLEAN on Linux: EFSBADCRC, EFSCORRUPTED). Those bytes of that step
# cannot be had here, now; the step may be whole (a network file system's
# passing fault), so a restore skips it and keeps it (see `fallback`).
READ_FAILED = tuple(getattr(errno, name) for name in
                    ("EIO", "EBADMSG", "EUCLEAN") if hasattr(errno, name))


class CheckpointNotFoundError(FileNotFoundError):
  """No finalized checkpoint exists where one was asked for."""


class CheckpointExistsError(FileExistsError):
  """A save would overwrite a step that is already finalized."""


class CheckpointCorruptedError(ValueError):
  """A checkpoint on disk is damaged, truncated or not in our format."""


class StructureMismatchError(ValueError):
  """The checkpoint and the restore target disagree on a leaf.

  The message names the leaf by its key path and shows both sides, e.g.
  "leaf 'params/dense_1/kernel': checkpoint has float32[512,10], target has
  float32[512,20]".
  """


class ConcurrentWriterError(RuntimeError):
  """Another job opened this directory for writing after this one did.

  The newest writer owns the directory; the older one stops finalizing and
  deleting there, so neither corrupts the other's steps.
  """


class SaveFailedError(RuntimeError):
  """A save failed on another process, so no process finalized it."""


class CommitHookError(RuntimeError):
  """A commit hook failed; the step itself is finalized and durable."""


class RestoreFailedError(RuntimeError):
  """A restore failed on another process, so no process restored that step.

  The process that failed raises its own error; the others raise this one,
  naming it and its error, at once rather than after a barrier timeout.
  """


class CoordinatorLostError(RuntimeError):
  """The coordination service of the job (`flax-ckpt coordinator`) is gone.

  No process can meet another any more, so nothing more can be saved or
  agreed: every process ends with `PREEMPTED_EXIT_CODE`, its finalized
  steps and local tier intact (a step is finalized whole or not at all).
  Relaunch the job with a new coordinator; it resumes from the newest step
  any tier holds. The message names the coordinator's address.
  """


class PeerLostError(RuntimeError):
  """Another process of the job died or restarted (see
  docs/fault_tolerance.md).

  Raised on the survivors by the callback and by every coordination call
  that would otherwise wait for the lost process. The job cannot go on as
  it was: exit (with `PREEMPTED_EXIT_CODE`, so that the launcher restarts
  it) and relaunch every process, or, with a callback made with
  `FaultTolerance(elastic=True)`, go on without it
  (`CheckpointCallback.recover`).

  Attributes:
    lost: each lost process's index, and how it was lost.
  """

  def __init__(self, lost: dict[int, str], process_index: int,
               process_count: int):
    self.lost = dict(lost)
    names = "; ".join(f"process {p} {why}" for p, why in sorted(lost.items()))
    super().__init__(
        f"{names} (noticed on process {process_index} of {process_count}):"
        " the job cannot go on as it was; exit and relaunch every process,"
        " or go on without it (CheckpointCallback.recover)")

  def __reduce__(self):  # Picklable with its arguments.
    return (PeerLostError, (self.lost, 0, 0))


class DataStateMismatchError(ValueError):
  """A step's data states were saved by another number of processes: each
  process's data position means nothing to a job split otherwise."""


class Unsuitable(Exception):
  """Internal: raised by a restore function when a step is whole but cannot
  serve this restore (it lacks this process's data state, or other
  processes found it damaged); the newest-valid fallback skips it and keeps
  it."""


# -- the checks of the option records' counts and durations -------------------


def check_count(name: str, value: Any, *, minimum: int = 1,
                or_none: bool = False) -> None:
  """Checks an option that counts (steps, copies, bytes).

  Args:
    name: the option's name, for the message.
    value: what was given.
    minimum: the least value allowed.
    or_none: None is allowed too (and the message says so).

  Raises:
    ValueError: `value` is not an int >= `minimum` (a bool is not an int
      here), nor an allowed None.
  """
  if value is None and or_none:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}"
                     f"{' or None' if or_none else ''}, got {value!r}")


def check_secs(name: str, value: Any, *, or_none: bool = False,
               finite: bool = True) -> None:
  """Checks an option that is a duration in seconds.

  Args:
    name: the option's name, for the message.
    value: what was given.
    or_none: None is allowed too (and the message says so).
    finite: infinity is refused (False: allowed, e.g. "no deadline").

  Raises:
    ValueError: `value` is not a number (a bool is not) > 0, finite unless
      `finite=False`, nor an allowed None.
  """
  if value is None and or_none:
    return
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or (finite and not math.isfinite(value)) or not value > 0):
    raise ValueError(f"{name} must be a number of seconds > 0"
                     f"{' or None' if or_none else ''}, got {value!r}")


def check_at_most(low_name: str, low: Any, high_name: str,
                  high: Any) -> None:
  """Checks that two bounds given (neither None) are in order.

  Raises:
    ValueError: `low` is above `high`.
  """
  if low is not None and high is not None and low > high:
    raise ValueError(f"{low_name}={low} is above {high_name}={high}")
