"""A full disk: a save fails with ENOSPC at the next call, and an earlier
checkpoint is never lost.

Both tests run out of space for real, on an 8 MiB tmpfs (`small_tmpfs`).
"""

from __future__ import annotations

import errno
import os

import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from helpers import all_entries as _entries
from helpers import fill
from helpers import free_bytes
from helpers import restore_read_only as _restore
from helpers import sorted_entries


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_full_disk_fails_the_save_at_the_next_call_and_the_loop_recovers(
    small_tmpfs, assert_trees_equal, host_copy):
  """A save that runs out of space (a real ENOSPC from an 8 MiB tmpfs).

  The callback's save returns before writing; the write fails in the
  background; the next call into the callback raises that OSError, type and
  errno kept. The failed step leaves no `.partial` behind, the step before it
  restores bit for bit, and once space is freed the loop saves again.
  """
  ckpt = small_tmpfs / "ckpt"
  rng = np.random.default_rng(0)
  small = {"w": jnp.asarray(rng.standard_normal((64, 64), np.float32))}
  small_expected = host_copy(small)
  # 2 MiB: fits in the tmpfs, but not in what the filler leaves free.
  large = {"w": jnp.asarray(rng.standard_normal((512, 1024), np.float32))}
  large_expected = host_copy(large)

  cb = CheckpointCallback(ckpt, every_steps=1, max_to_keep=3)
  assert cb(1, small)
  cb.wait_until_finished()
  filler = small_tmpfs / "filler"
  fill(filler, free_bytes(small_tmpfs) - (1 << 20))
  assert free_bytes(small_tmpfs) < large["w"].nbytes

  assert cb(2, large)  # Only the host snapshot: the write runs behind.
  with pytest.raises(OSError) as info:
    cb(3, large)
  assert info.value.errno == errno.ENOSPC, info.value
  assert "ASYNCHRONOUSLY" in " ".join(info.value.__notes__)
  assert "step 2" in " ".join(info.value.__notes__)
  # Nothing of step 2 is left, step 3 was not started, step 1 is intact.
  assert _entries(ckpt) == ["1", "_WRITER"]
  assert cb.manager.all_steps() == [1]
  assert_trees_equal(cb.manager.restore({"w": jnp.zeros((64, 64))}, 1),
                     small_expected)

  os.remove(filler)
  assert cb(4, large)  # The error was raised once; the loop goes on.
  cb.close()
  assert _entries(ckpt) == ["1", "4", "_WRITER"]
  assert_trees_equal(_restore(ckpt, {"w": jnp.zeros((512, 1024))}, 4),
                     large_expected)


def test_a_full_disk_fails_a_save_with_enospc_never_a_json_error(small_tmpfs):
  """With the disk full at any point of a save, the write of a process's
  shard table is checked too (an unbuffered write may write part of it):
  every failing save, at every fill level, raises OSError(ENOSPC), never
  the primary host's JSONDecodeError of a part-written table, and the
  earlier step stays."""
  ckpt, filler = small_tmpfs / "ckpt", small_tmpfs / "filler"
  # Many tiny leaves: the shard table (tens of KiB) outweighs the data.
  state = {f"leaf_{i:03d}": np.full(2, i, np.float32) for i in range(300)}
  errors = []
  with CheckpointManager(ckpt, max_to_keep=1) as mgr:
    mgr.save(0, state)
    mgr.wait_until_finished()
    room = free_bytes(small_tmpfs)
    step = 1
    for left in range(0, 320 << 10, 4 << 10):
      fill(filler, room - left)
      try:
        mgr.save(step, state)
        mgr.wait_until_finished()
        step += 1
      except OSError as e:
        errors.append(e)
        assert e.errno == errno.ENOSPC, repr(e)
      except Exception as e:  # pylint: disable=broad-except
        pytest.fail(f"with {left} bytes free: {e!r}")
      finally:
        os.remove(filler)
    steps = mgr.all_steps()
  assert errors and step > 1  # Both outcomes were seen.
  assert sorted_entries(ckpt) == [str(steps[-1])]
