"""The accelerator path: snapshots through pinned host memory, and restores
that send pinned buffers to the devices (`flax_ckpt_plugin.arrays.pinned`, `save.pinned_staging`, `restore.window`).

The CPU backend has the `pinned_host` memory kind too, and the switch
`FLAX_CKPT_PLUGIN_PINNED_CPU=1` makes CPU devices take that path, so these
tests run it on any machine: the copies are real runtime copies onto pinned
memory, not awaited by the save call, and the writer waits for each. Where
a test injects a failed transfer, it says so: no real part fails one on
demand.
"""

from __future__ import annotations

import errno
import os
import statistics
import sys
import threading
import weakref

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.backends import handles
from flax_ckpt_plugin.arrays import copies as copies_lib
from flax_ckpt_plugin.arrays import pinned
from flax_ckpt_plugin.restore import window as window_lib
from flax_ckpt_plugin.save import pinned_staging
from flax_ckpt_plugin import Storage
from helpers import assert_only_finalized_steps
from helpers import call_on_thread
from helpers import flip_byte
from helpers import FlakyDisk
from helpers import join_commit
from helpers import pinned_counter
from helpers import two_device_mesh
from launcher import run_workers

RUN_TIMEOUT = 120


@pytest.fixture(autouse=True)
def pinned_on_cpu(monkeypatch):
  monkeypatch.setenv(pinned.CPU_SWITCH, "1")


@pytest.fixture
def copies(monkeypatch):
  """Counts the arrays copied onto pinned memory and off it, while the
  runtime copies them as usual."""
  seen, counting = pinned_counter(copies_lib.copies_onto)
  monkeypatch.setattr(copies_lib, "copies_onto", counting)
  return seen


def _arrays(tree) -> int:
  return sum(isinstance(a, (jax.Array, np.ndarray))
             for a in jax.tree.leaves(tree))


def _run(state, train_step, steps, save=None, synced=True):
  """The donating loop; `save(step, state)` after each step."""
  for step in range(1, steps + 1):
    state = train_step(state)
    if synced:
      jax.block_until_ready(state)
    if save is not None:
      save(step, state)
  return state


@pytest.mark.parametrize("synced", [True, False], ids=["synced", "unsynced"])
def test_a_donating_loop_saving_every_3_steps_restores_bit_identical(
    synced, ckpt_dir, make_state, train_step, host_copy, assert_trees_equal,
    copies):
  """Every third step of a loop whose step donates the state is saved; the
  next step runs right after the save call, waited for (synced) or not.
  Each saved step restores bit for bit as the state was at that step
  (computed by the same loop without saves), and every shard travelled
  through pinned memory, both ways."""
  expected = {}
  _run(make_state(), train_step, 12,
       lambda step, s: step % 3 == 0 and expected.update(
           {step: host_copy(s)}))
  arrays = _arrays(expected[3])
  manager = CheckpointManager(ckpt_dir, max_to_keep=None)
  manager.warm_up(train_step(make_state()), wait=True)  # The callback does.
  _run(make_state(), train_step, 12,
       lambda step, s: step % 3 == 0 and manager.save(step, s), synced)
  manager.wait_until_finished()
  assert copies["onto_pinned"] == 4 * arrays
  assert manager.all_steps() == [3, 6, 9, 12]
  for step, values in expected.items():
    target = train_step(make_state())  # Its step is an array, as saved.
    assert_trees_equal(manager.restore(target, step), values)
  assert copies["off_pinned"] == 4 * arrays
  manager.close()


def test_a_leaf_donated_before_the_save_gets_the_clear_error(
    ckpt_dir, make_state, train_step):
  manager = CheckpointManager(ckpt_dir)
  state = make_state()
  train_step(state)  # Donates `state`.
  with pytest.raises(ValueError, match="was deleted .donated to a jitted"
                     " step before save was called"):
    manager.save(1, state)
  assert manager.all_steps() == []
  manager.close()


