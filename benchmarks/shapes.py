"""Train states shaped like real models, for the scaling benchmark.

Each shape is a pytree of jax arrays on device 0, built deterministically
from `--seed` and passed once through a jitted train step that donates its
input, so that its buffers are a training step's outputs:

- `many`: `--leaves` leaves totalling `--state-mb` MB (10^6 bytes), in
  nested dicts like a model's (`{"layer_17": {"mlp": {"kernel": ...}}}`),
  a few leaves per layer. Their sizes run from a few bytes (0-d scalars,
  tiny vectors) to tens of MB (embeddings), and their dtypes are mostly
  float32, some bfloat16 and int8, a few int32. Every leaf takes one of 30
  shapes, as a model reuses a few shapes many times.
- `transformer`: a Flax `TrainState` of a transformer's parameters with
  Adam's state, so the tree holds the `TrainState` and optax namedtuples:
  embeddings, `--unscanned-layers` layers each with attention query, key,
  value and output kernels and biases, two layer norms and an MLP, and a
  `scanned` block holding `--scanned-layers` such layers stacked on a
  leading axis, all `--d-model` wide. The defaults make about 1500 leaves
  and 210 MB.
- `large`: few large float32 leaves (64 to 128 MB) totalling `--state-mb`.

The train step is an elementwise update of every leaf (floats
`x * 0.999 + 0.001`, integers `x + 1`, each kept in its dtype) and a scalar
loss: it rewrites the whole state, as an optimizer does, at memory speed.
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Any

import ml_dtypes
import numpy as np

SHAPES = ("many", "transformer", "large")
DEFAULT_STATE_MB = {"many": 200, "large": 6000}
MB = 10**6


def add_arguments(parser: argparse.ArgumentParser) -> Any:
  """Adds the shapes' options, in a group that it returns."""
  group = parser.add_argument_group("model-like shapes (--shape other than"
                                    " dense)")
  group.add_argument("--leaves", type=int, default=5000,
                     help="many: number of leaves")
  group.add_argument("--state-mb", type=float, default=None,
                     help="many, large: total size in MB (default: many"
                     f" {DEFAULT_STATE_MB['many']}, large"
                     f" {DEFAULT_STATE_MB['large']})")
  group.add_argument("--d-model", type=int, default=192,
                     help="transformer: width")
  group.add_argument("--unscanned-layers", type=int, default=30,
                     help="transformer: layers with their own subtrees")
  group.add_argument("--scanned-layers", type=int, default=6,
                     help="transformer: layers stacked in one subtree")
  group.add_argument("--vocab", type=int, default=8192,
                     help="transformer: embedding rows")
  group.add_argument("--seed", type=int, default=0)
  return group


def _state_bytes(args: argparse.Namespace) -> int:
  mb = args.state_mb
  return int((DEFAULT_STATE_MB[args.shape] if mb is None else mb) * MB)


def _dims(n: int, cols: int) -> tuple[int, int]:
  """A 2-D shape of about `n` elements with at most `cols` columns."""
  cols = max(1, min(cols, n))
  return max(1, round(n / cols)), cols


