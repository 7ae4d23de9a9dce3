"""GPT-2's tensors as the Hugging Face hub publishes them, and a Flax target.

`shapes` names every tensor of a GPT-2 `model.safetensors` (`wte.weight`,
`h.0.attn.c_attn.weight`, ..., and the causal-mask buffers
`h.N.attn.bias` that older conversions kept), at any width: width 768,
12 layers, a 50257-token vocabulary and 1024 positions is GPT-2 small
(124M parameters, 498 MB in float32). `write` writes them with the
safetensors package itself, one file or sharded with the hub's index.
`RENAME` maps them onto a Flax tree of linen names (`params/h_0/attn/
c_attn/kernel`, LayerNorm `scale`), dropping the mask buffers, and
`flax_shapes` lists that tree. Imported by the tests, the worker
`safetensors_load.py` and `benchmarks/safetensors_load.py`; imports no
JAX unless the flax flavour is written.
"""

from __future__ import annotations

import json
import os
import re
from typing import Sequence

import numpy as np

# GPT-2 small.
WIDTH, LAYERS, VOCAB, POSITIONS = 768, 12, 50257, 1024

# Checkpoint path (a tensor's name, dots as slashes) -> Flax target path.
RENAME = {
    r"(wte|wpe)/weight": r"params/\1/embedding",
    r"h/(\d+)/attn/bias": None,  # The causal mask: a buffer, no parameter.
    r"h/(\d+)/(ln_\d)/weight": r"params/h_\1/\2/scale",
    r"h/(\d+)/(attn|mlp)/(\w+)/weight": r"params/h_\1/\2/\3/kernel",
    r"h/(\d+)/(.*)": r"params/h_\1/\2",
    r"ln_f/weight": r"params/ln_f/scale",
    r"ln_f/bias": r"params/ln_f/bias",
}


def shapes(width: int = WIDTH, layers: int = LAYERS, vocab: int = VOCAB,
           positions: int = POSITIONS, mask: bool = False
           ) -> dict[str, tuple[int, ...]]:
  """Every tensor's name and shape, in the order of the hub's files."""
  out = {"wte.weight": (vocab, width), "wpe.weight": (positions, width)}
  for i in range(layers):
    h = f"h.{i}"
    out.update({
        f"{h}.ln_1.weight": (width,), f"{h}.ln_1.bias": (width,),
        f"{h}.attn.c_attn.weight": (width, 3 * width),
        f"{h}.attn.c_attn.bias": (3 * width,),
        f"{h}.attn.c_proj.weight": (width, width),
        f"{h}.attn.c_proj.bias": (width,),
        f"{h}.ln_2.weight": (width,), f"{h}.ln_2.bias": (width,),
        f"{h}.mlp.c_fc.weight": (width, 4 * width),
        f"{h}.mlp.c_fc.bias": (4 * width,),
        f"{h}.mlp.c_proj.weight": (4 * width, width),
        f"{h}.mlp.c_proj.bias": (width,),
    })
    if mask:
      out[f"{h}.attn.bias"] = (1, 1, positions, positions)
  out.update({"ln_f.weight": (width,), "ln_f.bias": (width,)})
  return out


def flax_path(name: str) -> str | None:
  """The Flax target path of tensor `name` under `RENAME` (None: dropped)."""
  path = name.replace(".", "/")
  for pattern, replacement in RENAME.items():
    found = re.fullmatch(pattern, path)
    if found:
      return None if replacement is None else found.expand(replacement)
  return path


def flax_shapes(**kwargs) -> dict[str, tuple[int, ...]]:
  """The Flax tree's leaf paths and shapes (what `RENAME` makes)."""
  return {flax_path(n): s for n, s in shapes(**kwargs).items()
          if flax_path(n) is not None}


def values(name: str, shape: Sequence[int]) -> np.ndarray:
  """Deterministic float32 values of one tensor."""
  seed = int.from_bytes(name.encode(), "little") % (1 << 63)
  return np.random.default_rng(seed).standard_normal(shape, np.float32)


def write(folder: str | os.PathLike, files: int = 1, flavour: str = "numpy",
          **kwargs) -> dict[str, tuple[int, ...]]:
  """Writes the tensors with safetensors' `save_file` (numpy or flax):
  `model.safetensors`, or `files` files of about equal size named as the
  hub names them, with `model.safetensors.index.json`. Returns the shapes.
  """
  if flavour == "numpy":
    from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
    convert = lambda x: x
  else:
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from safetensors.flax import save_file  # pylint: disable=g-import-not-at-top
    convert = jnp.asarray
  folder = os.fspath(folder)
  os.makedirs(folder, exist_ok=True)
  table = shapes(**kwargs)
  if files == 1:
    save_file({n: convert(values(n, s)) for n, s in table.items()},
              os.path.join(folder, "model.safetensors"),
              metadata={"format": "np" if flavour == "numpy" else "flax"})
    return table
  total = sum(4 * int(np.prod(s)) for s in table.values())
  groups: list[list[str]] = [[]]
  size = 0
  for name, shape in table.items():
    if groups[-1] and size >= total * len(groups) / files:
      groups.append([])
    groups[-1].append(name)
    size += 4 * int(np.prod(shape))
  weight_map = {}
  for k, names in enumerate(groups):
    file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
    save_file({n: convert(values(n, table[n])) for n in names},
              os.path.join(folder, file))
    weight_map.update({n: file for n in names})
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              f, indent=2)
  return table
