"""Putting leaves together from the regions the processes have
(`rebuild`'s slots and program), in one process with 2 CPU devices: the
layouts of a recovery (regions of another mesh's grid, even or not, onto a
new sharding). The multi-process paths are in test_elastic.py and
loop/test_tiers.py."""

import functools
import types

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from flax_ckpt_plugin.tolerance import rebuild


def _record(value: np.ndarray) -> types.SimpleNamespace:
  """What the slots read of a leaf's record."""
  return types.SimpleNamespace(shape=value.shape, dtype=value.dtype)


def _regions(shape, cuts) -> list[tuple]:
  """The grid's regions; `cuts` per axis are its cells' starts."""
  per_axis = [list(zip(c, list(c[1:]) + [d])) for c, d in zip(cuts, shape)]
  return [tuple(per_axis[a][i] for a, i in enumerate(idx))
          for idx in np.ndindex(*[len(a) for a in per_axis])]


@pytest.mark.parametrize("shape,cuts,spec", [
    ((8, 6), ((0, 2, 4, 6), (0,)), P("x")),  # even rows, onto 2 devices
    ((7, 6), ((0, 3, 6), (0, 4)), P(None, "x")),  # uneven, onto columns
    ((5,), ((0, 2, 4),), P()),  # uneven, replicated
    ((), ((),), P()),  # a 0-d array
])
def test_regions_of_another_grid_are_put_together_in_the_target_sharding(
    shape, cuts, spec):
  value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
  regions = _regions(shape, cuts)
  mine = {r: value[tuple(slice(a, b) for a, b in r)] for r in regions}
  owner = {r: 0 for r in regions}
  devices = jax.devices()
  slots, layout = rebuild._slots("x", _record(value), owner, mine, devices, 0)  # pylint: disable=protected-access
  mesh = Mesh(np.array(devices), ("x",))
  out = jax.jit(functools.partial(rebuild._put_together, layouts=(layout,)),  # pylint: disable=protected-access
                out_shardings=(NamedSharding(mesh, spec),))((slots,))[0]
  assert out.sharding == NamedSharding(mesh, spec)
  np.testing.assert_array_equal(np.asarray(out), value)


def test_a_region_whose_process_has_no_device_is_a_clear_error():
  value = np.zeros((4,), np.float32)
  owner = {((0, 2),): 0, ((2, 4),): 5}
  with pytest.raises(Exception, match="process 5, which has region"):
    rebuild._slots("x", _record(value), owner, {((0, 2),): value[:2]},  # pylint: disable=protected-access
                   jax.devices(), 0)
