"""What a user sees over a manager's lifetime: readers that follow a writer,
and programs that exit without `close()`."""

import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_read_only_manager_sees_steps_finalized_after_it_opened(ckpt_dir):
  """A read-only manager lists the steps anew, not once when it opens, so an
  evaluation job sees the training job's new steps."""
  state = {"w": np.arange(6, dtype=np.float32)}
  with CheckpointManager(ckpt_dir) as writer:
    writer.save(1, state)
    writer.wait_until_finished()
    reader = CheckpointManager(ckpt_dir, read_only=True)
    assert reader.latest_step() == 1
    writer.save(2, {"w": state["w"] + 1})
    writer.wait_until_finished()
    assert reader.latest_step() == 2
    assert reader.all_steps() == [1, 2]
    np.testing.assert_array_equal(reader.restore(state)["w"], state["w"] + 1)
    assert reader.restore_newest_valid(state)[0] == 2
    reader.close()


_EXIT_WITHOUT_CLOSE = textwrap.dedent("""
    import sys, time
    import numpy as np
    from flax_ckpt_plugin import CheckpointManager
    from flax_ckpt_plugin.save import writer
    directory, fail = sys.argv[1], sys.argv[2] == "fail"
    if fail:  # Fault injected: the write fails in the background.
      def broken(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")
      writer.write_process_files = broken
    real = writer.write_process_files
    def slow(*args, **kwargs):  # Still writing when the script ends.
      time.sleep(1.0)
      return real(*args, **kwargs)
    writer.write_process_files = slow
    mgr = CheckpointManager(directory)
    mgr.save(7, {"w": np.arange(1000, dtype=np.float32)})
    print("script done", flush=True)
""")


@pytest.mark.multiprocess
def test_exit_without_close_still_finalizes_the_last_save(tmp_path):
  """The commit thread is no daemon: a process that exits without `close`
  finalizes the step it saved, rather than exiting 0 with that step
  silently missing."""
  directory = tmp_path / "ckpt"
  result = subprocess.run(
      [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(directory), "ok"],
      capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False)
  assert result.returncode == 0, result.stderr
  assert "script done" in result.stdout
  with CheckpointManager(directory, read_only=True) as reader:
    assert reader.all_steps() == [7]
    np.testing.assert_array_equal(
        reader.restore({"w": np.zeros(1000, np.float32)})["w"],
        np.arange(1000, dtype=np.float32))


@pytest.mark.multiprocess
def test_exit_without_close_after_a_failed_save_exits_non_zero(tmp_path):
  directory = tmp_path / "ckpt"
  result = subprocess.run(
      [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(directory), "fail"],
      capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False)
  assert result.returncode == 1, (result.returncode, result.stderr)
  assert "No space left on device (injected)" in result.stderr
  assert "step 7" in result.stderr
  assert not (directory / "7").exists()