def _array_bytes(tree) -> list[int]:
  return [a.nbytes for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)]


@pytest.fixture
def held_allocations(monkeypatch):
  """Each pinned buffer the reservation asks for waits for its turn: the
  test lets `n` more go with `gate.release(n)` (injected: a real
  allocation is slow, 0.5 s per GB on an accelerator, only at sizes this
  machine cannot give a test); records who asked, and for how many
  bytes."""
  gate, asked = threading.Semaphore(0), []
  real = pinned_staging._allocate  # pylint: disable=protected-access

  def allocate(device, nbytes):
    asked.append((threading.current_thread().name, nbytes))
    assert gate.acquire(timeout=60), "the test never let the allocation go"
    return real(device, nbytes)

  monkeypatch.setattr(pinned_staging, "_allocate", allocate)
  yield gate, asked
  gate.release(1000)


def _until(condition, what: str, secs: float = 30.0) -> None:
  for _ in range(int(secs / 0.02)):
    if condition():
      return
    threading.Event().wait(0.02)
  raise AssertionError(f"not within {secs} s: {what}")


def test_the_first_save_waits_for_no_pinned_memory(
    ckpt_dir, make_state, train_step, host_copy, assert_trees_equal, copies,
    held_allocations):
  """`restore_or_initialize` has a thread pin the saves' memory, one buffer
  per piece, largest first, and returns at once. The first save comes
  while the first buffer is still being pinned: it copies every piece on
  its device, its call and its commit end without waiting for the pinning,
  and the step restores bit for bit. Once pinned, the buffers go back to
  the runtime's pool at the next save, which copies every piece onto
  pinned memory, as do the saves after; only the reservation's thread
  asks for new pinned buffers, one per piece."""
  gate, asked = held_allocations
  cb = CheckpointCallback(ckpt_dir, every_steps=1, max_to_keep=None)
  thread, box = call_on_thread(
      lambda: cb.restore_or_initialize(make_state()), 60)
  assert not thread.is_alive(), "restore_or_initialize waits for pinning"
  state = train_step(box["result"])
  expected = {1: host_copy(state)}
  thread, box = call_on_thread(lambda: (cb(1, state),
                                        cb.wait_until_finished()), 60)
  assert not thread.is_alive(), "the first save waits for pinning"
  assert "error" not in box, box.get("error")
  nbytes = _array_bytes(state)
  stats = cb.manager.last_save_stats
  assert stats.unpinned_bytes == sum(nbytes) and copies["onto_pinned"] == 0
  assert len(asked) == 1  # The largest piece's buffer, still waiting.
  gate.release(1000)
  assert cb.manager._pinned.wait_reserved(60)  # pylint: disable=protected-access
  assert [n for _, n in asked] == sorted(nbytes, reverse=True)
  assert {name for name, _ in asked} == {"flax_ckpt_plugin-pinned-reserve"}
  for step in range(2, 5):
    state = train_step(state)
    expected[step] = host_copy(state)
    cb(step, state)
    cb.wait_until_finished()
    assert cb.manager.last_save_stats.unpinned_bytes == 0
  assert copies["onto_pinned"] == 3 * len(nbytes)
  assert len(asked) == len(nbytes)  # Pinned once, by the reservation.
  for step, values in expected.items():
    assert_trees_equal(cb.manager.restore(state, step), values)
  cb.close()


