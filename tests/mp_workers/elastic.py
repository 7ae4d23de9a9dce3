"""A data-parallel loop that goes on without a lost process (`recover`).

Usage:
  elastic.py DIR END PERSISTENT_EVERY LOCAL_EVERY [VICTIM KILL_STEP HEARTBEAT]
  elastic.py verify DIR        (one process: digests of every persistent step)

The mesh is ("data",) over every device; the TrainState is replicated, the
global batch of BATCH rows is split over "data" (BATCH divides by 8 and 6
devices, so it stays the same when a process's 2 devices are lost). The
local tier is DIR/local_<process> every LOCAL_EVERY steps, the persistent
one DIR/ckpt every PERSISTENT_EVERY; the callback is elastic.

With VICTIM, that process SIGKILLs itself once it finished step
KILL_STEP - 1 (writing the time to DIR/killed_at); JAX's recoverability is
on, with heartbeat HEARTBEAT seconds, and CPU collectives time out after
COLLECTIVE_TIMEOUT (env WORKER_XLA_FLAGS, set by the test). The survivors
catch the loss, call `cb.recover(make_target)` and train to END.

With ELASTIC_REJOIN=1 the test relaunches the victim once it died: the
new process's `restore_or_initialize` waits until the survivors take it
back, at a step where their callback sets `should_rebuild` and they call
`cb.recover` again. Until then the survivors pause STEP_SECS after each
step (a slower model), so that the newcomer's start-up (importing JAX,
compiling) falls within the run. ELASTIC_PRIMARY: the persistent tier's
primary process (0 by default).

Reports: the digest of the state at every step a save started (by
generation: 0 before a recovery, 1 after, 2 after a rejoin), each recovery
(the step, the digest of the recovered state, seconds from the kill to the
recovery and to the first step completed after it), each rejoin, the
digest of every step after the first rejoin, where the state came from,
and the final state's digest.
"""

import functools
import hashlib
import os
import pathlib
import sys
import time

import _setup

VERIFY = sys.argv[1] == "verify"
if VERIFY:
  DIR = pathlib.Path(sys.argv[2])
  VICTIM = -1
else:
  DIR = pathlib.Path(sys.argv[1])
  END, PERSISTENT_EVERY, LOCAL_EVERY = (int(a) for a in sys.argv[2:5])
  VICTIM, KILL_STEP, HEARTBEAT = (
      (int(a) for a in sys.argv[5:8]) if len(sys.argv) > 5 else (-1, -1, 0))
if VERIFY:
  pass
elif VICTIM >= 0:
  _setup.init(recoverable=True, heartbeat_timeout_seconds=HEARTBEAT)
else:
  _setup.init()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from flax_ckpt_plugin import CheckpointCallback  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import FaultTolerance

IN, HIDDEN, OUT, BATCH = 8, 48, 4, 48
REJOIN = os.environ.get("ELASTIC_REJOIN") == "1"
STEP_SECS = 0.3
# "sharded": the first kernel's columns are split over every device (48
# divide over 8 and 6), so no survivor holds the lost process's columns.
SHARDED = os.environ.get("ELASTIC_LAYOUT") == "sharded"
# The mesh: "data" (1-D, the default); "model_in": (data, model) with each
# model pair the two devices of one process (in the job's first order);
# "model_across": (data, model) with each model pair on two processes. The
# batch's features are split over "model", so every step reduces over the
# model pairs.
MESH = os.environ.get("ELASTIC_MESH", "data")
# "fsdp": every leaf with a dimension of HIDDEN (parameters and Adam's
# moments) split along it over every device ("data"; with ELASTIC_MESH
# "model_procs", over "model": the mesh is (data, model) with "data" the
# two devices of one process and "model" across the processes): the lost
# process held the only copy of its shards. ELASTIC_REPLICAS: partner
# copies (`FaultTolerance(replicas=)`).
FSDP = os.environ.get("ELASTIC_LAYOUT") == "fsdp"
# ELASTIC_ALSO: more processes (comma-separated) killed with VICTIM.
ALSO = {int(p) for p in os.environ.get("ELASTIC_ALSO", "").split(",") if p}
REPLICAS = int(os.environ.get("ELASTIC_REPLICAS", "0"))


def _create(rng):
  return _setup.mlp_train_state(rng, (IN, HIDDEN, OUT))


