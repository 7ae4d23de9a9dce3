"""The checkpoint directory: its writer's claim (`_WRITER`) and its entries.

A deleted directory is claimed again, an unreadable claim is an error, links
named like steps are skipped, and an error's note says whether its step was
finalized.
"""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import ConcurrentWriterError
from flax_ckpt_plugin import Storage
from helpers import FlakyDisk
from helpers import save_each as _save
from helpers import sorted_entries


@pytest.mark.parametrize("recreate", [True, False])
def test_a_deleted_directory_is_claimed_again(ckpt_dir, recreate):
  """A save after the checkpoint directory is deleted (and made anew)
  claims it again: no later save raises `ConcurrentWriterError ... (its
  claim: None)`."""
  with CheckpointManager(ckpt_dir, max_to_keep=2) as mgr:
    mgr.save(1, {"w": np.ones(3)})
    mgr.wait_until_finished()
    shutil.rmtree(ckpt_dir)
    if recreate:
      ckpt_dir.mkdir()
    for step in (2, 3, 4):
      mgr.save(step, {"w": np.full(3, step)})
      mgr.wait_until_finished()
    assert mgr.all_steps() == [3, 4]
    token = mgr.name.rsplit("/", 1)[1]
  assert sorted_entries(ckpt_dir) == ["3", "4"]
  claim = json.loads((ckpt_dir / "_WRITER").read_text())
  assert claim["token"] == token


class _NoDeletes(backend_lib.LocalBackend):
  """Retention fails (injected: a real disk refuses no unlink as root)."""

  def delete_step(self, directory, step):
    raise PermissionError(f"cannot delete step {step} (injected)")


def test_error_notes_tell_whether_the_step_was_finalized(ckpt_dir):
  """A background error's note says whether its step was finalized: a
  retention error after the step was does not say "That step was not
  finalized"."""
  mgr = CheckpointManager(ckpt_dir, max_to_keep=1,
                          storage=Storage(backend=_NoDeletes()))
  mgr.save(1, {"w": np.ones(3)})
  mgr.save(2, {"w": np.ones(3)})
  mgr.wait_until_finished()  # Step 1's delete failed, in the background.
  mgr.save(3, {"w": np.ones(3)})  # Its retention raises that failure.
  with pytest.raises(PermissionError) as info:
    mgr.wait_until_finished()
  notes = " ".join(info.value.__notes__)
  assert f"Step 3 is finalized in {ckpt_dir}." in notes, notes
  assert (f"Retention after step 2 could not delete steps [1] of {ckpt_dir}"
          in notes), notes
  assert "not finalized" not in notes
  with pytest.raises(PermissionError, match="cannot delete step 2"):
    mgr.close()  # Step 2's delete, queued by step 3's retention.
  flaky = FlakyDisk()
  with CheckpointManager(ckpt_dir, storage=Storage(backend=flaky)) as mgr:
    flaky.on_fire = True
    mgr.save(9, {"w": np.ones(3)})
    with pytest.raises(OSError) as info:
      mgr.wait_until_finished()
    assert "Step 9 was not finalized." in info.value.__notes__, info.value
    flaky.on_fire = False


def test_symlinked_step_entries_are_skipped_with_a_warning(
    tmp_path, caplog):
  """A symbolic link named like a step (to a step elsewhere) or like
  `<n>.partial` is ignored with a warning, and nothing it points to is
  touched: neither retention nor a later writing open fails on it
  (removing it would raise)."""
  elsewhere = tmp_path / "elsewhere"
  _save(elsewhere, {"w": np.ones(3)}, {"w": np.ones(3)})
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "1").symlink_to(elsewhere / "1")
  (ckpt / "7.partial").symlink_to(elsewhere / "2")
  with caplog.at_level(logging.WARNING, logger="flax_ckpt_plugin"):
    with CheckpointManager(ckpt, max_to_keep=1) as mgr:
      assert mgr.all_steps() == []
      for step in (2, 3):
        mgr.save(step, {"w": np.full(3, step)})
        mgr.wait_until_finished()
      assert mgr.all_steps() == [3]
  assert sorted_entries(ckpt) == ["1", "3", "7.partial"]
  assert sorted_entries(elsewhere) == ["1", "2"]
  assert "symbolic link" in caplog.text and "7.partial" in caplog.text


def test_an_unreadable_claim_is_not_taken_for_a_deleted_one(ckpt_dir):
  """A claim that exists but cannot be read (replaced by hand) is an error,
  not a reason to claim the directory over it."""
  with CheckpointManager(ckpt_dir) as mgr:
    (ckpt_dir / "_WRITER").write_text("not json")
    mgr.save(1, {"w": np.ones(3)})
    with pytest.raises(ConcurrentWriterError, match="cannot be read"):
      mgr.wait_until_finished()
  assert (ckpt_dir / "_WRITER").read_text() == "not json"
