"""Saves of trees with thousands of leaves: what the first save compiles,
how shards are planned, and how leaves are named.

Compiles are counted through JAX's own monitoring events, on the thread
that ran them: a save must never wait for a compiler, however many leaves
its tree has.
"""

import math
import threading

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.arrays import copies as copies_lib
from flax_ckpt_plugin.save.staging import HostStaging
from flax_ckpt_plugin.format import treepaths
from helpers import wait_for_compiles

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _Compiles:
  """Names of the threads that compiled an XLA program, while active."""

  def __init__(self):
    self.threads: list[str] = []

  def __call__(self, event, *args, **kwargs):
    del args, kwargs
    if event == _COMPILE_EVENT:
      self.threads.append(threading.current_thread().name)

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self)


@jax.jit
def _bump(tree):
  return jax.tree.map(lambda x: x + 1, tree)


def _many_leaves(n: int) -> dict:
  """`n` small leaves of hundreds of shapes and several dtypes, as a
  model's (placed by device_put: building them compiles nothing either)."""
  dtypes = (np.float32, jnp.bfloat16, np.int8, np.int32)
  return {f"layer_{i // 4}": {f"w{j % 4}": jax.device_put(np.full(
      (j % 97 + 1, j % 5 + 1), j % 100, dtypes[j % 4]))
                              for j in range(i, min(i + 4, n))}
          for i in range(0, n, 4)}


def _assert_equal(restored, expected):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored),
                          jax.tree.leaves(expected)):
    assert a.dtype == b.dtype, path
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=str(path))


def test_small_leaves_are_packed_by_a_few_programs_compiled_in_the_background(
    tmp_path, monkeypatch):
  """Thousands of small leaves of hundreds of shapes and 4 dtypes: the first
  save compiles nothing on the thread that saves (the runtime copies them
  while a program per `PACK_COUNT` of them compiles), later saves pack
  them all with those programs into the same memory, and every save
  restores bit for bit."""
  n = 1000
  tree = _bump(_many_leaves(n))  # (`_bump` compiled here, before counting.)
  packed = []  # Per save: how many shards were packed.
  real = HostStaging.copy_on_devices

  def spy(self, *args, **kwargs):
    out = real(self, *args, **kwargs)
    packed.append(sum(isinstance(c, copies_lib.Packed) for c in out))
    return out

  monkeypatch.setattr(HostStaging, "copy_on_devices", spy)
  manager = CheckpointManager(tmp_path / "ckpt")
  expected, pointers = {}, []
  with _Compiles() as compiles:
    for step in (1, 2, 3, 4):
      if step == 3:
        wait_for_compiles()
      expected[step] = jax.tree.map(np.array, tree)
      manager.save(step, tree)
      tree = _bump(tree)
      manager.wait_until_finished()
      pointers.append(sorted(
          a.unsafe_buffer_pointer()
          for arrays in manager._staging._device.values() for a in arrays))  # pylint: disable=protected-access
  assert packed[0] == 0 and packed[2] == packed[3] == n
  assert 0 < len(compiles.threads) <= math.ceil(n / copies_lib.PACK_COUNT)
  assert all(name.startswith("flax_ckpt_plugin-compile")
             for name in compiles.threads), compiles.threads
  assert pointers[2] and pointers[2] == pointers[3]  # The packs' memory.
  for step in (1, 2, 3, 4):
    _assert_equal(manager.restore(jax.eval_shape(lambda: tree), step),
                  expected[step])
  manager.close()


def test_a_warmed_up_manager_copies_its_first_save_with_programs(tmp_path):
  """`warm_up` (the callback's `restore_or_initialize` calls it) queues the
  compiles of the copy programs, so that the first save does not have the
  runtime copy every shard on the thread that saves."""
  tree = _bump({"big": jnp.ones((1100, 1024), jnp.float32),  # 4.5 MB
                "small": _many_leaves(40)})
  manager = CheckpointManager(tmp_path / "ckpt")
  with _Compiles() as compiles:
    manager.warm_up(tree)
    wait_for_compiles()
  assert all(name.startswith("flax_ckpt_plugin-compile")
             for name in compiles.threads), compiles.threads
  expected = jax.tree.map(np.array, tree)
  manager.save(1, tree)
  manager.wait_until_finished()
  reused = manager._staging._device  # pylint: disable=protected-access
  kinds = sorted(key.kind for _, key in reused)
  assert kinds == [copies_lib.PACK, copies_lib.REUSE], kinds
  _assert_equal(manager.restore(jax.eval_shape(lambda: tree), 1), expected)
  manager.close()


def test_large_shards_compile_a_bounded_number_of_programs_in_the_background(
    tmp_path, monkeypatch):
  monkeypatch.setattr(copies_lib, "REUSE_BYTES", 0)  # Every shard reused.
  n = 200
  tree = _bump({f"l{i}": jnp.full((8 + i % 10, 3), i, jnp.float32)
                for i in range(n)})
  manager = CheckpointManager(tmp_path / "ckpt")
  expected, pointers = {}, []
  with _Compiles() as compiles:
    for step in (1, 2, 3):
      expected[step] = jax.tree.map(np.array, tree)
      manager.save(step, tree)
      tree = _bump(tree)
      manager.wait_until_finished()
      wait_for_compiles()
      pointers.append(sorted(
          a.unsafe_buffer_pointer()
          for arrays in manager._staging._device.values() for a in arrays))  # pylint: disable=protected-access
  # Two programs (a first copy, a copy into reused memory) per group of at
  # most _GROUP shards, whatever the number of distinct shapes; none of
  # them compiled by the thread that saves.
  assert len(compiles.threads) <= 2 * math.ceil(n / copies_lib._GROUP)  # pylint: disable=protected-access
  assert all(name.startswith("flax_ckpt_plugin-compile")
             for name in compiles.threads), compiles.threads
  assert not pointers[0] and len(pointers[1]) == n
  assert pointers[1] == pointers[2]  # The third save reused the second's.
  for step in (1, 2, 3):
    _assert_equal(manager.restore(tree, step), expected[step])
  manager.close()


