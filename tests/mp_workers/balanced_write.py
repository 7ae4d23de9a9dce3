"""Saves a replicated state and reports who wrote how many bytes.

    balanced_write.py DIR LAYOUT     LAYOUT: data_parallel or hsdp, with
                                     /explicit: a mesh of Explicit axes

N processes x 2 devices. `data_parallel`: every array replicated on all
devices. `hsdp`: arrays sharded over the 2 devices of a process and
replicated over the processes. The state is an Adam-like tree of 1-4 MB
kernels with their two moments and small biases, so large shards are cut
among their holders and small ones written whole (`division`). Saves one
step, restores it into the same shardings, by this process alone and by
all together (`restore_newest_valid`, which shares the reading), and
prints the bytes this process wrote and read, the digests saved and
restored, the total bytes, and how many arrays went through pinned host
memory.
"""

import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

SHAPES = {"dense_0": (512, 512), "dense_1": (512, 2048), "dense_2": (1024, 512),
          "head": (512, 10),
          # 1.2 MB of 1002 rows: cut into ranges of 125 and 126 rows, which
          # a shared read pads to equal slots and takes back in order.
          "uneven": (1002, 300)}


def _state(mesh, spec):
  sharding = NamedSharding(mesh, spec)
  tree = {}
  for n, (name, shape) in enumerate(SHAPES.items()):
    for part in ("params", "mu", "nu"):
      values = np.random.default_rng(n).standard_normal(shape, np.float32)
      tree.setdefault(part, {})[name] = {
          "kernel": jax.device_put(values, sharding),
          "bias": jax.device_put(np.full(shape[1], n, np.float32),
                                 NamedSharding(mesh, P())),
      }
  tree["step"] = jax.device_put(jnp.int32(7), NamedSharding(mesh, P()))
  return tree


def main(directory: str, layout: str) -> dict:
  # jax.devices() lists each process's devices together: a row of the
  # (processes, 2) mesh is one process.
  devices = np.array(jax.devices()).reshape(jax.process_count(), 2)
  layout, _, axes = layout.partition("/")
  kind = {"": jax.sharding.AxisType.Auto,
          "explicit": jax.sharding.AxisType.Explicit}[axes]
  mesh = jax.sharding.Mesh(devices, ("replica", "fsdp"),
                           axis_types=(kind, kind))
  spec = P() if layout == "data_parallel" else P("fsdp")
  state = _state(mesh, spec)
  pinned = _setup.count_pinned()
  with flax_ckpt_plugin.CheckpointManager(
      directory, processes=Processes(barrier_timeout_secs=60)) as mgr:
    mgr.warm_up(state, wait=True)  # As the callback's start does.
    mgr.save(1, state)
    mgr.wait_until_finished()
    written = mgr.last_save_stats.process_bytes
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        state)
    restored = mgr.restore(target)  # This process alone: reads it all.
    read_alone = mgr.last_restore_stats.nbytes_read
    step, together = mgr.restore_newest_valid(target)  # Every process.
    read_together = mgr.last_restore_stats.nbytes_read
  return {"written": written, "pinned": pinned,
          "total": sum(a.nbytes for a in jax.tree.leaves(state)),
          "saved": _setup.leaf_digests(state),
          "restored": _setup.leaf_digests(restored),
          "read_alone": read_alone, "step_together": step,
          "read_together": read_together,
          "restored_together": _setup.leaf_digests(together),
          "on_target_shardings": all(
              a.sharding.is_equivalent_to(t.sharding, len(t.shape))
              for a, t in zip(jax.tree.leaves(together),
                              jax.tree.leaves(target)))}


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1], sys.argv[2]))
