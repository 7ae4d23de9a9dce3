"""Asynchronous, atomic, multi-host checkpointing for Flax/Optax train loops."""

# The names below that need JAX (and the export, which needs none but whose
# module a plain import need not load) are imported on first use (PEP 562),
# so that `flax-ckpt`, which reads checkpoints with numpy alone, starts
# without JAX.

import importlib
import importlib.abc
import sys
from typing import Any, TYPE_CHECKING

from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import CommitHookError
from flax_ckpt_plugin.errors import CheckpointExistsError
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.errors import ConcurrentWriterError
from flax_ckpt_plugin.errors import DataStateMismatchError
from flax_ckpt_plugin.errors import PeerLostError
from flax_ckpt_plugin.errors import SaveFailedError
from flax_ckpt_plugin.errors import RestoreFailedError
from flax_ckpt_plugin.errors import StructureMismatchError
from flax_ckpt_plugin.save.stats import RestoreStats
from flax_ckpt_plugin.save.stats import SaveStats
from flax_ckpt_plugin.save.stats import StepMetadata

if TYPE_CHECKING:
  from flax_ckpt_plugin.callback import CheckpointCallback
  from flax_ckpt_plugin.callback import PREEMPTED_EXIT_CODE
  from flax_ckpt_plugin.tools.exporting import export
  from flax_ckpt_plugin.tools.exporting import ExportError
  from flax_ckpt_plugin.tools.exporting import ExportResult
  from flax_ckpt_plugin.manager.manager import CheckpointManager
  from flax_ckpt_plugin.tools.importer import import_orbax
  from flax_ckpt_plugin.manager.options import Processes
  from flax_ckpt_plugin.manager.options import Storage
  from flax_ckpt_plugin.manager.retention import Retention
  from flax_ckpt_plugin.tolerance.options import FaultTolerance

__version__ = "0.1.0"

__all__ = [
    "CheckpointCallback",
    "CheckpointCorruptedError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitHookError",
    "ConcurrentWriterError",
    "DataStateMismatchError",
    "ExportError",
    "ExportResult",
    "FaultTolerance",
    "PREEMPTED_EXIT_CODE",
    "PeerLostError",
    "Processes",
    "RestoreFailedError",
    "Retention",
    "RestoreStats",
    "SaveFailedError",
    "SaveStats",
    "StepMetadata",
    "Storage",
    "StructureMismatchError",
    "export",
    "import_orbax",
]

# Public name -> the module that defines it, imported when first asked for.
_LAZY = {
    "CheckpointCallback": "flax_ckpt_plugin.callback",
    "PREEMPTED_EXIT_CODE": "flax_ckpt_plugin.callback",
    "CheckpointManager": "flax_ckpt_plugin.manager.manager",
    "Storage": "flax_ckpt_plugin.manager.options",
    "Processes": "flax_ckpt_plugin.manager.options",
    "Retention": "flax_ckpt_plugin.manager.retention",
    "FaultTolerance": "flax_ckpt_plugin.tolerance.options",
    "ExportError": "flax_ckpt_plugin.tools.exporting",
    "ExportResult": "flax_ckpt_plugin.tools.exporting",
    "export": "flax_ckpt_plugin.tools.exporting",
    "import_orbax": "flax_ckpt_plugin.tools.importer",
}


_COMMIT_SPLIT = (
    "Commit is split by what it decides: Storage(backend, atomicity,"
    " pinned_host_bytes), Processes(primary_host, barrier_timeout_secs,"
    " coordinator, name), and commit hooks: add_commit_hook(hook) (or the"
    " manager's hooks=[...])")


def _commit(*args, **kwargs) -> Any:
  """The record that `Storage` and `Processes` replaced: says so."""
  del args, kwargs
  raise TypeError(_COMMIT_SPLIT)


def __getattr__(name: str) -> Any:
  module = _LAZY.get(name)
  if name == "Commit":  # `from flax_ckpt_plugin import Commit` finds it,
    return _commit      # and using it says where its fields went.
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # Later lookups skip this function.
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


# The modules that moved into the folders of their layers: importing one by
# its old name fails with an error that names the new one.
_MOVED = {
    "multihost": ("coordinator", "deadlines", "groups"),
    "backends": ("backend", "handles", "datafile", "memfile",
                 "object_store", "layout"),
    "format": ("records", "manifest", "treepaths", "datastate", "storage"),
    "save": ("staging", "pinned", "pieces", "writeplan", "snapshot", "commit",
             "atomicity", "async_commit", "stats"),
    "restore": ("reader", "matching", "casting", "placement", "fallback",
                "read_plan", "share_program", "shared_read", "replicas",
                "restoring"),
    "manager": ("retention", "schedule"),
    "tolerance": ("preemption", "liveness", "rescue", "elastic", "peer"),
    "tools": ("cli", "commands", "inventory", "exporting", "importer",
              "zarr_tree", "verify"),
}
_NOW = {f"{__name__}.{old}": f"{__name__}.{layer}.{old}"
        for layer, olds in _MOVED.items() for old in olds}
_NOW[f"{__name__}.local_tier"] = f"{__name__}.tolerance.tiers"


class _MovedModules(importlib.abc.MetaPathFinder):
  """Says where a module of an old name is now."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname in _NOW:
      raise ModuleNotFoundError(
          f"{fullname} is now {_NOW[fullname]} (the package's layers are"
          " folders; see docs/architecture.md)")
    return None


sys.meta_path.append(_MovedModules())
