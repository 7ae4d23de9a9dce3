"""Every kind of leaf that `save` accepts comes back as it went in.

A property test (hypothesis): a tree of any mix of Python scalars, numpy
scalars of every dtype, 0-d and n-d numpy and JAX arrays (bfloat16 and the
float8 types among them, any bit pattern: NaNs and infinities too), and
typed PRNG keys, saved and restored into itself, comes back with the same
leaf types, dtypes, shapes, shardings and bytes. Real files, a real
manager: nothing is faked.
"""

import tempfile

from hypothesis import example
from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from flax_ckpt_plugin import CheckpointManager
from helpers import has_key_impl

# Every numeric dtype a numpy leaf may have; JAX arrays take those JAX
# holds without 64-bit mode.
_NUMPY_DTYPES = [np.dtype(d) for d in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
    np.complex128, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3b11fnuz,
    ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz)]
_JAX_DTYPES = [d for d in _NUMPY_DTYPES
               if jax.dtypes.canonicalize_dtype(d) == d]
_KEY_IMPLS = [impl for impl in ("threefry2x32", "rbg", "philox4x32")
              if has_key_impl(impl)]


@st.composite
def _values(draw, dtype, shape):
  """Any bit pattern of `dtype` (booleans: False or True)."""
  size = int(np.prod(shape, dtype=np.int64))
  if dtype == np.bool_:
    return np.array(draw(st.lists(st.booleans(), min_size=size,
                                  max_size=size)), np.bool_).reshape(shape)
  raw = draw(st.binary(min_size=size * dtype.itemsize,
                       max_size=size * dtype.itemsize))
  return np.frombuffer(raw, dtype).reshape(shape).copy()


_SHAPES = st.lists(st.integers(0, 4), max_size=3).map(tuple)


@st.composite
def _leaf(draw):
  kind = draw(st.sampled_from(
      ["bool", "int", "float", "numpy_scalar", "numpy_array", "jax_array",
       "jax_scalar", "key"]))
  if kind == "bool":
    return draw(st.booleans())
  if kind == "int":
    return draw(st.integers(-2**63, 2**63 - 1))
  if kind == "float":
    return draw(st.floats(allow_nan=False, allow_infinity=False))
  if kind == "numpy_scalar":
    return draw(_values(draw(st.sampled_from(_NUMPY_DTYPES)), ()))[()]
  if kind == "numpy_array":
    return draw(_values(draw(st.sampled_from(_NUMPY_DTYPES)),
                        draw(_SHAPES)))
  if kind in ("jax_array", "jax_scalar"):
    shape = () if kind == "jax_scalar" else draw(_SHAPES)
    return jnp.asarray(draw(_values(draw(st.sampled_from(_JAX_DTYPES)),
                                    shape)))
  return jax.random.key(draw(st.integers(0, 2**31 - 1)),
                        impl=draw(st.sampled_from(_KEY_IMPLS)))


def _bytes(x) -> bytes:
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype,
                                                        jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.ascontiguousarray(np.asarray(x)).tobytes()


def _assert_same(got, want, where):
  if isinstance(want, jax.Array):
    assert isinstance(got, jax.Array), (where, type(got))
    assert got.dtype == want.dtype and got.shape == want.shape, (where, got)
    assert got.sharding == want.sharding, (where, got.sharding)
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
      assert jax.random.key_impl(got) == jax.random.key_impl(want), where
  else:
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, (np.ndarray, np.generic)):
      assert got.dtype == want.dtype and got.shape == want.shape, where
    else:
      assert got == want, (where, got, want)
      return
  assert _bytes(got) == _bytes(want), where


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(st.lists(_leaf(), min_size=1, max_size=6))
# Numpy scalars that are Python scalars too (`np.float64` is a float):
# once saved, then a KeyError at restore.
@example([np.float64(2.5), np.complex128(1 - 2j), np.bool_(True)])
@example([2.5, np.float64(np.nan), np.int64(-7), jnp.float32(np.inf)])
def test_every_leaf_kind_comes_back_as_it_went_in(leaves):
  tree = {f"leaf{n}": leaf for n, leaf in enumerate(leaves)}
  with tempfile.TemporaryDirectory() as directory:
    with CheckpointManager(directory) as manager:
      manager.save(1, tree)
      manager.wait_until_finished()
      restored = manager.restore(tree, 1)
  assert jax.tree.structure(restored) == jax.tree.structure(tree)
  for key, want in tree.items():
    _assert_same(restored[key], want, key)
