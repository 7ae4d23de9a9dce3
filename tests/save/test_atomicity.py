"""Tests of atomicity: step names, modes, unfinished entries, deletion."""

import json
import os

from etils import epath
import pytest

import flax_ckpt_plugin
from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin import Storage

from helpers import entries


def _finalized(directory: epath.Path, step_name: str) -> epath.Path:
  """A directory that carries the commit marker, as a finished save leaves."""
  step_dir = directory / step_name
  step_dir.mkdir(parents=True)
  (step_dir / "manifest.json").write_text("{}")
  (step_dir / atomicity.COMMIT_MARKER).write_text("{}")
  return step_dir


@pytest.mark.parametrize("name, step", [
    ("0", 0), ("7", 7), ("12", 12), ("123456789012", 123456789012),
])
def test_step_from_name_accepts_canonical_decimal(name, step):
  assert atomicity.step_from_name(name) == step


@pytest.mark.parametrize("name", [
    "", "007", "00", "-1", "+5", "10abc", "5.partial", "3.deleting", "1e3",
    " 1", "1 ", "notes.txt", "\u0661\u0662",  # Arabic-Indic digits.
    "\u00b2",  # Superscript two: isdigit() but not a step.
])
def test_step_from_name_rejects_everything_else(name):
  assert atomicity.step_from_name(name) is None


@pytest.mark.parametrize("directory, mode, resolved", [
    ("/tmp/ckpt", "auto", "rename"),
    ("relative/ckpt", "auto", "rename"),
    ("gs://bucket/ckpt", "auto", "commit_file"),
    ("s3://bucket/ckpt", "auto", "commit_file"),
    ("/tmp/ckpt", "rename", "rename"),
    ("/tmp/ckpt", "commit_file", "commit_file"),
    ("gs://bucket/ckpt", "commit_file", "commit_file"),
])
def test_resolve_atomicity(directory, mode, resolved):
  assert atomicity.resolve_atomicity(directory, mode) == resolved


def test_rename_on_object_store_raises():
  with pytest.raises(ValueError, match="commit_file"):
    atomicity.resolve_atomicity("gs://bucket/ckpt", "rename")


def test_manager_refuses_rename_on_object_store_before_touching_it():
  # Raised while validating options: no bucket is ever contacted.
  with pytest.raises(ValueError, match="gs://bucket/ckpt"):
    flax_ckpt_plugin.CheckpointManager("gs://bucket/ckpt",
                                       storage=Storage(atomicity="rename"))


def test_unknown_atomicity_raises():
  with pytest.raises(ValueError, match="'copy'"):
    atomicity.resolve_atomicity("/tmp/ckpt", "copy")


def test_temporary_path_per_mode(tmp_path):
  directory = epath.Path(tmp_path)
  rename = atomicity.temporary_path(directory, 3, "rename")
  commit = atomicity.temporary_path(directory, 3, "commit_file")
  assert rename.path == directory / "3.partial"
  assert rename.final == directory / "3"
  assert commit.path == directory / "3"
  assert commit.final == directory / "3"


def _mixed_directory(directory: epath.Path) -> None:
  """Two finalized steps, three unfinished ones and three unrelated entries."""
  _finalized(directory, "1")
  _finalized(directory, "2")
  # A crash while writing (rename mode), with a marker already inside.
  _finalized(directory, "5.partial")
  # A crash while writing (commit-file mode): data but no marker.
  (directory / "7" / "data").mkdir(parents=True)
  (directory / "7" / "manifest.json").write_text("{}")
  # A crash while deleting.
  _finalized(directory, "3.deleting")
  # Not ours, even though two of them carry a marker.
  (directory / "notes.txt").write_text("keep me")
  _finalized(directory, "10abc")
  _finalized(directory, "007")


def test_unfinished_entries_are_never_listed(tmp_path):
  directory = epath.Path(tmp_path)
  _mixed_directory(directory)
  assert directory_lib.finalized_steps(directory) == [1, 2]
  assert {p.name for p in directory_lib.unfinished_entries(directory)} == {
      "5.partial", "7", "3.deleting"}


def test_remove_unfinished_leaves_unrelated_entries(tmp_path):
  directory = epath.Path(tmp_path)
  _mixed_directory(directory)
  removed = directory_lib.remove_unfinished(directory)
  assert {p.name for p in removed} == {"5.partial", "7", "3.deleting"}
  assert entries(directory) == {"1", "2", "notes.txt", "10abc", "007"}
  assert (directory / "notes.txt").read_text() == "keep me"
  assert directory_lib.finalized_steps(directory) == [1, 2]


def test_manager_open_removes_unfinished_and_keeps_the_rest(tmp_path):
  directory = epath.Path(tmp_path)
  _mixed_directory(directory)
  manager = flax_ckpt_plugin.CheckpointManager(tmp_path)
  assert manager.all_steps() == [1, 2]
  assert entries(directory) == {"1", "2", "notes.txt", "10abc", "007"}
  manager.close()


