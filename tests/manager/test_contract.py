"""`contract.Manager`, the manager as the tolerance layer names it: a
`CheckpointManager` has every member the protocol lists, methods with the
same parameters, so that what the local tier, the survivors and the tiered
restore call on it is there."""

import inspect
import typing

import numpy as np

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.manager import contract


def _parameters(fn):
  """Names, kinds and defaults; the annotations are the same types,
  spelled through other imports."""
  return [(p.name, p.kind, p.default)
          for p in inspect.signature(fn).parameters.values()]


def test_the_manager_has_every_method_of_the_protocol_with_its_parameters():
  methods = [name for name, value in vars(contract.Manager).items()
             if inspect.isfunction(value) and not name.startswith("_")]
  assert {"save", "restore", "all_steps", "regroup"} <= set(methods)
  for name in methods:
    mine = getattr(CheckpointManager, name)
    assert _parameters(mine) == _parameters(getattr(contract.Manager, name)), (
        name)


def test_an_open_manager_has_every_attribute_of_the_protocol(ckpt_dir):
  attributes = typing.get_type_hints(
      contract.Manager, vars(contract) | vars(typing)).keys()
  assert {"coordinator", "directory", "barrier_timeout_ms"} <= set(attributes)
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, {"w": np.arange(4.0)})
    manager.wait_until_finished()
    missing = [a for a in attributes if not hasattr(manager, a)]
    assert not missing, missing
    assert manager.check_still_writer is not None
    assert isinstance(manager.atomicity, str)
