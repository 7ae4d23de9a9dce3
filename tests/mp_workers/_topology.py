"""Shared part of the topology workers: N processes x K devices, any mesh.

The launcher passes K as `DEVICES_PER_PROCESS` (`devices_per_process=`), so a
checkpoint written by 4 processes x 2 devices can be read by 2 x 1 or 1 x 1.
A lone process runs without `jax.distributed`, like a single-host evaluation
job. The model has three Dense layers whose kernels are sharded on both mesh
axes, on one, or replicated, so that a reader on another mesh reads whole
saved shards, parts of them along the leading axis, and parts that cut the
last axis (many byte runs per shard).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any, Sequence

import _setup  # Pins 2 devices through XLA_FLAGS and imports jax.

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import jax

DEVICES_PER_PROCESS = int(os.environ.get("DEVICES_PER_PROCESS", "2"))
# This option takes precedence over the XLA flag that `_setup` pins, and must
# be set before a backend starts: so each run gets the launcher's count.
jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)

import flax.linen as nn
from flax.training import train_state
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from flax_ckpt_plugin.arrays import division

PROCESS_ID = _setup.PROCESS_ID
NUM_PROCESSES = _setup.NUM_PROCESSES
IN, HIDDEN, OUT, BATCH = 8, 16, 4, 32
AXES = ("data", "model")

# The writer's partitioning, by layer and parameter (the Adam moments mu/nu of
# a parameter share its spec). Leaves not listed (step, count) are replicated.
SPECS = {
    ("Dense_0", "kernel"): P("data", "model"),  # Both axes.
    ("Dense_0", "bias"): P("model"),
    ("Dense_1", "kernel"): P(None, "model"),  # One axis.
    ("Dense_1", "bias"): P(),
    ("Dense_2", "kernel"): P("data", None),  # One axis, whole rows.
    ("Dense_2", "bias"): P(),
}
# A partitioning the writer never used: kernels split along the other axis.
ALT_SPECS = {
    ("Dense_0", "kernel"): P("model", "data"),  # Transposed.
    ("Dense_0", "bias"): P(),
    ("Dense_1", "kernel"): P("model", None),  # Rows of column shards.
    ("Dense_1", "bias"): P("model"),  # Halves of a replicated leaf.
    ("Dense_2", "kernel"): P(None, "model"),  # Cuts the last axis.
    ("Dense_2", "bias"): P("model"),
}
LAYOUTS = {"same": SPECS, "alt": ALT_SPECS}


def init() -> None:
  """Joins the multi-controller run (alone: only sets up logging)."""
  if NUM_PROCESSES > 1:
    _setup.init()
  else:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  assert len(jax.local_devices()) == DEVICES_PER_PROCESS, jax.local_devices()


def make_mesh(shape: Sequence[int]) -> jax.sharding.Mesh:
  """A ('data', 'model') mesh over all devices, in process order.

  jax.devices() lists process 0's devices first, so in a (2, 4) mesh of
  4 x 2 devices the 'model' axis spans two processes.
  """
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), AXES)


def parse_shape(text: str) -> tuple[int, ...]:
  """'2x4' -> (2, 4)."""
  return tuple(int(d) for d in text.split("x"))


class MLP3(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(HIDDEN)(x))
    x = nn.relu(nn.Dense(HIDDEN)(x))
    return nn.Dense(OUT)(x)


# One model and one optimizer for every state: `apply_fn` and `tx` are a
# TrainState's pytree metadata, and JAX pairs two trees (a jit's
# `out_shardings` with its output, a restore target with the state) only
# when those are the same objects.
_MODEL = MLP3()
_TX = optax.adam(1e-2)


def _create(rng) -> train_state.TrainState:
  params = _MODEL.init(rng, jnp.zeros((1, IN)))["params"]
  return train_state.TrainState.create(
      apply_fn=_MODEL.apply, params=params, tx=_TX)


def _key_name(k: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def leaf_path(keypath) -> str:
  """'params/Dense_0/kernel': how the manifest names a leaf (docs/format.md)."""
  return "/".join(_key_name(k) for k in keypath)


def shardings(abstract: Any, mesh: jax.sharding.Mesh, specs: dict) -> Any:
  def one(keypath, _):
    names = tuple(_key_name(k) for k in keypath)[-2:]
    return NamedSharding(mesh, specs.get(names, P()))
  return jax.tree_util.tree_map_with_path(one, abstract)


def plain_abstract_state() -> Any:
  """`jax.eval_shape` of the TrainState: no shardings at all."""
  return jax.eval_shape(_create, jax.random.key(0))


def abstract_state(mesh: jax.sharding.Mesh, specs: dict) -> Any:
  """The restore target: ShapeDtypeStructs carrying NamedShardings."""
  shapes = plain_abstract_state()
  return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      shapes, shardings(shapes, mesh, specs))


def init_state(mesh: jax.sharding.Mesh, specs: dict = SPECS,
               seed: int = 0) -> train_state.TrainState:
  shapes = jax.eval_shape(_create, jax.random.key(seed))
  return jax.jit(_create, out_shardings=shardings(shapes, mesh, specs))(
      jax.random.key(seed))


def make_train_step(mesh: jax.sharding.Mesh, specs: dict = SPECS):
  """A jitted adam step that donates its input state, as real loops do."""
  sh = shardings(plain_abstract_state(), mesh, specs)

  def step(state):
    # The batch is derived from the step so no host input needs sharding.
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), state.step),
                          (BATCH, IN))
    y = jnp.sin(x[:, :OUT])

    def loss_fn(params):
      return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  return jax.jit(step, in_shardings=(sh,), out_shardings=sh,
                 donate_argnums=0)


def _nbytes(leaf: Any) -> int:
  return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def array_bytes_by_leaf(tree: Any) -> dict[str, int]:
  """Bytes of every array leaf's global value."""
  return {leaf_path(kp): _nbytes(l)
          for kp, l in jax.tree_util.tree_flatten_with_path(tree)[0]
          if hasattr(l, "shape")}