def _many_menu(args: argparse.Namespace):
  """The 30 (shape, dtype) pairs of `many` and how many leaves take each.

  Four tiny entries (0-d scalars, vectors of 2 and 4) take 2% of the
  leaves; eight vector entries of 256 B to 32 KB take 45%; two embedding
  entries take a quarter of the bytes in one leaf each; sixteen matrix
  entries take the rest of the leaves, fewer of the larger ones, their
  sizes spread over a factor of 256 and scaled together so that the total
  comes out at `--state-mb`.
  """
  rng = np.random.default_rng(args.seed)
  n, total = args.leaves, _state_bytes(args)
  if n < 100:
    raise ValueError(f"--leaves must be at least 100, got {n}")
  f32, bf16, i8, i32 = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16),
                        np.dtype(np.int8), np.dtype(np.int32))
  menu = [((), f32), ((), i32), ((2,), f32), ((4,), i32)]
  n_tiny = max(4, n // 50)
  counts = [n_tiny - 3 * (n_tiny // 4)] + [n_tiny // 4] * 3
  # Vectors (biases, norm scales): fixed sizes, unless they would take
  # more than 30% of a small state.
  n_vec = max(8, round(0.45 * n))
  vec_bytes = np.geomspace(256, 32 << 10, 8)
  vec_dtypes = rng.permutation([f32] * 5 + [bf16, i8, i32])
  vec_counts = np.full(8, n_vec // 8)
  vec_counts[: n_vec % 8] += 1
  vec_bytes *= min(1.0, 0.3 * total / (vec_counts * vec_bytes).sum())
  for b, dt, c in zip(vec_bytes, vec_dtypes, vec_counts):
    menu.append(((max(1, round(b / dt.itemsize)),), dt))
    counts.append(int(c))
  # Embeddings: a quarter of the bytes, in two leaves.
  for share, dt in ((0.15, f32), (0.10, bf16)):
    menu.append((_dims(max(1, round(share * total / dt.itemsize)), 512), dt))
    counts.append(1)
  # Matrices: the rest, sizes log-spaced, counts falling with size.
  n_mat = max(16, n - sum(counts))
  rel = np.geomspace(1, 256, 16) * rng.uniform(0.9, 1.1, 16)
  weights = rel ** -0.3
  mat_counts = np.maximum(1, np.round(weights / weights.sum() * n_mat)
                          ).astype(int)
  mat_counts[0] += n_mat - mat_counts.sum()  # Exactly n leaves in all.
  mat_dtypes = rng.permutation([f32] * 11 + [bf16] * 3 + [i8] * 2)
  used = sum(math.prod(s) * dt.itemsize * c for (s, dt), c in zip(menu,
                                                                  counts))
  scale = max(total - used, 0) / (mat_counts * rel).sum()
  cols = rng.choice([128, 256, 512, 1024], 16)
  for r, dt, c, k in zip(rel, mat_dtypes, mat_counts, cols):
    menu.append((_dims(max(1, round(r * scale / dt.itemsize)), int(k)), dt))
    counts.append(int(c))
  return menu, counts


_MODULES = ("attention", "mlp", "norm")
_NAMES = ("kernel", "bias")


def _many_spec(args: argparse.Namespace) -> dict:
  """`many`'s tree of abstract leaves: a few leaves per layer dict."""
  import jax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(args.seed + 1)
  menu, counts = _many_menu(args)
  # The two embeddings (entries 12 and 13) sit at the top, as a model's do.
  embeddings = [jax.ShapeDtypeStruct(*menu[i]) for i in (12, 13)]
  rest = [i for i in range(len(menu)) if i not in (12, 13)]
  order = rng.permutation(np.repeat(rest, [counts[i] for i in rest]))
  leaves = [jax.ShapeDtypeStruct(*menu[i]) for i in order]
  tree = {"embed": {"tokens": embeddings[0], "positions": embeddings[1]}}
  start, layer = 0, 0
  while start < len(leaves):
    group = leaves[start:start + int(rng.integers(2, 7))]
    start += len(group)
    modules = tree[f"layer_{layer}"] = {}
    for k, leaf in enumerate(group):
      modules.setdefault(_MODULES[k // 2], {})[_NAMES[k % 2]] = leaf
    layer += 1
  return tree


def _large_spec(args: argparse.Namespace) -> dict:
  """`large`'s tree: float32 blocks of 64, 96 or 128 MB (4 equal ones in a
  state under 256 MB)."""
  import jax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(args.seed)
  total = _state_bytes(args)
  if total < 256 * MB:
    sizes = [total // 4] * 4
  else:
    sizes = []
    while total - sum(sizes) > 0:
      sizes.append(min(int(rng.choice([64, 96, 128])) * MB,
                       total - sum(sizes)))
  return {f"block_{i}": {"kernel": jax.ShapeDtypeStruct(
      _dims(max(1, b // 4), 4096), np.float32)} for i, b in enumerate(sizes)}


def _layer(d: int, lead: tuple[int, ...] = ()) -> dict:
  """One transformer layer's parameters, Flax's names and shapes."""
  import jax  # pylint: disable=g-import-not-at-top
  heads = max(1, d // 64)

  def p(*shape):
    return jax.ShapeDtypeStruct(lead + shape, np.float32)

  def proj():
    return {"kernel": p(d, heads, d // heads), "bias": p(heads, d // heads)}

  def norm():
    return {"scale": p(d), "bias": p(d)}

  return {
      "attention": {"query": proj(), "key": proj(), "value": proj(),
                    "out": {"kernel": p(heads, d // heads, d),
                            "bias": p(d)}},
      "ln_1": norm(), "ln_2": norm(),
      "mlp": {"wi": {"kernel": p(d, 4 * d), "bias": p(4 * d)},
              "wo": {"kernel": p(4 * d, d), "bias": p(d)}},
  }


def _transformer_params(args: argparse.Namespace) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  d = args.d_model
  params = {"embed": {"embedding": jax.ShapeDtypeStruct((args.vocab, d),
                                                        np.float32)},
            "pos_embed": {"embedding": jax.ShapeDtypeStruct((1024, d),
                                                            np.float32)}}
  for i in range(args.unscanned_layers):
    params[f"layers_{i}"] = _layer(d)
  params["scanned"] = {"layers": _layer(d, (args.scanned_layers,))}
  params["final_ln"] = {"scale": jax.ShapeDtypeStruct((d,), np.float32),
                        "bias": jax.ShapeDtypeStruct((d,), np.float32)}
  return {"params": params}


@functools.cache
def _tx():
  """One optimizer for the process, so that every TrainState built here has
  the same static fields (equal treedefs)."""
  import optax  # pylint: disable=g-import-not-at-top
  return optax.adam(1e-3)


def _create_train_state(params):
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  return train_state.TrainState.create(apply_fn=None, params=params,
                                       tx=_tx())


def _update(x):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if jnp.issubdtype(x.dtype, jnp.floating):
    return (x * 0.999 + 0.001).astype(x.dtype)
  return x + jnp.ones((), x.dtype)


def step_fn(state: Any) -> tuple[Any, Any]:
  """The train step: every leaf updated in place, and a scalar loss."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  state = jax.tree.map(_update, state)
  first = jax.tree.leaves(state)[0]
  return state, first.reshape(-1)[0].astype(jnp.float32)


@functools.cache
def train_step():
  """`step_fn`, jitted, donating the state."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.jit(step_fn, donate_argnums=0)


@functools.cache
def _leaf_fn():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  @functools.partial(jax.jit, static_argnums=(2, 3))
  def leaf(seed, index, shape, dtype):
    key = jax.random.fold_in(jax.random.key(seed), index)
    if jnp.issubdtype(dtype, jnp.floating):
      return jax.random.normal(key, shape, jnp.float32).astype(dtype)
    info = jnp.iinfo(dtype)
    return jax.random.randint(key, shape, max(info.min, -1000),
                              min(info.max, 1000), dtype)
  return leaf


def _fill(spec: Any, seed: int) -> Any:
  """Concrete leaves for an abstract tree: leaf i from fold_in(seed, i)."""
  import jax  # pylint: disable=g-import-not-at-top
  leaves, treedef = jax.tree.flatten(spec)
  leaf = _leaf_fn()
  return treedef.unflatten([leaf(seed, i, tuple(s.shape), np.dtype(s.dtype))
                            for i, s in enumerate(leaves)])


def initial_spec(args: argparse.Namespace) -> Any:
  """The abstract tree that `build` fills, before its first train step."""
  import jax  # pylint: disable=g-import-not-at-top
  if args.shape == "many":
    return _many_spec(args)
  if args.shape == "large":
    return _large_spec(args)
  return jax.eval_shape(_create_train_state, _transformer_params(args))


def build(args: argparse.Namespace) -> Any:
  """The shape's state on device 0, the output of two donating steps."""
  if args.shape == "transformer":
    state = _create_train_state(_fill(_transformer_params(args), args.seed))
  else:
    state = _fill(initial_spec(args), args.seed)
  for _ in range(2):  # Compiles the step; the state becomes its output.
    state, loss = train_step()(state)
    float(loss)
  return state


def abstract_target(args: argparse.Namespace) -> Any:
  """What `build` returns, as `ShapeDtypeStruct`s on device 0."""
  import jax  # pylint: disable=g-import-not-at-top
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.eval_shape(step_fn, initial_spec(args))[0]
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      abstract)
