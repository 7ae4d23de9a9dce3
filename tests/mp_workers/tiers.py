"""A data-parallel train loop with a local tier under the persistent one.

Usage: tiers.py DIR END PERSISTENT_EVERY LOCAL_EVERY [VICTIM KILL_STEP HEARTBEAT]

The mesh is ("data": one row per process, "model": the 2 devices of each
process): parameters and Adam moments are split over "model" and
replicated over "data", so every process holds a replica of every shard;
the batch is split over "data", so each step all-reduces gradients across
the processes. Each process's local tier is DIR/local_<process> (a per-host
path). The loop restores from the tiers, trains to END, and reports what it
restored, from which tier, and a digest of the final state.

With VICTIM, that process SIGKILLs itself once it finished step
KILL_STEP - 1 (writing the time to DIR/killed_at), with JAX's recoverability on and
heartbeat HEARTBEAT seconds; the survivors report how their loop ended and
leave as the documented loop does.
"""

import os
import pathlib
import sys
import time

import _setup

DIR = pathlib.Path(sys.argv[1])
END, PERSISTENT_EVERY, LOCAL_EVERY = (int(a) for a in sys.argv[2:5])
VICTIM, KILL_STEP, HEARTBEAT = (
    (int(a) for a in sys.argv[5:8]) if len(sys.argv) > 5 else (-1, -1, 0))
if VICTIM >= 0:
  _setup.init(recoverable=True, heartbeat_timeout_seconds=HEARTBEAT)
else:
  _setup.init()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax_ckpt_plugin import PeerLostError  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax_ckpt_plugin import PREEMPTED_EXIT_CODE  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import FaultTolerance

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 32
MESH = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(_setup.NUM_PROCESSES, 2),
    ("data", "model"))
SPECS = {("Dense_0", "kernel"): P(None, "model"), ("Dense_0", "bias"):
         P("model"), ("Dense_1", "kernel"): P("model", None)}
# TIERS_REPLICAS=r: the same leaves split over every device instead (no
# process holds a replica of another's shards), with partner copies
# (`FaultTolerance(replicas=r)`).
REPLICAS = int(os.environ.get("TIERS_REPLICAS", "0"))
if REPLICAS:
  ALL = ("data", "model")
  SPECS = {("Dense_0", "kernel"): P(ALL, None),  # (HIDDEN, OUT)
           ("Dense_1", "kernel"): P(None, ALL), ("Dense_1", "bias"): P(ALL)}


def _create(rng):
  return _setup.mlp_train_state(rng, (IN, HIDDEN, OUT))


def _sharding(keypath, _):
  names = tuple(str(getattr(k, "key", getattr(k, "name", k)))
                for k in keypath)[-2:]
  return NamedSharding(MESH, SPECS.get(names, P()))


SHAPES = jax.eval_shape(_create, jax.random.key(0))
SH = jax.tree_util.tree_map_with_path(_sharding, SHAPES)


def _step(state):
  rng = jax.random.fold_in(jax.random.key(1), state.step)
  x = jax.lax.with_sharding_constraint(
      jax.random.normal(rng, (BATCH, IN)), NamedSharding(MESH, P("data")))
  y = jnp.sin(x[:, :OUT])
  grads = jax.grad(lambda p: jnp.mean(
      (state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
  return state.apply_gradients(grads=grads)


train_step = jax.jit(_step, in_shardings=(SH,), out_shardings=SH,
                     donate_argnums=0)
state = jax.jit(_create, out_shardings=SH)(jax.random.key(0))
cb = CheckpointCallback(
    DIR / "ckpt", every_steps=PERSISTENT_EVERY, max_to_keep=2,
    tolerance=FaultTolerance(local_directory=DIR / f"local_{_setup.PROCESS_ID}",
                             local_every_steps=LOCAL_EVERY,
                             replicas=REPLICAS),
    processes=Processes(barrier_timeout_secs=60))
state = cb.restore_or_initialize(state)
result = {"restored_step": cb.restored_step, "restored_tier":
          cb.restored_tier, "restored_extra": cb.restored_extra,
          "persistent_restores": int(cb.manager.last_restore_stats
                                     is not None), "raised": None}
step = int(state.step)
try:
  for step in range(step + 1, END + 1):
    _setup.die_at(step, VICTIM, KILL_STEP, DIR, state)
    state = train_step(state)
    cb(step, state, extra={"step": step})
  cb.close()
except Exception as e:  # pylint: disable=broad-except
  result.update(raised=type(e).__name__, message=str(e)[:2000])
  if VICTIM >= 0:
    result.update(step=step, secs_after_kill=time.time() - float(
        (DIR / "killed_at").read_text()))
    _setup.emit(result)
    sys.exit(PREEMPTED_EXIT_CODE if isinstance(e, PeerLostError) else 1)
  raise
result.update(step=step, digests=_setup.leaf_digests(state))
_setup.emit(result)
