"""Durability: a save fsyncs its files and directories in an order that makes
the commit marker the last thing to become durable, in rename and in
commit-file mode.
"""

from __future__ import annotations

import os

import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import Storage
from helpers import small_state as _small_state

DATA = "data/process_00000.bin"


@pytest.fixture
def fsync_log(monkeypatch):
  """Records every os.fsync (by the path of its fd) and os.rename, in order.

  A spy, not a fault: the real calls still run.
  """
  events = []
  real_fsync, real_rename = os.fsync, os.rename

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return real_fsync(fd)

  def rename(src, dst, *args, **kwargs):
    events.append(("rename", os.fspath(src), os.fspath(dst)))
    return real_rename(src, dst, *args, **kwargs)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "rename", rename)
  return events


def _last(events: list, event: tuple) -> int:
  assert event in events, f"{event} not in {events}"
  return max(i for i, e in enumerate(events) if e == event)


def _first_after(events: list, event: tuple, start: int) -> int:
  later = [i for i, e in enumerate(events) if e == event and i > start]
  assert later, f"{event} not after event {start}: {events}"
  return later[0]


def test_rename_mode_fsyncs_data_manifest_marker_and_directories_in_order(
    ckpt_dir, fsync_log):
  """Before the rename, everything in `<step>.partial` is durable.

  The data file, the manifest, the `data/` and step directories and then the
  commit marker are fsynced; the step directory again (so the marker's entry
  is durable) before the rename; the parent directory after it (so the
  rename is). Nothing becomes durable as finalized before its data.
  """
  manager = CheckpointManager(ckpt_dir)
  del fsync_log[:]  # The claim of the directory at open is not a save.
  manager.save(1, _small_state(1))
  manager.close()
  top = os.path.realpath(ckpt_dir)
  tmp, final = f"{top}/1.partial", f"{top}/1"
  events = fsync_log
  data = _last(events, ("fsync", f"{tmp}/{DATA}"))
  manifest = _last(events, ("fsync", f"{tmp}/manifest.json"))
  data_dir = _last(events, ("fsync", f"{tmp}/data"))
  marker = _last(events, ("fsync", f"{tmp}/_COMMITTED"))
  renamed = _last(events, ("rename", tmp, final))
  step_dir = _first_after(events, ("fsync", tmp), marker)
  parent = _first_after(events, ("fsync", top), renamed)
  assert data < manifest < marker, events
  assert data_dir < marker, events
  assert marker < step_dir < renamed < parent, events


def test_commit_file_mode_makes_the_marker_entry_durable(ckpt_dir,
                                                         fsync_log):
  """commit_file on a local disk: the marker's directory entry is fsynced.

  The marker is the last file written; fsyncing the file alone does not make
  its name durable, so after it the step directory must be fsynced, and the
  parent directory since the step directory was created, or a power cut
  after `save` finished (and after retention deleted older steps) could
  leave no finalized step at all.
  """
  manager = CheckpointManager(ckpt_dir, storage=Storage(atomicity="commit_file"))
  del fsync_log[:]
  manager.save(1, _small_state(1))
  manager.close()
  top = os.path.realpath(ckpt_dir)
  final = f"{top}/1"
  events = fsync_log
  data = _last(events, ("fsync", f"{final}/{DATA}"))
  manifest = _last(events, ("fsync", f"{final}/manifest.json"))
  marker = _last(events, ("fsync", f"{final}/_COMMITTED"))
  assert data < manifest < marker, events
  _first_after(events, ("fsync", final), marker)
  assert ("fsync", top) in events, events