def test_missing_directory_has_no_steps(tmp_path):
  directory = epath.Path(tmp_path) / "absent"
  assert directory_lib.finalized_steps(directory) == []
  assert directory_lib.unfinished_entries(directory) == []


def test_delete_step_leaves_nothing_that_looks_finalized(tmp_path):
  directory = epath.Path(tmp_path)
  _finalized(directory, "4")
  _finalized(directory, "6")
  directory_lib.delete_step(directory, 4)
  assert entries(directory) == {"6"}
  assert directory_lib.finalized_steps(directory) == [6]


def test_delete_step_interrupted_after_rename_is_not_finalized(tmp_path):
  """Fault injected: the recursive removal after the rename fails.

  That is the state a crash half way through a deletion leaves.
  """
  directory = epath.Path(tmp_path)
  _finalized(directory, "4")
  calls = []

  class CrashingRemove(backend_lib.LocalBackend):

    def remove(self, path):
      calls.append(path.name)
      if len(calls) == 2:  # The first call clears a stale '.deleting'.
        raise OSError("crash during rmtree")
      super().remove(path)

  with pytest.raises(OSError, match="crash during rmtree"):
    directory_lib.delete_step(directory, 4, CrashingRemove())

  assert entries(directory) == {"4.deleting"}
  assert directory_lib.finalized_steps(directory) == []
  assert directory_lib.remove_unfinished(directory) == [directory / "4.deleting"]
  assert entries(directory) == set()


def test_delete_step_on_object_store_removes_marker_first(tmp_path):
  """Fault injected: the object-store backend works on a local directory, and
  the removal of the step's files fails after the marker is gone."""
  directory = epath.Path(tmp_path)
  step_dir = _finalized(directory, "4")

  class Unavailable(backend_lib.ObjectStoreBackend):

    def remove(self, path):
      raise OSError(f"503 while removing {path}")

  with pytest.raises(OSError, match="503"):
    directory_lib.delete_step(directory, 4, Unavailable())
  assert not (step_dir / atomicity.COMMIT_MARKER).exists()
  assert directory_lib.finalized_steps(directory) == []


@pytest.mark.parametrize("mode", ["rename", "commit_file"])
def test_prepare_refuses_to_overwrite_finalized_step(tmp_path, mode):
  directory = epath.Path(tmp_path)
  step_dir = _finalized(directory, "3")
  before = (step_dir / "manifest.json").read_text()
  tmp = atomicity.temporary_path(directory, 3, mode)
  with pytest.raises(FileExistsError, match="step 3 is already finalized"):
    tmp.prepare()
  assert (step_dir / "manifest.json").read_text() == before
  assert directory_lib.is_finalized(step_dir)


@pytest.mark.parametrize("mode", ["rename", "commit_file"])
def test_prepare_replaces_leftovers_of_a_crashed_attempt(tmp_path, mode):
  directory = epath.Path(tmp_path)
  tmp = atomicity.temporary_path(directory, 3, mode)
  (tmp.path / "data").mkdir(parents=True)
  (tmp.path / "data" / "process_00000.bin").write_bytes(b"stale")
  tmp.prepare()
  assert tmp.path.is_dir()
  assert list(tmp.path.iterdir()) == []


@pytest.mark.parametrize("mode", ["rename", "commit_file"])
def test_finalize_writes_marker_and_makes_step_visible(tmp_path, mode):
  directory = epath.Path(tmp_path)
  tmp = atomicity.temporary_path(directory, 8, mode)
  tmp.prepare()
  (tmp.path / "manifest.json").write_text("{}")
  assert directory_lib.finalized_steps(directory) == []
  tmp.finalize()
  assert directory_lib.finalized_steps(directory) == [8]
  assert entries(directory) == {"8"}
  marker = json.loads((directory / "8" / atomicity.COMMIT_MARKER).read_text())
  assert marker["step"] == 8


def test_rename_finalize_refuses_when_final_appeared(tmp_path):
  directory = epath.Path(tmp_path)
  tmp = atomicity.temporary_path(directory, 2, "rename")
  tmp.prepare()
  (tmp.path / "manifest.json").write_text('{"mine": true}')
  other = _finalized(directory, "2")  # Another writer finished first.
  with pytest.raises(FileExistsError, match="appeared"):
    tmp.finalize()
  assert (other / "manifest.json").read_text() == "{}"


def test_abandon_removes_working_directory(tmp_path):
  directory = epath.Path(tmp_path)
  tmp = atomicity.temporary_path(directory, 2, "rename")
  tmp.prepare()
  (tmp.path / "half.bin").write_bytes(b"x" * 10)
  tmp.abandon()
  assert not os.path.exists(tmp.path)
  assert entries(directory) == set()