SHAPES = jax.eval_shape(_create, jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _replicate(sharding):
  return jax.jit(lambda x: x, out_shardings=sharding.update(spec=P()))


def whole(leaf):
  """The leaf's whole value on each process (a collective)."""
  if not isinstance(leaf, jax.Array):
    return leaf
  if not leaf.is_fully_addressable:
    leaf = _replicate(leaf.sharding)(leaf)
  return np.asarray(leaf.addressable_data(0) if not leaf.is_fully_addressable
                    else leaf)


def digest(state) -> str:
  """sha256 of every leaf's bytes (replicated: this process's copy; the
  sharded layout digests this process's first shard; "fsdp" every leaf's
  whole value, called by every process together)."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(state):
    if FSDP:
      leaf = whole(leaf)
    value = np.asarray(leaf.addressable_shards[0].data if isinstance(
        leaf, jax.Array) else leaf)
    h.update(f"{value.dtype.str}{value.shape}".encode())
    h.update(np.ascontiguousarray(value).tobytes())
  return h.hexdigest()


def make_target(devices):
  """The abstract state on a mesh of `devices`; rebuilds the step too."""
  global train_step  # pylint: disable=global-statement
  if MESH == "data":
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    batch = NamedSharding(mesh, P("data"))
  elif MESH == "model_procs":
    mesh = jax.sharding.Mesh(np.array(devices).reshape(-1, 2).T,
                             ("data", "model"))
    batch = NamedSharding(mesh, P("data"))
  else:
    grid = (np.array(devices).reshape(-1, 2) if MESH == "model_in"
            else np.array(devices).reshape(2, -1).T)
    mesh = jax.sharding.Mesh(grid, ("data", "model"))
    batch = NamedSharding(mesh, P("data", "model"))

  def sharding(keypath, x):
    names = tuple(str(getattr(k, "key", getattr(k, "name", k)))
                  for k in keypath)[-2:]
    split = SHARDED and names == ("Dense_1", "kernel")  # (IN, HIDDEN)
    if FSDP and HIDDEN in x.shape:
      spec = [None] * x.ndim
      spec[x.shape.index(HIDDEN)] = "model" if MESH == "model_procs" else (
          "data")
      return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P(None, "data") if split else P())

  shardings = jax.tree_util.tree_map_with_path(sharding, SHAPES)

  def step_fn(state):
    rng = jax.random.fold_in(jax.random.key(1), state.step)
    x = jax.lax.with_sharding_constraint(
        jax.random.normal(rng, (BATCH, IN)), batch)
    y = jnp.sin(x[:, :OUT])
    grads = jax.grad(lambda p: jnp.mean(
        (state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  train_step = jax.jit(step_fn, out_shardings=shardings, donate_argnums=0)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      SHAPES, shardings)


if VERIFY:  # A fresh job of one process: every persistent step's digest.
  target = make_target(jax.devices())
  with CheckpointManager(DIR / "ckpt", read_only=True) as mgr:
    _setup.emit({str(s): digest(mgr.restore(target, s))
                 for s in mgr.all_steps()})
  sys.exit(0)

target = make_target(jax.devices())
state = jax.jit(_create, out_shardings=jax.tree.map(lambda t: t.sharding,
                                                    target))(
    jax.random.key(0))
cb = CheckpointCallback(
    DIR / "ckpt", every_steps=PERSISTENT_EVERY, max_to_keep=None,
    tolerance=FaultTolerance(local_directory=DIR / f"local_{_setup.PROCESS_ID}",
                             local_every_steps=LOCAL_EVERY, elastic=True,
                             replicas=REPLICAS),
    processes=Processes(barrier_timeout_secs=60,
                        primary_host=int(os.environ.get("ELASTIC_PRIMARY", "0"))))
state = cb.restore_or_initialize(state, make_target=make_target)
saved: dict[str, str] = {}  # "generation/step": digest, at saves.
recoveries, rejoins, digests = [], [], {}
generation, step = 0, int(state.step)
if cb.restored_tier == "peer":  # Relaunched: the survivors took it back.
  generation = 2
  rejoins.append({"step": step, "digest": digest(state)})
  digests[step] = digest(state)


def devices_of(tree) -> int:
  return len(jax.tree.leaves(tree)[0].sharding.device_set)


while step < END:
  try:
    for step in range(step + 1, END + 1):
      _setup.die_at(step, _setup.PROCESS_ID if _setup.PROCESS_ID in ALSO
                    else VICTIM, KILL_STEP, DIR, state)
      state = train_step(state)
      if recoveries and "first_step_secs" not in recoveries[-1]:
        jax.block_until_ready(state)
        # Not counting the test's own digest of the recovered state.
        recoveries[-1]["first_step_secs"] = time.time() - float(
            (DIR / "killed_at").read_text()) - recoveries[-1]["digest_secs"]
      if rejoins and "first_step_at" not in rejoins[-1]:
        jax.block_until_ready(state)
        rejoins[-1]["first_step_at"] = time.time()
      if cb(step, state):
        saved[f"{generation}/{step}"] = digest(state)
      if rejoins:
        digests[step] = digest(state)
      if cb.should_rebuild:  # The survivors take the relaunched one back.
        state, step = cb.recover(make_target)
        generation += 1
        rejoins.append({"step": step, "digest": digest(state),
                        "devices": devices_of(state)})
        digests[step] = digest(state)
      elif REJOIN and devices_of(state) < 8:
        time.sleep(STEP_SECS)
  except Exception as e:  # pylint: disable=broad-except
    if VICTIM < 0:
      raise
    failed = f"{type(e).__name__}: {str(e)[:300]}"
    state, step = cb.recover(make_target)
    generation += 1
    recovered_secs = time.time() - float((DIR / "killed_at").read_text())
    t = time.time()
    recoveries.append({
        "step": step, "digest": digest(state), "failed": failed,
        "recovered_secs": recovered_secs, "devices": devices_of(state)})
    recoveries[-1]["digest_secs"] = time.time() - t
cb.close()
_setup.emit({"restored_step": cb.restored_step, "saved": saved,
             "recoveries": recoveries, "step": step,
             "digest": digest(state), "rejoins": rejoins,
             "digests": digests, "tier": cb.restored_tier,
             "read_persistent": cb.manager.last_restore_stats is not None,
             "devices": devices_of(state)})