def test_the_first_save_starts_no_thread_and_queues_its_compiles_last(
    tmp_path, monkeypatch):
  """A manager's open starts the thread that compiles the copy programs;
  the first save of shapes not seen yet starts no thread, has the runtime
  copy its shards, and queues the compiles only after those copies (a
  compile thread woken before them took a core and the interpreter's lock
  from the save call: 3-6 ms on 2 cores). The second save copies with the
  compiled programs."""
  tree = _bump({"big": jnp.ones((1101, 1024), jnp.float32),  # 4.5 MB
                "small": jnp.arange(77, dtype=jnp.int32)})
  manager = CheckpointManager(tmp_path / "ckpt")
  events = []
  real_start, real_copies = threading.Thread.start, copies_lib.copies_onto
  real_get = copies_lib.PROGRAMS.get

  def start(thread):
    events.append(("thread", thread.name))
    real_start(thread)

  def copies_onto(srcs, shardings):
    events.append(("runtime copies", len(srcs)))
    return real_copies(srcs, shardings)

  def get(key, compile_fn):
    events.append(("compile", key.kind))
    return real_get(key, compile_fn)

  monkeypatch.setattr(threading.Thread, "start", start)
  monkeypatch.setattr(copies_lib, "copies_onto", copies_onto)
  monkeypatch.setattr(copies_lib.PROGRAMS, "get", get)
  manager.save(1, tree)
  monkeypatch.undo()
  assert events == [("runtime copies", 2), ("compile", copies_lib.REUSE),
                    ("compile", copies_lib.PACK)], events
  manager.wait_until_finished()
  wait_for_compiles()
  expected = jax.tree.map(np.array, _bump(tree))
  manager.save(2, _bump(tree))
  manager.wait_until_finished()
  kinds = sorted(key.kind for _, key in manager._staging._device)  # pylint: disable=protected-access
  assert kinds == [copies_lib.PACK, copies_lib.REUSE], kinds
  _assert_equal(manager.restore(jax.eval_shape(lambda: tree), 2), expected)
  manager.close()


def test_runtime_copies_without_the_batched_entry_point(monkeypatch):
  """The public `device_put` does the copy on a JAX without the runtime
  entry point the fast path uses (forgotten here to reach that path)."""
  monkeypatch.setattr(copies_lib, "_BATCHED_COPY", None)
  step = jax.jit(lambda x: x * 2, donate_argnums=0)
  srcs = [step(jnp.arange(6, dtype=dt)) for dt in (jnp.float32, jnp.bfloat16)]
  copies = copies_lib.fresh_copies(srcs)
  for src, copy in zip(srcs, copies):
    assert copy.unsafe_buffer_pointer() != src.unsafe_buffer_pointer()
  outs = [step(s) for s in srcs]  # Donates the sources.
  assert all(s.is_deleted() for s in srcs)
  for copy, out in zip(copies, outs):
    np.testing.assert_array_equal(np.asarray(copy, np.float32),
                                  np.arange(6) * 2)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.arange(6) * 4)


@pytest.mark.parametrize("spec", [("x",), (), (None, "x"), ("x", None)])
def test_shard_plan_matches_the_arrays_own_shards(spec):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  arr = jax.device_put(jnp.arange(24.0).reshape(4, 6), sharding)
  plan = treepaths.shard_plan(arr.sharding, arr.shape)
  for shard in arr.addressable_shards:
    assert plan[shard.device] == (
        treepaths.normalize_index(shard.index, arr.shape), shard.replica_id)


@struct.dataclass
class _WithUnhashableStatic:
  x: jax.Array
  notes: list = struct.field(pytree_node=False)


def test_leaf_names_are_cached_per_structure_and_static_lists_still_save(
    tmp_path):
  tree = {"a": {"b": jnp.ones(3)}, "c": [jnp.zeros(2), 1.5]}
  first, treedef = treepaths.leaf_paths(tree)
  again, _ = treepaths.leaf_paths(jax.tree.map(lambda x: x, tree))
  assert [p for p, _, _ in first] == ["a/b", "c/0", "c/1"]
  assert [(p, k) for p, k, _ in again] == [(p, k) for p, k, _ in first]
  assert treedef in treepaths._PATHS  # pylint: disable=protected-access
  odd = _WithUnhashableStatic(x=jnp.arange(3.0), notes=["kept out"])
  manager = CheckpointManager(tmp_path / "ckpt")
  manager.save(1, odd)
  manager.wait_until_finished()
  restored = manager.restore(odd)
  assert restored.notes == ["kept out"]
  np.testing.assert_array_equal(restored.x, np.arange(3.0))
  manager.close()