def test_a_save_pins_what_is_ready_and_copies_the_rest_on_the_devices(
    ckpt_dir, make_state, host_copy, assert_trees_equal, copies,
    monkeypatch):
  """The reservation pins the two largest buffers, and the runtime refuses
  the third (injected, as is the wait below: neither happens on demand).
  The first save takes those two pieces onto pinned memory and copies the
  others on their devices. It also asks the reservation again, whose next
  buffer is held in the runtime's allocator: a save meanwhile puts nothing
  onto pinned memory, which would wait for that allocator. Once every
  buffer is pinned, a save takes every piece onto pinned memory. Each
  step restores bit for bit."""
  gate, asked = threading.Semaphore(0), []
  real = pinned_staging._allocate  # pylint: disable=protected-access

  def allocate(device, nbytes):
    asked.append(nbytes)
    if len(asked) == 3:
      raise RuntimeError("RESOURCE_EXHAUSTED: injected: no pinned memory")
    if len(asked) > 3:
      assert gate.acquire(timeout=60), "the test never let it go"
    return real(device, nbytes)

  monkeypatch.setattr(pinned_staging, "_allocate", allocate)
  state = make_state()
  nbytes = sorted(_array_bytes(state), reverse=True)
  try:
    with CheckpointManager(ckpt_dir) as manager:
      staging = manager._pinned  # pylint: disable=protected-access
      manager.warm_up(state, wait=True)
      assert staging.reserved_bytes == sum(nbytes[:2]), asked
      manager.save(1, state)
      manager.wait_until_finished()
      assert copies["onto_pinned"] == 2
      assert manager.last_save_stats.unpinned_bytes == sum(nbytes[2:])
      assert_trees_equal(manager.restore(make_state(), 1), host_copy(state))
      _until(lambda: len(asked) == 4, "the next buffer asked for")
      manager.save(2, state)
      manager.wait_until_finished()
      assert copies["onto_pinned"] == 2
      assert manager.last_save_stats.unpinned_bytes == sum(nbytes)
      assert_trees_equal(manager.restore(make_state(), 2), host_copy(state))
      gate.release(1000)
      assert staging.wait_reserved(60)
      manager.save(3, state)
      manager.wait_until_finished()
      assert copies["onto_pinned"] == 2 + len(nbytes)
      assert manager.last_save_stats.unpinned_bytes == 0
      assert_trees_equal(manager.restore(make_state(), 3), host_copy(state))
  finally:
    gate.release(1000)


def test_close_stops_the_reservation(ckpt_dir, make_state, held_allocations):
  """A manager closed while its memory is being pinned stops pinning once
  the buffer in hand is done, and holds none of what it pinned."""
  gate, asked = held_allocations
  manager = CheckpointManager(ckpt_dir)
  manager.warm_up(make_state())
  _until(lambda: asked, "the first buffer asked for")
  threading.Timer(0.3, gate.release).start()
  manager.close()
  assert not any(t.name == "flax_ckpt_plugin-pinned-reserve"
                 for t in threading.enumerate())
  assert len(asked) == 1
  assert not [a for a in _pinned_arrays() if a.shape == (asked[0][1],)]


def test_an_abstract_state_is_warmed_up_at_the_first_call(
    ckpt_dir, make_state, train_step, monkeypatch):
  asked = []
  real = pinned_staging.PinnedStaging.reserve
  monkeypatch.setattr(pinned_staging.PinnedStaging, "reserve",
                      lambda self, sizes, **kw: asked.append(list(sizes))
                      or real(self, sizes, **kw))
  cb = CheckpointCallback(ckpt_dir, every_steps=2)
  state = train_step(make_state())
  cb.restore_or_initialize(jax.eval_shape(lambda: state))
  assert not any(asked)  # Nothing to take the measure of.
  cb(1, state)
  cb(2, train_step(state))
  cb.close()
  assert [len(a) for a in asked if a] == [len(jax.tree.leaves(state))]


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="reads /proc/self/statm")
def test_host_memory_stays_flat_over_100_saves(ckpt_dir, copies):
  """100 saves of a 40 MB state, each waited for: the process's RSS over the
  last 10 saves (median) is within a quarter of the state of what it was
  over saves 3 to 12; a save that kept its pinned buffer would add 40 MB
  each time. (The leaf is larger than the C allocator's largest mmap
  threshold, 32 MiB, so its buffers are mapped and unmapped whole: smaller
  ones come and go inside the heap, whose free space rises and falls by
  tens of MB from save to save.)"""
  state = {"w": jnp.zeros((10 << 20,), jnp.float32),
           "b": jnp.zeros((1000,), jnp.float32)}
  nbytes = sum(a.nbytes for a in state.values())
  manager = CheckpointManager(ckpt_dir, max_to_keep=1)
  manager.warm_up(state, wait=True)
  rss = []
  for step in range(1, 101):
    state = {k: v + 1 for k, v in state.items()}
    manager.save(step, state)
    manager.wait_until_finished()
    rss.append(_rss_bytes())
  growth = statistics.median(rss[-10:]) - statistics.median(rss[2:12])
  assert copies["onto_pinned"] == 100 * len(state)
  assert growth < nbytes / 4, (growth, nbytes)
  restored = manager.restore(jax.tree.map(np.zeros_like, state))
  np.testing.assert_array_equal(restored["w"], np.full(10 << 20, 100))
  manager.close()


