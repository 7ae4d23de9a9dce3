"""A restore of the newest step in the process that saved it takes the
bytes from the snapshot that process still holds (`backends.held`),
checked against the step's checksums, instead of reading the disk.

`RestoreStats.nbytes_from_memory` says how many bytes came from memory;
the values are compared bit for bit with what was saved.
"""

from __future__ import annotations

import threading

from etils import epath
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.manager.tier import TierManager
from flax_ckpt_plugin.arrays import copies as copies_lib
from flax_ckpt_plugin.arrays import pinned
from flax_ckpt_plugin.backends import held as held_lib
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.format import files
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.restore import window as window_lib
from helpers import adam_train_state
from helpers import two_device_mesh


def _state(seed: int) -> dict:
  """Leaves of the kinds a train state has: a matrix sharded over two
  devices (large enough for the staging's reused copies), a bfloat16
  vector, a jax scalar, numpy scalars and arrays, and Python numbers."""
  rng = np.random.default_rng(seed)
  mesh = two_device_mesh()
  return {
      "w": jax.device_put(rng.standard_normal((512, 1024), dtype=np.float32),
                          NamedSharding(mesh, P("x"))),
      "v": jnp.asarray(rng.standard_normal(37), jnp.bfloat16),
      "n": jnp.int32(seed),
      "np_scalar": np.float32(seed / 3),
      "np_array": rng.integers(0, 9, (5, 3), dtype=np.int64),
      "lr": 0.5,
  }


def _same(a, b) -> None:
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))
    if isinstance(y, jax.Array):
      assert x.sharding == y.sharding, jax.tree_util.keystr(path)


def _data_bytes(manager: CheckpointManager, step: int) -> int:
  return manager.metadata(step).total_bytes


def _from_memory(manager: CheckpointManager, step: int) -> bool:
  """Whether the last restore took the step's arrays from memory: every
  byte of the large matrix at least (the snapshot holds the staging and
  pinned copies; numpy leaves are copies freed with their save)."""
  got = manager.last_restore_stats.nbytes_from_memory
  return _state(0)["w"].nbytes <= got <= _data_bytes(manager, step)


def test_newest_step_restores_from_memory_bit_identical(ckpt_dir):
  with CheckpointManager(ckpt_dir) as manager:
    for step in (1, 2, 3):  # The first save's copies, then reused ones.
      state = _state(step)
      manager.save(step, state)
      manager.wait_until_finished()
      restored = manager.restore(jax.tree.map(lambda x: x, state))
      _same(restored, state)
      stats = manager.last_restore_stats
      assert stats.step == step
      assert _from_memory(manager, step)
    # Once read, the snapshot is let go: the next restore reads the disk.
    again = manager.restore(_state(0))
    _same(again, _state(3))
    assert manager.last_restore_stats.nbytes_from_memory == 0


def test_older_step_and_other_layouts_read_the_disk(ckpt_dir):
  """Only the newest step is held; the held one restores onto another
  layout too (a 2-D mesh, one device), from memory."""
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, _state(1))
    manager.wait_until_finished()
    manager.save(2, _state(2))
    manager.wait_until_finished()
    _same(manager.restore(_state(0), 1), _state(1))
    assert manager.last_restore_stats.nbytes_from_memory == 0
    manager.save(3, _state(3))
    manager.wait_until_finished()
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    target = _state(0)
    target["w"] = jax.ShapeDtypeStruct(
        (512, 1024), jnp.float32,
        sharding=NamedSharding(mesh, P("data", "model")))
    restored = manager.restore(target)
    np.testing.assert_array_equal(np.asarray(restored["w"]),
                                  np.asarray(_state(3)["w"]))
    assert restored["w"].sharding == target["w"].sharding
    assert manager.last_restore_stats.nbytes_from_memory > 0


def test_partial_restore_takes_only_its_leaves_from_memory(ckpt_dir):
  with CheckpointManager(ckpt_dir) as manager:
    state = _state(4)
    manager.save(4, state)
    manager.wait_until_finished()
    restored = manager.restore({"w": state["w"]}, partial=True)
    np.testing.assert_array_equal(np.asarray(restored["w"]),
                                  np.asarray(state["w"]))
    stats = manager.last_restore_stats
    assert stats.nbytes_from_memory == state["w"].nbytes == stats.nbytes_read


