"""docs/format.md is right: its numpy-only reader reads real checkpoints.

The reader is taken from the page itself, so a change of the format that the
page does not follow fails here.
"""

import os

_TWO_DEVICES = "--xla_force_host_platform_device_count=2"
if _TWO_DEVICES not in os.environ.get("XLA_FLAGS", ""):  # Before jax loads.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " " + _TWO_DEVICES).strip()

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import pathlib
import re
import subprocess
import sys
from typing import Any

from flax import linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from flax_ckpt_plugin import CheckpointManager

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "format.md"


def reader_source() -> str:
  """The ```python block of docs/format.md that defines load_checkpoint."""
  blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(),
                      re.S | re.M)
  found = [b for b in blocks if "def load_checkpoint(" in b]
  assert len(found) == 1, "docs/format.md must define load_checkpoint once"
  return found[0]


def load_checkpoint(step_dir: pathlib.Path) -> dict[str, Any]:
  namespace: dict[str, Any] = {}
  exec(compile(reader_source(), str(DOC), "exec"), namespace)  # pylint: disable=exec-used
  return namespace["load_checkpoint"](os.fspath(step_dir))


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))


def make_state() -> train_state.TrainState:
  model = MLP()
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-2))
  # One update, so that the optimizer moments are not all zero.
  grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)
                                         ).reshape(p.shape), state.params)
  return state.apply_gradients(grads=grads)


def shard_over_two_devices(tree: Any) -> Any:
  """Matrices split by columns, vectors by rows, scalars replicated."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

  def place(x):
    if not isinstance(x, jax.Array):  # TrainState.step is a Python int.
      return x
    if x.ndim == 2:
      spec = P(None, "x")
    elif x.ndim == 1 and x.shape[0] % 2 == 0:
      spec = P("x")
    else:
      spec = P()
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(place, tree)


def key_str(key: Any) -> str:
  """One level of a key path, as docs/format.md spells it."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  raise TypeError(key)


def expected_leaves(tree: Any) -> dict[str, Any]:
  """{'a/b/c': value} as the doc says the reader returns it."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = "/".join(key_str(k) for k in path)
    if isinstance(leaf, jax.Array) and jnp.issubdtype(
        leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    out[name] = leaf if isinstance(leaf, (bool, int, float)) else np.asarray(
        leaf)
  return out


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
  assert sorted(actual) == sorted(expected)
  for path, e in expected.items():
    a = actual[path]
    if isinstance(e, (bool, int, float)):
      assert type(a) is type(e) and a == e, (path, a, e)
      continue
    assert isinstance(a, np.ndarray), path
    assert a.dtype == e.dtype, (path, a.dtype, e.dtype)
    assert a.shape == e.shape, (path, a.shape, e.shape)
    assert a.tobytes() == e.tobytes(), path


def save(directory: pathlib.Path, step: int, state: Any,
         **kwargs: Any) -> pathlib.Path:
  with CheckpointManager(directory) as mngr:
    mngr.save(step, state, **kwargs)
  return directory / str(step)


@pytest.fixture(name="state")
def state_fixture():
  """A TrainState with extras: sharded, bfloat16, keys, numpy, scalars."""
  assert jax.device_count() >= 2, "needs XLA_FLAGS=" + _TWO_DEVICES
  state = shard_over_two_devices(make_state())
  extras = {
      "bf16": jnp.linspace(-3, 3, 10, dtype=jnp.bfloat16).reshape(2, 5),
      "f8": jnp.arange(6, dtype=jnp.float8_e4m3fn),
      "mask": jnp.array([True, False, True]),
      "count": jnp.int32(7),
      "key": jax.random.key(42),
      "raw_key": jax.random.PRNGKey(3),
      "host": np.arange(12, dtype=np.int16).reshape(3, 4),
      "epoch": 3,
      "lr": 0.125,
      "done": False,
  }
  return {"state": state, "extras": extras}


def test_reader_returns_every_saved_leaf(tmp_path, state):
  step_dir = save(tmp_path / "ckpt", 5, state, extra={"epoch": 1},
                  metrics={"loss": 0.5})
  kernel = state["state"].params["Dense_0"]["kernel"]
  assert len(kernel.sharding.device_set) == 2  # Two shards on disk.

  assert_same(load_checkpoint(step_dir), expected_leaves(state))


@pytest.mark.multiprocess
def test_reader_works_without_jax(tmp_path, state):
  """The reader needs numpy and json only (ml_dtypes for bfloat16)."""
  step_dir = save(tmp_path / "ckpt", 1, state)
  script = reader_source() + (
      "\nimport json, sys\n"
      "values = load_checkpoint(sys.argv[1])\n"
      "assert 'jax' not in sys.modules, 'the reader imported jax'\n"
      "print(json.dumps({p: v if isinstance(v, (bool, int, float)) else\n"
      "                  [str(v.dtype), list(v.shape), v.tobytes().hex()]\n"
      "                  for p, v in values.items()}))\n")
  result = subprocess.run([sys.executable, "-c", script, os.fspath(step_dir)],
                          capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr
  got = json.loads(result.stdout)
  want = {p: v if isinstance(v, (bool, int, float)) else
          [str(v.dtype), list(v.shape), v.tobytes().hex()]
          for p, v in expected_leaves(state).items()}
  assert got == want


def test_layout_and_manifest_fields_are_documented(tmp_path, state):
  step_dir = save(tmp_path / "ckpt", 12, state, extra=[1, "a"],
                  metrics={"loss": 2.0})
  files = sorted(p.relative_to(step_dir).as_posix()
                 for p in step_dir.rglob("*") if p.is_file())
  assert files == ["_COMMITTED", "data/process_00000.bin", "manifest.json"]
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["12", "_WRITER"]

  doc = DOC.read_text()
  manifest = json.loads((step_dir / "manifest.json").read_text())
  names = set(manifest)
  for leaf in manifest["leaves"]:
    names |= set(leaf)
    for shard in leaf.get("shards", []):
      names |= set(shard)
  spelled = {f"`{name}`" for name in names}
  for leaf in manifest["leaves"]:
    spelled |= {f'`{{"{k}": ' for key in leaf["keys"] for k in key}
  undocumented = sorted(s for s in spelled if s not in doc)
  assert not undocumented, f"docs/format.md does not mention {undocumented}"
  assert manifest["format_version"] == 1 and manifest["step"] == 12
  assert manifest["extra"] == [1, "a"]
  assert manifest["metrics"] == {"loss": 2.0}
  assert manifest["files"] == {
      "data/process_00000.bin":
          (step_dir / "data" / "process_00000.bin").stat().st_size}
  kinds = {leaf["path"]: leaf["kind"] for leaf in manifest["leaves"]}
  assert kinds["extras/epoch"] == "int" and kinds["extras/lr"] == "float"
  assert kinds["extras/done"] == "bool" and kinds["extras/host"] == "numpy"
  assert kinds["state/step"] == "int"
  key_leaf = [leaf for leaf in manifest["leaves"]
              if leaf["path"] == "extras/key"][0]
  assert key_leaf["key_impl"] == "threefry2x32"
  assert key_leaf["dtype"] == "uint32" and key_leaf["shape"] == [2]


def test_reader_refuses_unfinished_step(tmp_path, state):
  """The doc's reader refuses a step without the commit marker."""
  step_dir = save(tmp_path / "ckpt", 3, state)
  (step_dir / "_COMMITTED").unlink()
  with pytest.raises(FileNotFoundError, match="not a finalized checkpoint"):
    load_checkpoint(step_dir)