class _FailedTransfer:
  """A copy onto pinned memory whose transfer failed (injected: a real one
  does not fail on demand); its wait raises as the runtime's would."""

  def __init__(self, real: jax.Array):
    self.dtype, self.shape, self.nbytes = real.dtype, real.shape, real.nbytes

  def unsafe_buffer_pointer(self) -> int:
    return 0

  def block_until_ready(self):
    raise RuntimeError("INTERNAL: injected failure of a device-to-host"
                       " transfer")


def test_a_failed_transfer_is_the_save_s_error_and_finalizes_nothing(
    ckpt_dir, make_state, assert_trees_equal, host_copy, monkeypatch):
  manager = CheckpointManager(ckpt_dir)
  state = make_state()
  manager.warm_up(state, wait=True)
  manager.save(1, state)
  manager.wait_until_finished()
  real = copies_lib.copies_onto
  monkeypatch.setattr(
      copies_lib, "copies_onto",
      lambda srcs, shardings: [_FailedTransfer(a)
                               for a in real(srcs, shardings)])
  manager.save(2, state)  # Returns: nothing is waited for.
  with pytest.raises(RuntimeError, match="injected failure") as info:
    manager.save(3, state)  # The next call raises the commit's error.
  assert "step 2" in "".join(getattr(info.value, "__notes__", [])) + str(
      info.value)
  monkeypatch.setattr(copies_lib, "copies_onto", real)
  assert manager.all_steps() == [1]
  assert_only_finalized_steps(ckpt_dir, [1])
  assert_trees_equal(manager.restore(make_state(), 1), host_copy(state))
  manager.close()


@pytest.mark.skipif(len(jax.devices()) < 2,
                    reason="needs 2 devices (conftest gives the CPU 2; a"
                    " machine with one accelerator has 1)")
@pytest.mark.parametrize("spec", [P("x"), P(None, "x"), P()],
                         ids=["rows", "columns", "replicated"])
def test_restores_send_pinned_buffers_to_sharded_targets(
    spec, ckpt_dir, copies, monkeypatch):
  """Restored through pinned buffers onto a 2-device sharding, with a
  window so small that each read waits for the transfers before it: the
  values and shardings are the target's, and the restored arrays can be
  donated (the step that takes them reuses their memory)."""
  monkeypatch.setattr(window_lib, "RESTORE_WINDOW_BYTES", 1 << 16)
  mesh = two_device_mesh()
  sharding = NamedSharding(mesh, spec)
  values = {f"k{i}": np.arange(i, i + 256 * 128, dtype=np.float32).reshape(
      256, 128) for i in range(3)}
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, values)
    manager.wait_until_finished()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
              for k, v in values.items()}
    restored = manager.restore(target, 1)
  sends = {P("x"): 6, P(None, "x"): 6, P(): 3}[spec]
  assert copies["off_pinned"] == sends * (2 if spec == P() else 1)
  for k, v in values.items():
    assert restored[k].sharding == sharding
    np.testing.assert_array_equal(np.asarray(restored[k]), v)
  before = [s.data.unsafe_buffer_pointer()
            for s in restored["k0"].addressable_shards]
  step = jax.jit(lambda t: jax.tree.map(lambda a: a + 1, t),
                 donate_argnums=0)
  after = step(restored)
  assert restored["k0"].is_deleted()
  assert sorted(s.data.unsafe_buffer_pointer()
                for s in after["k0"].addressable_shards) == sorted(before)


