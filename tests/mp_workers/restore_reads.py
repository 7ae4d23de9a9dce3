"""How much each restore reads, on 2 processes x 2 devices, of a state that
both processes hold (HSDP: split over each process's 2 devices, replicated
across the processes; and a fully replicated leaf).

    restore_reads.py DIR

Saves steps 1 and 2, then, with a read-only manager on every process:
`restore(target)` twice (each process reads everything; the first call
logs once that `restore_together` reads each byte once), then
`restore_together(target)` with no step (the newest, as the primary sees
it). Prints {"alone": bytes read, "alone_step", "together", "together_step",
"hints": log lines naming restore_together, "total": the checkpoint's
array bytes, "same": whether all three restores equal what was saved}.
"""

import logging
import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import _train
import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

DIR = sys.argv[1]
mesh = _train.mesh()  # ("data", "model"): rows are the processes.
rng = np.random.default_rng(0)
host = {"w": rng.standard_normal((512, 64), np.float32),
        "b": rng.standard_normal((64,), np.float32)}
specs = {"w": P(None, "model"), "b": P()}
target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                  sharding=NamedSharding(mesh, specs[k]))
          for k, v in host.items()}
state = {k: jax.make_array_from_callback(
    v.shape, target[k].sharding, lambda index, v=v: v[index])
         for k, v in host.items()}


class _Hints(logging.Handler):
  lines: list[str] = []

  def emit(self, record):
    if "restore() on each process" in record.getMessage():
      self.lines.append(record.getMessage())


logging.getLogger("flax_ckpt_plugin").addHandler(_Hints())
with flax_ckpt_plugin.CheckpointManager(
    DIR, processes=Processes(barrier_timeout_secs=30)) as m:
  m.save(1, state)
  m.save(2, state)
with flax_ckpt_plugin.CheckpointManager(
    DIR, read_only=True, processes=Processes(barrier_timeout_secs=30)) as m:
  alone = m.restore(target)
  m.restore(target)
  alone_stats = m.last_restore_stats
  together = m.restore_together(target)
  together_stats = m.last_restore_stats


def _same(tree):
  return all(np.array_equal(
      np.asarray(jax.experimental.multihost_utils.process_allgather(
          tree[k], tiled=True)), host[k]) for k in host)


import jax.experimental.multihost_utils  # pylint: disable=g-import-not-at-top
_setup.emit({"alone": alone_stats.nbytes_read, "alone_step": alone_stats.step,
             "together": together_stats.nbytes_read,
             "together_step": together_stats.step,
             "hints": _Hints.lines,
             "total": sum(v.nbytes for v in host.values()),
             "same": _same(alone) and _same(together)})