def test_train_state_restores_from_memory(ckpt_dir):
  state = adam_train_state(7)
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(7, state)
    manager.wait_until_finished()
    restored = manager.restore(adam_train_state(0))
    assert type(restored) is type(state)
    _same(restored, state)
    assert manager.last_restore_stats.nbytes_from_memory > 0


def test_damaged_memory_is_read_again_from_the_files(ckpt_dir, caplog):
  """The held bytes are checked as a file's are; where they fail, the step
  is read from its files, and a good step is never set aside for this
  process's memory. Memory that went bad cannot be produced on demand:
  the held span of the matrix's first shard is replaced by a copy with
  one byte flipped (a fake, for the fault)."""

  def damage(manager):
    held = manager._held  # pylint: disable=protected-access
    name = files.data_file(0)
    size, spans = held._files[name]  # pylint: disable=protected-access
    first = max(spans, key=lambda s: s.nbytes)
    bad = first.view().copy()
    bad[12345] ^= 0xFF
    held._files[name] = (size, [  # pylint: disable=protected-access
        s if s is not first else held_lib.Span(s.offset, s.nbytes,
                                               lambda: bad)
        for s in spans])

  with CheckpointManager(ckpt_dir) as manager:
    for step in (4, 5):
      manager.save(step, _state(step))
      manager.wait_until_finished()
    damage(manager)
    with caplog.at_level("WARNING", logger="flax_ckpt_plugin"):
      _same(manager.restore(_state(0)), _state(5))
    assert "held in memory failed its checks" in caplog.text
    assert manager.last_restore_stats.nbytes_from_memory == 0
    manager.save(6, _state(6))
    manager.wait_until_finished()
    damage(manager)
    step, restored = manager.restore_newest_valid(_state(0))
    assert step == 6
    _same(restored, _state(6))
    assert manager.all_steps() == [4, 5, 6]  # Nothing set aside.
    assert sorted(p.name for p in ckpt_dir.iterdir()
                  if not p.name.startswith("_")) == ["4", "5", "6"]


def test_a_save_inside_a_read_of_the_held_step_is_refused(ckpt_dir):
  """A save would reuse the memory under the read: a clear error, never a
  hang."""
  with TierManager(ckpt_dir) as manager:
    manager.save(1, _state(1))
    manager.wait_until_finished()

    def save_inside(storage):
      del storage
      with pytest.raises(RuntimeError, match="reads the held snapshot"):
        manager.save(2, _state(2))
      return "read"

    assert manager.read_step(1, save_inside) == "read"
    manager.save(2, _state(2))  # Once the read is over.
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]


def test_a_save_waits_for_a_restore_reading_the_held_step(ckpt_dir):
  """The next save reuses the held memory only once no restore reads it."""
  step_dir = ckpt_dir / "1"
  held = held_lib.HeldStep()
  held.hold(1, step_dir, files.data_file(0), 4,
            [held_lib.Span(0, 4, lambda: np.arange(4, dtype=np.uint8))])
  dropped = threading.Event()
  backend = interface.for_path(step_dir)
  with held.reading(1, step_dir, backend=backend) as storage:
    assert storage is not None
    thread = threading.Thread(target=lambda: (held.drop(60), dropped.set()))
    thread.start()
    assert not dropped.wait(0.2)
  thread.join(10)
  assert dropped.is_set() and held.step is None
  with held.reading(1, step_dir, backend=backend) as storage:
    assert storage is None


def test_a_save_gives_up_on_a_restore_that_never_ends(ckpt_dir):
  """A reader of the held step that does not end within the deadline makes
  the save raise, and the held step stays: its memory is never reused
  under a read."""
  step_dir = ckpt_dir / "1"
  held = held_lib.HeldStep()
  held.hold(1, step_dir, files.data_file(0), 4,
            [held_lib.Span(0, 4, lambda: np.arange(4, dtype=np.uint8))])
  backend = interface.for_path(step_dir)
  box = {}
  with held.reading(1, step_dir, backend=backend) as storage:
    assert storage is not None
    thread = threading.Thread(target=lambda: box.update(
        error=pytest.raises(TimeoutError, held.drop, 0.3)))
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert "snapshot of step 1 held in memory" in str(box["error"].value)
    assert held.step == 1  # Still held: the reader reads on.
  held.drop(5)  # The reader gone: at once.
  assert held.step is None


