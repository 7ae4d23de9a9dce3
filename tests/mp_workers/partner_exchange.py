"""Sends the partner copies of a sharded state (`exchange.Exchange.send`)
and reports what arrived: an FSDP leaf over all 8 devices, a leaf on a
2-D (data, model) mesh whose model axis spans the processes (each model
shard held by one process, twice), a replicated leaf (no copies), and a
numpy scalar.

    partner_exchange.py REPLICAS

Prints {"received": {path: [[region, sha256 of its values], ...]}}.
"""

import hashlib
import sys

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from flax_ckpt_plugin.tolerance import exchange

REPLICAS = int(sys.argv[1])
me, n = _setup.PROCESS_ID, _setup.NUM_PROCESSES
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
fsdp = Mesh(np.array(devices), ("fsdp",))
# model over the processes, data inside each process.
grid = Mesh(np.array(devices).reshape(n, 2).T, ("data", "model"))


def global_array(value, sharding):
  return jax.make_array_from_callback(value.shape, sharding,
                                      lambda index: value[index])


state = {
    "fsdp": global_array(np.arange(8 * 6, dtype=np.float32).reshape(8, 6),
                         NamedSharding(fsdp, P("fsdp"))),
    "grid": global_array(np.arange(4 * n * 3, dtype=np.int32).reshape(
        4 * n, 3), NamedSharding(grid, P("model"))),
    "bf16": global_array(np.arange(16, dtype=np.float32).astype(
        jax.numpy.bfloat16), NamedSharding(fsdp, P("fsdp"))),
    "replicated": global_array(np.ones(4, np.float32),
                               NamedSharding(fsdp, P())),
    "step": np.int32(7),
}
ex = exchange.Exchange({p: f"host{p}" for p in range(n)}, REPLICAS)
out = {}
for attempt in range(2):  # The second send reuses the plan and program.
  got = ex.send(state)
  out = {path: sorted([[list(map(list, s.index)),
                        hashlib.sha256(np.ascontiguousarray(
                            s.host()).reshape(-1).view(np.uint8)
                            .tobytes()).hexdigest()] for s in shards])
         for path, shards in got.items()}
_setup.emit({"received": out})
