"""Asynchronous, atomic, multi-host checkpointing for Flax/Optax train loops."""

from flax_ckpt_plugin.callback import CheckpointCallback
from flax_ckpt_plugin.callback import PREEMPTED_EXIT_CODE
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import CommitHookError
from flax_ckpt_plugin.errors import CheckpointExistsError
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.errors import ConcurrentWriterError
from flax_ckpt_plugin.errors import SaveFailedError
from flax_ckpt_plugin.errors import RestoreFailedError
from flax_ckpt_plugin.errors import StructureMismatchError
from flax_ckpt_plugin.manager import CheckpointManager
from flax_ckpt_plugin.manager import RestoreStats
from flax_ckpt_plugin.commit import SaveStats
from flax_ckpt_plugin.manager import StepMetadata

__version__ = "0.1.0"

__all__ = [
    "CheckpointCallback",
    "CheckpointCorruptedError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitHookError",
    "ConcurrentWriterError",
    "PREEMPTED_EXIT_CODE",
    "RestoreStats",
    "RestoreFailedError",
    "SaveFailedError",
    "SaveStats",
    "StepMetadata",
    "StructureMismatchError",
]
