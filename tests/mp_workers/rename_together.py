"""`restore_together(target, rename=...)` on 2 processes x 2 devices, of a
state that both processes hold (split over each process's 2 devices,
replicated across the processes), saved under the old names.

    rename_together.py DIR

Saves {"params": {"Dense_0": {"kernel", "bias"}, "head": {"w"}}}, then
restores it together into {"params": {"encoder": {"layer_0": ...}}}, the
head dropped by the rename. Prints {"nbytes": bytes this process read,
"kernel_bytes": the kernel's bytes, "same": whether the restored leaves
equal what was saved under the old names, "error": the message of a
restore_together whose rename gives two leaves one path, "unmatched": that
of one whose rule matches no path whole}.
"""

import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.experimental.multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import _train
import flax_ckpt_plugin
from flax_ckpt_plugin import Processes

DIR = sys.argv[1]
mesh = _train.mesh()  # ("data", "model"): rows are the processes.
rng = np.random.default_rng(0)
old = {"kernel": rng.standard_normal((512, 64), np.float32),
       "bias": rng.standard_normal((64,), np.float32)}
specs = {"kernel": P(None, "model"), "bias": P()}
shardings = {k: NamedSharding(mesh, specs[k]) for k in old}
state = {"params": {
    "Dense_0": {k: jax.make_array_from_callback(
        v.shape, shardings[k], lambda index, v=v: v[index])
                for k, v in old.items()},
    "head": {"w": jax.make_array_from_callback(
        (4,), NamedSharding(mesh, P()), lambda index: np.ones(4)[index])}}}
target = {"params": {"encoder": {"layer_0": {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
    for k, v in old.items()}}}}
rules = {r"params/Dense_0/(.*)": r"params/encoder/layer_0/\1",
         r"params/head/.*": None}

with flax_ckpt_plugin.CheckpointManager(
    DIR, processes=Processes(barrier_timeout_secs=30)) as m:
  m.save(1, state)
with flax_ckpt_plugin.CheckpointManager(
    DIR, read_only=True, processes=Processes(barrier_timeout_secs=30)) as m:
  restored = m.restore_together(target, rename=rules)
  nbytes = m.last_restore_stats.nbytes_read
  try:
    m.restore_together(target, rename={r"params/(Dense_0|head)/.*": "x"})
    error = None
  except ValueError as e:
    error = str(e)
  try:  # A prefix, as re.sub takes it: renames nothing.
    m.restore_together(target, rename={r"^params/Dense_0/":
                                       "params/encoder/layer_0/",
                                       r"params/head/.*": None})
    unmatched = None
  except flax_ckpt_plugin.StructureMismatchError as e:
    unmatched = str(e)

layer = restored["params"]["encoder"]["layer_0"]
same = all(np.array_equal(np.asarray(
    jax.experimental.multihost_utils.process_allgather(layer[k], tiled=True)),
                          old[k]) for k in old)
_setup.emit({"nbytes": nbytes, "kernel_bytes": old["kernel"].nbytes,
             "same": same, "error": error, "unmatched": unmatched})
