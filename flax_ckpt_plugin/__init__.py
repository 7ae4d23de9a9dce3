"""Asynchronous, atomic, multi-host checkpointing for Flax/Optax train loops.

The names this package exports, and the `flax-ckpt` command, are its whole
public API. Every module inside it is private: its names may change in any
release.
"""

# The names below that need JAX (and the export, which needs none but whose
# module a plain import need not load) are imported on first use (PEP 562),
# so that `flax-ckpt`, which reads checkpoints with numpy alone, starts
# without JAX.

import importlib
from typing import Any, TYPE_CHECKING

from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import CommitHookError
from flax_ckpt_plugin.errors import CheckpointExistsError
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.errors import ConcurrentWriterError
from flax_ckpt_plugin.errors import CoordinatorLostError
from flax_ckpt_plugin.errors import DataStateMismatchError
from flax_ckpt_plugin.errors import PeerLostError
from flax_ckpt_plugin.errors import SaveFailedError
from flax_ckpt_plugin.errors import RestoreFailedError
from flax_ckpt_plugin.deadlines import StorageTimeoutError
from flax_ckpt_plugin.errors import StructureMismatchError
from flax_ckpt_plugin.stats import RestoreStats
from flax_ckpt_plugin.stats import SaveStats
from flax_ckpt_plugin.stats import StepMetadata

if TYPE_CHECKING:
  from flax_ckpt_plugin.loop.callback import CheckpointCallback
  from flax_ckpt_plugin.loop.interval import AutoInterval
  from flax_ckpt_plugin.loop.callback import PREEMPTED_EXIT_CODE
  from flax_ckpt_plugin.tools.exporting import export
  from flax_ckpt_plugin.tools.exporting import ExportError
  from flax_ckpt_plugin.tools.exporting import ExportResult
  from flax_ckpt_plugin.manager.manager import CheckpointManager
  from flax_ckpt_plugin.tools.importer import import_orbax
  from flax_ckpt_plugin.restore.safetensors_load import load_safetensors
  from flax_ckpt_plugin.manager.options import Processes
  from flax_ckpt_plugin.manager.options import Storage
  from flax_ckpt_plugin.manager.retention import Retention
  from flax_ckpt_plugin.tolerance.options import FaultTolerance
  from flax_ckpt_plugin.backends.local import LocalBackend
  from flax_ckpt_plugin.multihost.runtime import initialize
  from flax_ckpt_plugin.tools.importer import ImportResult
  from flax_ckpt_plugin.tools.importer import OrbaxImportError

__version__ = "0.1.0"

__all__ = [
    "AutoInterval",
    "CheckpointAction",
    "CheckpointCallback",
    "CheckpointCorruptedError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitHookError",
    "ConcurrentWriterError",
    "CoordinatorLostError",
    "DataStateMismatchError",
    "ExportError",
    "ExportResult",
    "FaultTolerance",
    "ImportResult",
    "LocalBackend",
    "OrbaxImportError",
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
    "StorageTimeoutError",
    "StructureMismatchError",
    "export",
    "import_orbax",
    "initialize",
    "load_safetensors",
]

# Public name -> the module that defines it, imported when first asked for.
_LAZY = {
    "CheckpointCallback": "flax_ckpt_plugin.loop.callback",
    "PREEMPTED_EXIT_CODE": "flax_ckpt_plugin.loop.callback",
    "AutoInterval": "flax_ckpt_plugin.loop.interval",
    "CheckpointManager": "flax_ckpt_plugin.manager.manager",
    "Storage": "flax_ckpt_plugin.manager.options",
    "Processes": "flax_ckpt_plugin.manager.options",
    "Retention": "flax_ckpt_plugin.manager.retention",
    "FaultTolerance": "flax_ckpt_plugin.tolerance.options",
    "ExportError": "flax_ckpt_plugin.tools.exporting",
    "ExportResult": "flax_ckpt_plugin.tools.exporting",
    "export": "flax_ckpt_plugin.tools.exporting",
    "import_orbax": "flax_ckpt_plugin.tools.importer",
    "load_safetensors": "flax_ckpt_plugin.restore.safetensors_load",
    "ImportResult": "flax_ckpt_plugin.tools.importer",
    "OrbaxImportError": "flax_ckpt_plugin.tools.importer",
    "LocalBackend": "flax_ckpt_plugin.backends.local",
    "initialize": "flax_ckpt_plugin.multihost.runtime",
    "CheckpointAction": "flax_ckpt_plugin.clu_hooks",  # Needs clu.
}


def __getattr__(name: str) -> Any:
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  try:
    value = getattr(importlib.import_module(module), name)
  except ModuleNotFoundError as e:
    if e.name != "clu":
      raise
    raise ImportError(f"{name} needs clu: pip install"
                      " 'flax_ckpt_plugin[clu]'") from e
  globals()[name] = value  # Later lookups skip this function.
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