def test_a_budget_sends_the_rest_through_the_plain_transfer(
    ckpt_dir, copies, assert_trees_equal, host_copy):
  """A budget of 2 shards' bytes: 2 shards are pinned, the others are
  copied the plain way, and the step restores whole."""
  state = {f"w{i}": jnp.full((1024,), i, jnp.float32) for i in range(5)}
  with CheckpointManager(
      ckpt_dir, storage=Storage(pinned_host_bytes=2 * 4096)) as manager:
    manager.warm_up(state, wait=True)
    assert manager._pinned.reserved_bytes == 2 * 4096  # pylint: disable=protected-access
    manager.save(1, state)
    manager.wait_until_finished()
    assert copies["onto_pinned"] == 2
    assert_trees_equal(manager.restore(state), host_copy(state))


def test_a_refused_pinned_copy_costs_that_save_and_a_back_off_only(
    ckpt_dir, make_state, assert_trees_equal, host_copy, monkeypatch,
    caplog):
  """The runtime refuses copies onto pinned memory while `short` is set
  (injected: a real one runs out on demand only by exhausting the
  machine's). A refused save and the back-off after it (1 save, then 2,
  then 4 after refusals in a row) copy on the devices, each logged
  at warning with its bytes and counted in `SaveStats`; the save after
  the back-off asks again and, memory there again, is pinned. A restore
  whose pinned buffer is refused reads the plain way and changes nothing
  for the saves."""
  asked = []  # The saves that asked for pinned memory.
  short = {"now": True}

  def copies_onto(srcs, shardings):
    if any(s.memory_kind == pinned.PINNED for s in shardings):
      asked.append(step)
      if short["now"]:
        raise RuntimeError("RESOURCE_EXHAUSTED: injected: no pinned memory")
      pinned_saves.add(step)
    return real(srcs, shardings)

  real, pinned_saves = copies_lib.copies_onto, set()
  monkeypatch.setattr(copies_lib, "copies_onto", copies_onto)
  state = make_state()
  nbytes = sum(a.nbytes for a in jax.tree.leaves(state)
               if isinstance(a, jax.Array))
  fallback = {}
  with CheckpointManager(ckpt_dir) as manager:
    manager.warm_up(state, wait=True)
    for step in range(1, 4):
      manager.save(step, state)
      manager.wait_until_finished()
      # A refused size is pinned again by the reservation: this test
      # lets it finish, so that the saves' choices are the back-off's.
      assert manager._pinned.wait_reserved(60)  # pylint: disable=protected-access
      fallback[step] = manager.last_save_stats.pinned_fallback_bytes
      short["now"] = False
    assert asked == [1, 3] and pinned_saves == {3}
    assert fallback == {1: nbytes, 2: nbytes, 3: 0}

    def no_buffer(shape, dtype, device):
      raise RuntimeError("RESOURCE_EXHAUSTED: injected: no pinned buffer")

    with monkeypatch.context() as m:
      m.setattr(window_lib, "pinned_buffer", no_buffer)
      # Step 2, from its file: step 3 would come from its snapshot.
      assert_trees_equal(manager.restore(make_state(), 2), host_copy(state))
    step = 4
    manager.save(step, state)
    manager.wait_until_finished()
    assert manager._pinned.wait_reserved(60)  # pylint: disable=protected-access
    assert pinned_saves == {3, 4}
    short["now"] = True
    for step in range(5, 13):
      manager.save(step, state)
      manager.wait_until_finished()
      assert manager._pinned.wait_reserved(60)  # pylint: disable=protected-access
    assert asked == [1, 3, 4, 5, 7, 10]  # Back-offs of 1, 2, 4 saves.
    assert manager.last_save_stats.pinned_fallback_bytes == nbytes
  lines = [r.getMessage() for r in caplog.records
           if r.levelname == "WARNING" and "pinned" in r.getMessage()]
  assert sum("refused" in line and f"{nbytes} bytes" in line
             for line in lines) == 2 + 8, lines  # Saves 1, 2 and 5-12.
  assert sum("refused a pinned buffer" in line and "for a restore" in line
             for line in lines) == 1, lines