@pytest.mark.parametrize("pinned_path", [False, True])
def test_newest_step_from_memory_with_pinned_snapshots(ckpt_dir, monkeypatch,
                                                       pinned_path):
  """The accelerator path (pinned host snapshots), run on the CPU through
  the suite's switch, holds its snapshot the same way."""
  if pinned_path:
    monkeypatch.setenv(pinned.CPU_SWITCH, "1")
  with CheckpointManager(ckpt_dir) as manager:
    manager.warm_up(_state(0), wait=True)  # Every save pinned, the first too.
    for step in (1, 2):
      state = _state(step)
      manager.save(step, state)
      manager.wait_until_finished()
      _same(manager.restore(_state(0)), state)
      assert _from_memory(manager, step)


def test_pinned_snapshots_go_to_the_devices_as_they_are_checked_first(
    ckpt_dir, monkeypatch, caplog):
  """On the accelerator path (the suite's switch), a restore of the newest
  step sends the snapshot's pinned buffers to the devices as they are,
  without the restore window's buffers, each checked first: one byte
  flipped in a held pinned buffer (written through a view of it: memory
  going bad is not produced on demand) fails the check, and the step is
  read from its files instead."""
  monkeypatch.setenv(pinned.CPU_SWITCH, "1")
  taken = []
  real_take = window_lib.RestoreWindow.take
  monkeypatch.setattr(window_lib.RestoreWindow, "take",
                      lambda self, *a: taken.append(a) or real_take(self, *a))
  with CheckpointManager(ckpt_dir) as manager:
    manager.warm_up(_state(0), wait=True)
    manager.save(1, _state(1))
    manager.wait_until_finished()
    _same(manager.restore(_state(0)), _state(1))
    assert _from_memory(manager, 1) and not taken
    manager.save(2, _state(2))
    manager.wait_until_finished()
    _, spans = manager._held._files[files.data_file(0)]  # pylint: disable=protected-access
    largest = max((s for s in spans if s.array is not None),
                  key=lambda s: s.nbytes)
    copies_lib.writable_view(largest.array).reshape(-1).view(np.uint8)[
        777] ^= 0xFF
    sources = []
    real_copies = copies_lib.copies_onto
    monkeypatch.setattr(copies_lib, "copies_onto", lambda srcs, shardings: (
        sources.extend(srcs), real_copies(srcs, shardings))[1])
    with caplog.at_level("WARNING", logger="flax_ckpt_plugin"):
      _same(manager.restore(_state(0)), _state(2))
    assert not any(src is largest.array for src in sources)  # Never sent.
    assert "held in memory failed its checks" in caplog.text
    assert manager.last_restore_stats.nbytes_from_memory == 0


def test_the_tolerance_layer_reads_the_held_step_through_read_step(ckpt_dir):
  """`TierManager.read_step(step, fn)`: what the survivors' save and
  an elastic recovery read a local step through. The newest step's data
  file comes from memory, byte for byte the file's; an older step's from
  disk."""
  with TierManager(ckpt_dir) as manager:
    manager.save(1, _state(1))
    manager.wait_until_finished()
    manager.save(2, _state(2))
    manager.wait_until_finished()
    name = files.data_file(0)
    on_disk = (ckpt_dir / "2" / name).read_bytes()
    step_dir = epath.Path(ckpt_dir) / "2"

    def read_all(storage):
      f = storage.open_ranged(step_dir / name, within=step_dir)
      for leaf in manifest_lib.read(step_dir, 2).leaves:
        for shard in leaf.shards if leaf.is_array else ():
          got = bytearray(shard.nbytes)
          f.read_into(shard.offset, memoryview(got))
          assert bytes(got) == on_disk[shard.offset:shard.offset
                                       + shard.nbytes], leaf.path
      return storage.held_bytes

    assert (_state(0)["w"].nbytes <= manager.read_step(2, read_all)
            <= _data_bytes(manager, 2))
    assert manager.read_step(1, lambda storage: storage) is manager.backend
