"""Shared fixtures of the single-process tests.

XLA_FLAGS is set before anything imports jax, so that every test process sees
two CPU devices and sharded saves and restores can be tested without an
accelerator.
"""

import os

_TWO_DEVICES = "--xla_force_host_platform_device_count=2"
if _TWO_DEVICES not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " " + _TWO_DEVICES).strip()

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import subprocess
from typing import Any, Callable

import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest


class SmallMLP(nn.Module):
  """Two Dense layers: 'params/Dense_0/kernel' etc. in the saved tree."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(4)(x)


_INPUT = np.linspace(-1.0, 1.0, 4 * 8, dtype=np.float32).reshape(4, 8)
_LABELS = np.cos(np.arange(4 * 4, dtype=np.float32)).reshape(4, 4)


# One model and optimizer for all states, so that states share their static
# fields (apply_fn, tx): their treedefs compare equal and jit compiles once.
_MODEL = SmallMLP()
_TX = optax.adam(1e-2)


def create_state(seed: int = 0) -> train_state.TrainState:
  """A deterministic TrainState (adam) of `SmallMLP`; step is Python 0."""
  params = _MODEL.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.float32))
  return train_state.TrainState.create(
      apply_fn=_MODEL.apply, params=params, tx=_TX)


@functools.partial(jax.jit, donate_argnums=0)
def _donating_step(state, x, y):
  def loss_fn(params):
    return jnp.mean((state.apply_fn(params, x) - y) ** 2)
  return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))


def is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype,
                                                     jax.dtypes.prng_key)


def host_copy(tree: Any) -> Any:
  """Copies every jax.Array to an independent buffer (numpy, or a new key).

  The copies stay valid when the originals are donated.
  """
  def copy(x):
    if is_key(x):
      return jax.random.wrap_key_data(np.array(jax.random.key_data(x)),
                                      impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array):
      return np.array(x)
    return x
  return jax.tree.map(copy, tree)


def assert_trees_equal(actual: Any, expected: Any) -> None:
  """Asserts the same tree type and leaf paths, and bit-identical leaves.

  Array leaves (jax or numpy) are compared by dtype, shape and raw bytes, so
  NaN payloads and -0.0 count. Python scalars must keep their Python type.
  Static fields (a TrainState's apply_fn and tx) are not compared.
  """
  assert type(actual) is type(expected)
  flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  flat_e = jax.tree_util.tree_flatten_with_path(expected)[0]
  assert [p for p, _ in flat_a] == [p for p, _ in flat_e]
  for (path, a), (_, e) in zip(flat_a, flat_e):
    where = jax.tree_util.keystr(path)
    if is_key(a) or is_key(e):
      assert is_key(a) and is_key(e), where
      assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(e)), where
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    if isinstance(e, (bool, int, float)) or isinstance(a, (bool, int, float)):
      assert type(a) is type(e), f"{where}: {type(a)} != {type(e)}"
      assert repr(a) == repr(e), f"{where}: {a!r} != {e!r}"
      continue
    a, e = np.asarray(a), np.asarray(e)
    assert a.dtype == e.dtype, f"{where}: {a.dtype} != {e.dtype}"
    assert a.shape == e.shape, f"{where}: {a.shape} != {e.shape}"
    assert a.tobytes() == e.tobytes(), f"{where}: values differ"


@pytest.fixture
def make_state() -> Callable[..., train_state.TrainState]:
  """Factory of deterministic small TrainStates: `make_state(seed=0)`."""
  return create_state


@pytest.fixture
def train_step() -> Callable[[train_state.TrainState],
                             train_state.TrainState]:
  """One adam step on a fixed batch; donates (deletes) its input state."""
  return lambda state: _donating_step(state, _INPUT, _LABELS)


@pytest.fixture(name="assert_trees_equal")
def assert_trees_equal_fixture() -> Callable[[Any, Any], None]:
  return assert_trees_equal


@pytest.fixture(name="host_copy")
def host_copy_fixture() -> Callable[[Any], Any]:
  return host_copy


@pytest.fixture
def ckpt_dir(tmp_path):
  """A checkpoint directory that does not exist yet (managers create it)."""
  return tmp_path / "ckpt"


# Fixtures that start a process (test_object_store's S3 and GCS servers): a
# test that uses one is in the multiprocess tier, like a test that starts
# its own.
_PROCESS_FIXTURES = frozenset({"store_server"})


def pytest_collection_modifyitems(items):
  for item in items:
    if _PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
      item.add_marker(pytest.mark.multiprocess)


@pytest.fixture
def small_tmpfs(tmp_path):
  """An 8 MiB tmpfs, so that a disk can really run full; unmounted after."""
  mnt = tmp_path / "tmpfs"
  mnt.mkdir()
  try:
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
        capture_output=True, text=True, timeout=60, check=False)
  except (OSError, subprocess.SubprocessError) as e:
    pytest.skip(f"cannot mount a small tmpfs to fill up: {e}")
  if mounted.returncode != 0:
    pytest.skip("cannot mount a small tmpfs to fill up (needs root or"
                f" CAP_SYS_ADMIN): {mounted.stderr.strip()}")
  try:
    yield mnt
  finally:
    unmounted = subprocess.run(["umount", str(mnt)], capture_output=True,
                               check=False)
    if unmounted.returncode != 0:  # Still busy: detach it all the same.
      subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def run(capsys):
  """`run(*args)` runs `flax-ckpt args` in this process (`cli.main`), as a
  shell would: its exit code, stdout and stderr, kept apart."""
  from flax_ckpt_plugin.tools import cli  # pylint: disable=g-import-not-at-top

  def call(*args) -> subprocess.CompletedProcess:
    argv = [str(a) for a in args]
    capsys.readouterr()  # Only this call's output.
    try:
      code = cli.main(argv)
    except SystemExit as e:  # argparse's usage errors.
      code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)
  return call