def owned_bytes_by_leaf(tree: Any) -> dict[str, int]:
  """Bytes this process writes, per leaf: its share under `division`.

  The tests check that the shares add up to every byte once, and that the
  process that writes most writes at most 1.25x an even share.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  pieces = division.plan(
      tuple((l.sharding, tuple(l.shape), np.dtype(l.dtype)) for _, l in flat),
      jax.process_index(), jax.process_count())
  return {leaf_path(kp): sum(
      math.prod(b - a for a, b in p.index) * l.dtype.itemsize for p in mine)
          for (kp, l), mine in zip(flat, pieces)}


def needed_bytes_by_leaf(target: Any) -> dict[str, int]:
  """Bytes of the distinct regions this process's target shards cover.

  From the target alone: `addressable_devices_indices_map` per leaf, regions
  held by several local devices counted once; a `ShapeDtypeStruct` without
  sharding lands on the first local device (the documented default); Python
  scalars are stored in the manifest and need no data bytes.
  """
  out = {}
  for kp, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
    if isinstance(leaf, (bool, int, float)):
      out[leaf_path(kp)] = 0
      continue
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None) or (
        jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    regions = {
        tuple(sl.indices(d)[:2] for sl, d in zip(index, shape))
        for index in sharding.addressable_devices_indices_map(shape).values()}
    itemsize = np.dtype(leaf.dtype).itemsize
    out[leaf_path(kp)] = sum(
        math.prod(hi - lo for lo, hi in r) * itemsize for r in regions)
  return out


def on_target_shardings(tree: Any, target: Any) -> bool:
  """Whether every restored array sits on its target's sharding."""
  ok = True
  for a, t in zip(jax.tree.leaves(tree), jax.tree.leaves(target)):
    want = getattr(t, "sharding", None) or (
        jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    ok &= a.sharding.is_equivalent_to(want, len(t.shape))
  return bool(ok)


def leaf_digests(tree: Any) -> dict[str, str]:
  """sha256 per leaf of the full global value (a collective: every process)."""
  return _setup.leaf_digests(tree)


def count_pinned() -> dict[str, int]:
  """See `_setup.count_pinned`."""
  return _setup.count_pinned()


def emit(result: Any) -> None:
  """Prints the worker's result as the last line of stdout."""
  _setup.emit(result)


def emit_and_exit(result: Any) -> None:
  """Prints the result, then leaves at once without interpreter shutdown.

  For a survivor of a killed peer: jax.distributed's shutdown barrier would
  fail (and may abort the process) at exit, and the coordination service
  terminates survivors after its heartbeat timeout anyway.
  """
  _setup.emit(result)
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access
