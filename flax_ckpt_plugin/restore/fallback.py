"""Restoring the newest step that every process can restore.

A step that is damaged (a checksum mismatch, a missing or truncated file) on
any process is skipped and the next older one is tried; so is one whose
bytes the storage failed to read (`errors.READ_FAILED`: an I/O error; or
did not answer in time: `StorageTimeoutError`), but that one is kept, not
set aside. Any other error on
any process (a permission error, a target that does not fit the saved tree,
a mesh error) ends the search on every process at once: each try is a
`meetings.agree`, so all processes learn together how it went on each of
them, instead of the others waiting out the barrier timeout.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from etils import epath

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import READ_FAILED
from flax_ckpt_plugin.errors import RestoreFailedError
from flax_ckpt_plugin.deadlines import StorageTimeoutError
from flax_ckpt_plugin.errors import Unsuitable
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import keys


class _Damaged(Exception):
  """A step's files are damaged here: skip it (the original is its cause)."""


class _Unsuitable(Exception):
  """`Unsuitable` here: skip the step, but it is not damaged."""


_SKIPPED = (_Damaged.__name__, _Unsuitable.__name__)


def _restore_or_mark(restore: Callable[[int], Any], step: int) -> Any:
  try:
    return restore(step)
  except Unsuitable as e:
    raise _Unsuitable(str(e)) from e
  except (CheckpointCorruptedError, FileNotFoundError) as e:
    raise _Damaged(str(e)) from e
  except StorageTimeoutError as e:
    raise _Unsuitable(str(e)) from e  # Unanswered here, now: kept.
  except OSError as e:
    if e.errno not in READ_FAILED:
      raise
    raise _Unsuitable(str(e)) from e  # Unread here, now: skipped, kept.


def restore_newest(meeting: meetings.Meeting, *,
                   steps: Callable[[], list[int]],
                   restore: Callable[[int], Any], is_primary: bool, where: str
                   ) -> tuple[tuple[int, Any] | None, list[int]]:
  """Tries the finalized steps, newest first, on every process.

  Args:
    coord: how processes meet.
    key: a prefix of keys no earlier call used (same on every process).
    steps: lists the finalized steps; only the primary host's list is used.
    restore: restores one step on this process.
    is_primary: whether this process lists the steps for all.
    timeout_ms: how long to wait for the others at each try.
    where: the directory, for messages.

  Returns:
    ((step, restored), skipped damaged steps), or (None, []) when there is
    no finalized step.

  Raises:
    CheckpointCorruptedError: every finalized step is damaged somewhere.
    RestoreFailedError: another process failed for another reason.
    Exception: this process's own error, when it is not damage.
  """
  coord = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  if coord.process_count == 1:
    candidates = steps()
  elif is_primary:
    candidates = steps()
    coord.kv_set(keys.child(key, "steps"), json.dumps(candidates))
  else:
    candidates = json.loads(coord.kv_get(keys.child(key, "steps"),
                                         timeout_ms=timeout_ms))
  return try_in_turn(meeting, list(reversed(candidates)), restore, where=where)


def try_in_turn(meeting: meetings.Meeting, candidates: list[Any],
                restore: Callable[[Any], Any], *, where: str,
                describe: Callable[[Any], str] = "step {}".format
                ) -> tuple[tuple[Any, Any] | None, list[Any]]:
  """Restores the first candidate that restores on every process.

  Every process passes the same `candidates` (steps, or (step, tier)
  pairs), best first; a candidate damaged, missing or `Unsuitable` on any
  process is skipped (only damaged or missing ones are returned as
  skipped). See `restore_newest` for the rest.
  """
  coord = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  skipped, why = [], []
  for n, candidate in enumerate(candidates):
    outcome = meetings.agree(
        meetings.Meeting(coord, keys.child(key, f"try{n}"), timeout_ms),
        lambda c=candidate: _restore_or_mark(restore, c))
    if not outcome.failures:
      return (candidate, outcome.result), skipped
    name = describe(candidate)
    if outcome.error is not None and not isinstance(
        outcome.error, (_Damaged, _Unsuitable)):
      raise outcome.error
    elsewhere = outcome.failed_elsewhere(coord.process_index)
    others = {p: f for p, f in elsewhere.items() if f[0] not in _SKIPPED}
    if others:
      raise RestoreFailedError(
          f"restoring {name} of {where} failed on other processes, so"
          " no process restores it:"
          f" {meetings.describe_failures(others)}")
    reason = (str(outcome.error) if outcome.error is not None else
              "damaged or missing on other processes: " + "; ".join(
                  f"process {p}: {m}" for p, (_, m) in sorted(
                      elsewhere.items())))
    log.warning("skipping %s of %s: %s", name, where, reason)
    if isinstance(outcome.error, _Damaged) or any(
        f[0] == _Damaged.__name__ for f in elsewhere.values()):
      skipped.append(candidate)
    why.append(f"{name}: {reason}")
    # Before the next try: the error's frames hold what this one read into
    # (on an accelerator, its window of pinned buffers).
    del outcome
  if why:
    raise CheckpointCorruptedError(
        f"no finalized step in {where} restores: " + "; ".join(why))
  return None, []


def set_aside(directory: epath.Path, steps: list[int],
              backend: interface.Backend) -> None:
  """Primary host: sets damaged steps aside (see `directory.set_aside`).

  A step that cannot be set aside is left where it is, with a warning: the
  restore it was skipped by still succeeded.
  """
  for step in steps:
    try:
      aside = directory_lib.set_aside(directory, step, backend)
      log.warning("damaged step %d of %s set aside: %s", step, directory,
                  aside)
    except OSError as e:
      log.warning("could not set damaged step %d of %s aside: %r", step,
                  directory, e)
