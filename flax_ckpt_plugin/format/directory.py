"""The checkpoint directory: which entries are steps, and who writes it.

A step is finalized if and only if `<step>/_COMMITTED` exists; anything else
that looks like ours (`<step>` without the marker, `<step>.partial`,
`<step>.deleting`) is unfinished: never listed, never restored, and removed
by the primary host when a manager opens the directory (see `atomicity` for
how a step becomes final). Steps are deleted so that a crash half way never
looks final, and a damaged one is set aside. A writer claims the directory
when it opens it (`_WRITER`), and checks before each finalize that no other
job took it since.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import uuid
from typing import Any, Callable

from etils import epath

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.backends.layout import COMMIT_MARKER
from flax_ckpt_plugin.backends.layout import DELETING_SUFFIX
from flax_ckpt_plugin.backends.layout import step_from_name
from flax_ckpt_plugin.backends.layout import TMP_SUFFIX
from flax_ckpt_plugin.backends.layout import WRITER_FILE
from flax_ckpt_plugin.errors import ConcurrentWriterError
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.errors import NOT_A_FILE

Backend = interface.Backend


def backend_of(path: epath.PathLike, backend: Backend | None) -> Backend:
  """`backend`, or the one `path`'s scheme names."""
  return backend if backend is not None else interface.for_path(path)


def is_finalized(step_dir: epath.Path) -> bool:
  return (step_dir / COMMIT_MARKER).exists()


_warned_links: set[str] = set()


def _entries(directory: epath.Path) -> list[epath.Path]:
  """The entries of `directory`, but symbolic links (warned about once).

  A link named like a step is not one of ours: listing it would make
  retention delete, or a writer clean up, what it points to.
  """
  if not directory.exists():
    return []
  entries = []
  for entry in directory.iterdir():
    name = os.fspath(entry)
    if not os.path.islink(name):  # False for object stores' paths.
      entries.append(entry)
    elif name not in _warned_links and entry.name[:1].isdigit():
      _warned_links.add(name)
      log.warning("ignoring %s: a symbolic link, never a step of ours", name)
  return entries


def finalized_steps(directory: epath.Path) -> list[int]:
  """Sorted steps under `directory` that carry the commit marker."""
  steps = []
  for entry in _entries(directory):
    step = step_from_name(entry.name)
    if step is not None and is_finalized(entry):
      steps.append(step)
  return sorted(steps)


def unfinished_entries(directory: epath.Path) -> list[epath.Path]:
  """Entries that look like ours but are not finalized steps."""
  found = []
  for entry in _entries(directory):
    name = entry.name
    for suffix in (TMP_SUFFIX, DELETING_SUFFIX):
      if name.endswith(suffix) and step_from_name(name[:-len(suffix)]) is not None:
        found.append(entry)
        break
    else:
      if step_from_name(name) is not None and not is_finalized(entry):
        found.append(entry)
  return sorted(found)


def remove_unfinished(directory: epath.Path,
                      backend: Backend | None = None) -> list[epath.Path]:
  """Removes unfinished steps; called by the primary host only."""
  backend = backend_of(directory, backend)
  removed = unfinished_entries(directory)
  for entry in removed:
    backend.remove(entry)
  return removed


def delete_step(directory: epath.Path, step: int,
                backend: Backend | None = None) -> None:
  """Deletes a finalized step so that a crash half way never looks final.

  Local: rename to `<step>.deleting` (atomic), then remove. Object store:
  remove the commit marker first, then the rest. Primary host only.
  """
  backend_of(directory, backend).delete_step(directory, step)


def delete_steps(directory: epath.Path, steps: list[int],
                 still_writer: Callable[[str], None], backend: Backend) -> None:
  """Retention on the primary host: deletes `steps`, if still the writer.

  `still_writer(consequence)` is `check_still_writer` of this job's claim.
  """
  still_writer(f"steps {steps} were not deleted")
  for step in steps:
    backend.delete_step(directory, step)
    log.info("retention deleted step %d from %s", step, directory)


def set_aside(directory: epath.Path, step: int,
              backend: Backend | None = None) -> str:
  """Takes a damaged finalized step out of the list; says where it went.

  Local disks keep the files as `<step>.damaged` for a person to look at
  (neither a step nor unfinished, so never listed and never removed); on
  object stores the commit marker is removed, which makes the step
  unfinished, and the next writer cleans it up. Primary host only.
  """
  return backend_of(directory, backend).set_aside(directory, step)


def claim_directory(directory: epath.Path, process_count: int,
                    backend: Backend | None = None,
                    token: str | None = None) -> str:
  """Records this job as the directory's writer; returns its token.

  The newest claim wins: a job restarted after a preemption takes over at
  once, and a job whose directory was claimed by another (a second job
  started by mistake, or a restart while the old one still runs) sees that
  before it finalizes or deletes anything (`current_writer`).
  """
  token = token or uuid.uuid4().hex
  info = {"token": token, "host": socket.gethostname(), "pid": os.getpid(),
          "process_count": process_count,
          "opened": datetime.datetime.now(datetime.timezone.utc).isoformat()}
  backend_of(directory, backend).replace_small(directory / WRITER_FILE,
                                             json.dumps(info) + "\n")
  return token


def current_writer(directory: epath.Path,
                   backend: Backend | None = None) -> dict[str, Any] | None:
  """The last claim on `directory` (see `claim_directory`), if readable.

  A claim that is no small regular file of the directory (a named pipe, a
  link elsewhere, a huge file) is unreadable: None, at once.
  """
  try:
    raw = backend_of(directory, backend).read_small(
        directory / WRITER_FILE, within=directory,
        limit=interface.MAX_MARKER_BYTES)
    info = json.loads(raw.decode("utf-8"))
  except (FileNotFoundError, ValueError, RecursionError):
    return None
  except OSError as e:
    if e.errno not in NOT_A_FILE:
      raise
    return None  # A socket, or a loop of links.
  return info if isinstance(info, dict) else None


def check_still_writer(directory: epath.Path, token: str | None,
                       consequence: str, *, writer_count: int = 1,
                       backend: Backend | None = None) -> None:
  """Raises ConcurrentWriterError if another job claimed the directory.

  A directory without any claim (deleted and made anew) is claimed again.

  Args:
    directory: the checkpoint directory.
    token: this job's claim (from `claim_directory`).
    consequence: what was not done, for the message.
    writer_count: the job's process count, for a new claim.
    backend: the directory's storage.
  """
  writer = current_writer(directory, backend)
  if (writer is None and token is not None
      and not (directory / WRITER_FILE).exists()):
    # No claim at all: the directory was deleted (and maybe made anew) under
    # this job, and no other job opened it since. It is this job's again.
    log.warning("%s lost its writer's claim (deleted and made anew?);"
                " claiming it again", directory)
    directory.mkdir(parents=True, exist_ok=True)
    claim_directory(directory, writer_count, backend, token)
    return
  if writer is None:
    raise ConcurrentWriterError(
        f"the writer's claim {directory / WRITER_FILE} cannot be read (not a"
        f" small regular file of JSON); {consequence}. Was it replaced by"
        " hand or by another program?")
  if writer.get("token") != token:
    raise ConcurrentWriterError(
        f"another job opened {directory} for writing after this one"
        f" (its claim: {writer}); {consequence}. Two jobs must not write"
        " one directory: stop this one, or give it another directory.")
