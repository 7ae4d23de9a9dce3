"""A checkpoint step becomes visible all at once or not at all.

Two ways, chosen by path scheme or by option:

* *atomic rename* (POSIX filesystems): every process writes into
  `<step>.partial`; the primary host writes the commit marker, fsyncs, and
  renames the directory to `<step>`, then fsyncs the parent.
* *commit file* (object stores such as `gs://` and `s3://`, which have no
  atomic rename): every process writes into `<step>` itself; the primary host
  writes the commit marker last.

In both modes a step is finalized if and only if `<step>/_COMMITTED` exists, so
a finalized step copied between a filesystem and a bucket stays finalized.
Anything else that looks like ours (`<step>` without the marker,
`<step>.partial`, `<step>.deleting`) is unfinished: never listed, never
restored, and removed by the primary host when a manager opens the directory.

Object-store paths go through fsspec (`s3fs`, `gcsfs`) whatever else is
installed: see `object_store.as_path`.
"""

from __future__ import annotations

import abc
import datetime
import json
import os
import uuid
from typing import Literal

from etils import epath

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.format.directory import backend_of
from flax_ckpt_plugin.format.directory import is_finalized
from flax_ckpt_plugin.backends.layout import ATTEMPT_FILE
from flax_ckpt_plugin.backends.layout import COMMIT_MARKER
from flax_ckpt_plugin.backends.layout import DAMAGED_SUFFIX
from flax_ckpt_plugin.backends.layout import DELETING_SUFFIX
from flax_ckpt_plugin.backends.layout import step_from_name
from flax_ckpt_plugin.backends.layout import TMP_SUFFIX
from flax_ckpt_plugin.backends.layout import WRITER_FILE

__all__ = [  # The layout's names are used through this module too.
    "ATTEMPT_FILE", "COMMIT_MARKER", "DAMAGED_SUFFIX", "DELETING_SUFFIX",
    "TMP_SUFFIX", "WRITER_FILE", "step_from_name",
]

Atomicity = Literal["auto", "rename", "commit_file"]
Backend = interface.Backend


def resolve_atomicity(directory: epath.PathLike, atomicity: Atomicity,
                      backend: Backend | None = None) -> str:
  """'rename' where the storage renames atomically, else 'commit_file'."""
  backend = backend_of(directory, backend)
  if atomicity == "auto":
    return "rename" if backend.rename_is_atomic else "commit_file"
  if atomicity not in ("rename", "commit_file"):
    raise ValueError(
        f"atomicity must be 'auto', 'rename' or 'commit_file', got"
        f" {atomicity!r}")
  if atomicity == "rename" and not backend.rename_is_atomic:
    raise ValueError(
        f"atomicity='rename' needs a local filesystem; {directory} is an"
        " object store without atomic rename: use 'commit_file'.")
  return atomicity


def _marker_text(step: int) -> str:
  now = datetime.datetime.now(datetime.timezone.utc)
  return json.dumps({"step": step, "committed_at": now.isoformat()}) + "\n"


class TemporaryPath(abc.ABC):
  """Where one step is written before it becomes visible.

  Every process writes its files under `path`; only the primary host calls
  `prepare` (before anyone writes), `finalize` (after everyone wrote) and
  `abandon` (after a failed save).
  """

  def __init__(self, final: epath.Path, step: int,
               backend: Backend | None = None):
    self.final = final
    self.step = step
    self.backend = backend_of(final, backend)
    self.prepared = False  # Set once `prepare` made `path` ours.
    # The identity of the directory `prepare` made, where the storage has
    # one (inodes). A held handle keeps it from being reused, so a directory
    # of the same name made by another writer is never taken for ours.
    self.identity: interface.Identity | None = None
    self._handle: int | None = None

  def _hold(self) -> None:
    """Records the identity of the freshly made `path`."""
    self.prepared = True
    self._handle, self.identity = self.backend.hold(self.path)

  def _release(self) -> None:
    self.backend.release(self._handle)
    self._handle = None

  def is_ours(self) -> bool:
    """Whether `path` is still the directory that `prepare` made."""
    if not self.prepared:
      return False
    if self.identity is None:
      return True  # No identity to compare.
    try:
      return self.backend.identity(self.path) == self.identity
    except FileNotFoundError:
      return False

  @property
  @abc.abstractmethod
  def path(self) -> epath.Path:
    """The directory every process writes into."""

  def prepare(self) -> None:
    """Creates an empty `path`, removing leftovers of a crashed attempt."""
    if is_finalized(self.final):
      raise FileExistsError(
          f"step {self.step} is already finalized at {self.final}; refusing"
          " to overwrite it.")
    self.backend.remove(self.path)
    self.path.mkdir(parents=True, exist_ok=False)
    self._hold()

  @abc.abstractmethod
  def finalize(self) -> None:
    """Makes the step visible; the commit marker is the last thing written."""

  def abandon(self) -> None:
    """Removes what a failed save left behind (best effort).

    Only the directory this object prepared, and never a finalized step: a
    save that failed because the step exists must not delete the step, and
    an old job whose directory was taken over must not delete the new job's.
    """
    try:
      if self.is_ours() and not is_finalized(self.path):
        self.backend.remove(self.path)
    except OSError:
      pass
    finally:
      self._release()