def test_a_refused_reservation_is_asked_again_after_a_back_off(
    ckpt_dir, make_state, assert_trees_equal, host_copy, monkeypatch,
    caplog):
  """The runtime refuses the reservation's buffers while `short` is set
  (injected, as above). The warm-up logs it at warning and ends; the next
  save asks again (a back-off of 1 save), and is refused again; after a
  back-off of 2 saves, with memory there now, the reservation pins it, and
  the save after takes it. Until then every save copies its pieces on the
  devices (counted as not pinned yet, not as refused copies), and every
  step restores bit for bit."""
  short = {"now": True}
  real = pinned_staging._allocate  # pylint: disable=protected-access

  def allocate(device, nbytes):
    if short["now"]:
      raise RuntimeError("RESOURCE_EXHAUSTED: injected: no pinned memory")
    return real(device, nbytes)

  monkeypatch.setattr(pinned_staging, "_allocate", allocate)
  state = make_state()
  nbytes = sum(_array_bytes(state))
  with CheckpointManager(ckpt_dir) as manager:
    staging = manager._pinned  # pylint: disable=protected-access
    manager.warm_up(state, wait=True)
    seen = []
    for step in range(1, 5):
      manager.save(step, state)
      manager.wait_until_finished()
      assert staging.wait_reserved(60)
      short["now"] = False
      stats = manager.last_save_stats
      seen.append((stats.pinned_fallback_bytes, stats.unpinned_bytes))
      assert_trees_equal(manager.restore(make_state(), step),
                         host_copy(state))
  refusals = [r.getMessage() for r in caplog.records
              if r.levelname == "WARNING" and "for the saves" in r.getMessage()]
  assert len(refusals) == 2, refusals
  assert "tried again in 1 save(s)" in refusals[0]
  assert "tried again in 2 save(s)" in refusals[1]
  assert seen == [(0, nbytes)] * 3 + [(0, 0)]
  assert staging.reserved_bytes == nbytes


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_two_processes_cut_replicated_shards_through_pinned_memory(
    tmp_path):
  """2 processes x 2 devices, an HSDP state (sharded within a process,
  replicated over the processes): large shards are cut into row ranges
  between their two holders, each range a slice copied onto pinned
  memory. Every byte is written once and the step restores bit for bit,
  by each process alone and by both together."""
  out = [r.json for r in run_workers(
      "balanced_write", 2, args=[tmp_path / "ckpt", "hsdp"],
      timeout=RUN_TIMEOUT, devices_per_process=2,
      env={pinned.CPU_SWITCH: "1"})]
  assert sum(o["written"] for o in out) == out[0]["total"]
  for o in out:
    assert o["pinned"]["onto_pinned"] > 0 and o["pinned"]["off_pinned"] > 0
    assert o["restored"] == o["saved"] == out[0]["saved"]
    assert o["restored_together"] == o["saved"]


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_data_by_model_mesh_saves_and_restores_through_pinned_memory(
    tmp_path):
  """2 processes x 2 devices on a ('data', 'model') mesh of shape (2, 2),
  kernels split on both axes, on one, and replicated leaves."""
  out = [r.json for r in run_workers(
      "topology_write", 2, args=[tmp_path / "ckpt", "2x2"],
      timeout=RUN_TIMEOUT, devices_per_process=2,
      env={pinned.CPU_SWITCH: "1"})]
  for o in out:
    assert o["pinned"]["onto_pinned"] > 0 and o["pinned"]["off_pinned"] > 0
    assert o["restored"] == o["digests"] == out[0]["digests"]
    assert o["restored_on_target_shardings"]


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_host_memory_is_the_pinned_snapshot_and_the_restore_window(tmp_path):
  """What bounds a process's host memory on an accelerator, measured in a
  process of its own on CPU devices that take the accelerator path (their
  memory is the host's too, so a restored state counts here; on an
  accelerator it does not). With S the state's bytes: the warm-up pins S
  and nothing more; saves add nothing to it; a restore of the step just
  saved sends the snapshot's pinned buffers to the devices, with no
  window; a restore in a new manager needs its window (at most the
  window's bytes, or S if less) beside the restored state."""
  out = run_workers("pinned_memory", 1, args=[tmp_path / "ckpt"],
                    timeout=RUN_TIMEOUT, env={pinned.CPU_SWITCH: "1"}
                    )[0].json
  size, slack = out["state_bytes"], out["state_bytes"] // 8
  assert out["same"] and out["fresh_same"]
  assert out["from_memory"] == size
  assert size <= out["warm_up"][0] <= size + slack, out
  assert out["save"][0] <= slack, out
  assert out["restore_after_save"][0] <= size + slack, out
  assert (out["fresh_restore"][0]
          <= size + min(size, out["window_bytes"]) + slack), out


