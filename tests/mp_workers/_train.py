"""A small Flax linen model trained on a 2x2 mesh spanning two processes.

The shardings mix every case the writer must handle: leaves split over all
four devices, split across the processes, split within each process but
replicated across them, and fully replicated.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from flax_ckpt_plugin.arrays import division

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 32


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(HIDDEN)(x))
    return nn.Dense(OUT)(x)


def mesh() -> jax.sharding.Mesh:
  # Rows are processes: jax.devices() lists process 0's devices first.
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2),
                           ("data", "model"))


# Partition specs by the last two key names of a leaf (params and the Adam
# moments mu/nu of a layer share them).
SPECS = {
    ("Dense_0", "kernel"): P(("data", "model"), None),  # 4 shards.
    ("Dense_0", "bias"): P("model"),  # 2 shards, each on both processes.
    ("Dense_1", "kernel"): P("data", None),  # 1 shard per process.
    ("Dense_1", "bias"): P(),  # Replicated everywhere.
}
# Another layout, for restoring into a partitioning the writer never used.
ALT_SPECS = {
    ("Dense_0", "kernel"): P(None, ("model", "data")),
    ("Dense_0", "bias"): P("data"),
    ("Dense_1", "kernel"): P(None, "model"),
    ("Dense_1", "bias"): P("model"),
}


def _names(keypath) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k)))
               for k in keypath)


def shardings(abstract_state: Any, specs=None) -> Any:
  """NamedShardings for every leaf of `abstract_state` (scalars replicated)."""
  specs = SPECS if specs is None else specs
  m = mesh()

  def one(keypath, _):
    return NamedSharding(m, specs.get(_names(keypath)[-2:], P()))

  return jax.tree_util.tree_map_with_path(one, abstract_state)


# One model and one optimizer for every state: `apply_fn` and `tx` are a
# TrainState's pytree metadata, and JAX pairs two trees (a jit's
# `out_shardings` with its output, a restore target with the state) only
# when those are the same objects.
_MODEL = MLP()
_TX = optax.adam(1e-2)


def _create(rng) -> train_state.TrainState:
  params = _MODEL.init(rng, jnp.zeros((1, IN)))["params"]
  return train_state.TrainState.create(
      apply_fn=_MODEL.apply, params=params, tx=_TX)


def abstract_state(specs=None) -> Any:
  """The restore target: ShapeDtypeStructs carrying their sharding."""
  shapes = jax.eval_shape(_create, jax.random.key(0))
  return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      shapes, shardings(shapes, specs))


def init_state(seed: int = 0) -> train_state.TrainState:
  """A sharded TrainState whose arrays span both processes."""
  shapes = jax.eval_shape(_create, jax.random.key(seed))
  return jax.jit(_create, out_shardings=shardings(shapes))(
      jax.random.key(seed))


def make_train_step():
  """A jitted step that donates its input state, as real loops do."""
  shapes = jax.eval_shape(_create, jax.random.key(0))
  sh = shardings(shapes)

  def step(state):
    # The batch is derived from the step so no host input needs sharding.
    rng = jax.random.fold_in(jax.random.key(1), state.step)
    x = jax.random.normal(rng, (BATCH, IN))
    y = jnp.sin(x[:, :OUT])

    def loss_fn(params):
      pred = state.apply_fn({"params": params}, x)
      return jnp.mean((pred - y) ** 2)

    grads = jax.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)

  return jax.jit(step, in_shardings=(sh,), out_shardings=sh,
                 donate_argnums=0)


def total_array_bytes(tree: Any) -> int:
  """Bytes of all global arrays of `tree`, each counted once."""
  return sum(int(np.prod(l.shape)) * np.dtype(l.dtype).itemsize
             for l in jax.tree.leaves(tree))


def owned_bytes(tree: Any) -> int:
  """Bytes this process writes of `tree` (every leaf a global array): its
  share under `division`, which the tests check adds up to every byte
  once over the processes."""
  leaves = jax.tree.leaves(tree)
  pieces = division.plan(
      tuple((l.sharding, tuple(l.shape), np.dtype(l.dtype)) for l in leaves),
      jax.process_index(), jax.process_count())
  return sum(math.prod(b - a for a, b in p.index) * l.dtype.itemsize
             for l, mine in zip(leaves, pieces) for p in mine)


def shardings_match(tree: Any, target: Any) -> bool:
  """Whether every restored leaf sits on its target's sharding."""
  return all(a.sharding.is_equivalent_to(t.sharding, len(t.shape))
             for a, t in zip(jax.tree.leaves(tree), jax.tree.leaves(target)))