class AtomicRenamePath(TemporaryPath):
  """Write into `<step>.partial`, then rename to `<step>`."""

  @property
  def path(self) -> epath.Path:
    return self.final.parent / (self.final.name + TMP_SUFFIX)

  def finalize(self) -> None:
    self.backend.write_small(self.path / COMMIT_MARKER,
                             _marker_text(self.step))
    self.backend.fsync(self.path)
    if self.final.exists():
      raise FileExistsError(
          f"cannot finalize step {self.step}: {self.final} appeared while it"
          " was being written (another writer on this directory?).")
    if not self.is_ours():
      raise FileExistsError(
          f"cannot finalize step {self.step}: {self.path} was replaced while"
          " it was being written (another writer on this directory?).")
    os.rename(os.fspath(self.path), os.fspath(self.final))
    self.backend.fsync(self.final.parent)
    self._release()


class CommitFilePath(TemporaryPath):
  """Write into `<step>`, then write `<step>/_COMMITTED` last.

  Where a directory has no identity (object stores), `prepare` writes a
  random token to `<step>/_ATTEMPT`: if another writer prepares the same
  step meanwhile (replacing the prefix and the token), this attempt neither
  finalizes nor, when abandoned, deletes the other's files. The token is
  removed once the marker is written.
  """

  _attempt: str | None = None  # The token in `_ATTEMPT`.

  @property
  def path(self) -> epath.Path:
    return self.final

  def prepare(self) -> None:
    # The final directory is the working directory here: a leftover without
    # the marker is an unfinished attempt and is replaced.
    if is_finalized(self.final):
      raise FileExistsError(
          f"step {self.step} is already finalized at {self.final}; refusing"
          " to overwrite it.")
    self.backend.remove(self.final)
    self.final.mkdir(parents=True, exist_ok=True)
    self.backend.fsync(self.final.parent)
    self._hold()
    if self.identity is None:
      attempt = uuid.uuid4().hex
      self.backend.write_small(self.final / ATTEMPT_FILE, attempt)
      self._attempt = attempt

  def is_ours(self) -> bool:
    if self._attempt is None:
      return super().is_ours()
    try:
      token = self.backend.read_small(self.final / ATTEMPT_FILE,
                                      within=self.final,
                                      limit=interface.MAX_MARKER_BYTES)
    except (FileNotFoundError, ValueError):  # Not a small file: not ours.
      return False
    return token == self._attempt.encode()

  def finalize(self) -> None:
    if not self.is_ours():
      raise FileExistsError(
          f"cannot finalize step {self.step}: {self.final} was replaced while"
          " it was being written (another writer on this directory?).")
    self.backend.write_small(self.final / COMMIT_MARKER,
                             _marker_text(self.step))
    self.backend.fsync(self.final)  # The marker's directory entry, too.
    if self._attempt is not None:
      # Finalized steps look the same on every store; a crash before this
      # leaves a harmless extra object.
      (self.final / ATTEMPT_FILE).unlink(missing_ok=True)
    self._release()


def temporary_path(directory: epath.Path, step: int, atomicity: str,
                   backend: Backend | None = None) -> TemporaryPath:
  """The temporary path for `step` under the resolved `atomicity` mode."""
  final = directory / str(step)
  if atomicity == "rename":
    return AtomicRenamePath(final, step, backend)
  if atomicity == "commit_file":
    return CommitFilePath(final, step, backend)
  raise ValueError(f"unknown atomicity {atomicity!r}")