def _two_steps_of_four_leaves(ckpt_dir) -> dict[str, np.ndarray]:
  """Steps 1 and 2 of 4 leaves of 8 MiB each; returns step 1's values."""
  values = {step: {f"w{i}": np.full((2 << 20,), step * 10 + i, np.float32)
                   for i in range(4)} for step in (1, 2)}
  with CheckpointManager(ckpt_dir) as manager:
    for step, tree in values.items():
      manager.save(step, {k: jnp.asarray(v) for k, v in tree.items()})
      manager.wait_until_finished()
  return values[1]


@pytest.mark.parametrize("window_mib", [12, 40],
                         ids=["region_over_what_is_left",
                              "region_under_what_is_left"])
@pytest.mark.parametrize("fault", ["checksum", "read_error"])
def test_a_damaged_newest_step_restored_through_pinned_buffers_falls_back(
    ckpt_dir, monkeypatch, caplog, window_mib, fault):
  """Step 2 has a flipped byte in one leaf (or its data file fails a read:
  an injected EIO, since no real disk fails one on demand): restoring
  through pinned buffers, with a window whose room left after the failed
  read is smaller or larger than a region, gives the failed buffer back,
  skips step 2 and restores step 1, within seconds."""
  expected = _two_steps_of_four_leaves(ckpt_dir)
  data = ckpt_dir / "2" / "data" / "process_00000.bin"
  if fault == "checksum":
    flip_byte(data, os.path.getsize(data) // 3)
  else:
    real_read = handles.LocalFile.read_into

    def failing(self, offset, out):
      if os.readlink(f"/proc/self/fd/{self._fd}") == os.fspath(  # pylint: disable=protected-access
          data.resolve()):
        raise OSError(errno.EIO, "Input/output error (injected)")
      return real_read(self, offset, out)

    monkeypatch.setattr(handles.LocalFile, "read_into", failing)
  monkeypatch.setattr(window_lib, "RESTORE_WINDOW_BYTES", window_mib << 20)
  target = {f"w{i}": jax.ShapeDtypeStruct((2 << 20,), jnp.float32)
            for i in range(4)}
  cb = CheckpointCallback(ckpt_dir, every_steps=1)
  thread, box = call_on_thread(lambda: cb.restore_or_initialize(target), 60)
  assert not thread.is_alive(), "the restore hangs"
  assert "error" not in box, box.get("error")
  assert cb.restored_step == 1
  for k, v in expected.items():
    np.testing.assert_array_equal(np.asarray(box["result"][k]), v)
  # Damaged bytes are set aside; a step the disk failed to read is kept.
  assert cb.manager.all_steps() == ([1] if fault == "checksum" else [1, 2])
  cb.close()


def test_a_full_restore_window_ends_its_wait_with_an_error_naming_it(
    monkeypatch):
  """A buffer taken and neither sent nor given back (a thread that never
  hands it on) fills the window: the next `take` that needs room ends
  with an error naming the wait, after `FILL_WAIT_SECS`, not a hang. A
  buffer given back makes room at once."""
  monkeypatch.setattr(window_lib, "FILL_WAIT_SECS", 0.3)
  device = jax.devices()[0]
  window = window_lib.RestoreWindow(limit=1 << 20)
  held, _ = window.take((192, 1024), np.float32, device)  # 768 KiB.
  thread, box = call_on_thread(
      lambda: window.take((128, 1024), np.float32, device), 30)
  assert not thread.is_alive()
  assert isinstance(box.get("error"), TimeoutError), box
  assert "524288 bytes" in str(box["error"])
  assert "786432 of the window's 1048576 bytes" in str(box["error"])
  window.give_back(held)
  taken = window.take((128, 1024), np.float32, device)
  assert taken is not None
  window.send(taken[0], [jax.sharding.SingleDeviceSharding(device)])
  window.wait()


def _pinned_arrays(besides=()) -> list[jax.Array]:
  """The live arrays in pinned host memory, but those of `besides`
  (weak references: arrays that earlier tests' garbage still holds)."""
  old = [r() for r in besides]
  return [a for a in jax.live_arrays()
          if a.sharding.memory_kind == pinned.PINNED
          and not any(a is o for o in old)]


def test_a_failed_commit_keeps_its_error_but_not_its_pinned_buffers(
    ckpt_dir, make_state):
  """The disk fails the commit of step 2 (a writer that raises: no real
  disk fails on demand). The error waits for the next call, with its type,
  text and step, but the snapshot's pinned buffers are freed when the
  commit ends, not kept alive by the error until then (the next snapshot
  would need a second pinned copy of the state)."""
  before = [weakref.ref(a) for a in _pinned_arrays()]
  writing = threading.Event()

  class HeldDisk(FlakyDisk):
    def step_writer(self, step_dir, identity, data_dir):
      if self.on_fire:
        assert writing.wait(60)  # Until the test has looked.
      return super().step_writer(step_dir, identity, data_dir)

  disk = HeldDisk()
  manager = CheckpointManager(ckpt_dir, storage=Storage(backend=disk))
  state = make_state()
  manager.warm_up(state, wait=True)
  manager.save(1, state)
  manager.wait_until_finished()
  # Step 1's are held for a restore of it in this process (`backends.held`)
  # until the next save, which lets them go before it takes its snapshot.
  held = [weakref.ref(a) for a in _pinned_arrays(before)]
  assert held
  disk.on_fire = True
  manager.save(2, state)
  assert not [r for r in held if r() is not None]
  assert _pinned_arrays(before)  # The snapshot of step 2, being written.
  writing.set()
  join_commit(manager, 60)
  assert not _pinned_arrays(before)
  with pytest.raises(OSError, match="disk on fire") as info:
    manager.check_for_errors()
  assert "step 2" in "".join(info.value.__notes__)
  # It still says where it failed, as text.
  assert "in step_writer" in "".join(info.value.__notes__)
  disk.on_fire = False
  manager.save(3, state)
  manager.close()
  assert manager.all_steps() == [1, 3]
