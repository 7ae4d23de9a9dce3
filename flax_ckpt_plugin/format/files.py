"""The files of a step directory, by name: the manifest (and the format's
name and version it states), the data file, shard table and view of each
process (see `docs/format.md`), and `Scope`, a step that holds one
process's shards alone."""

from __future__ import annotations

from typing import NamedTuple

from flax_ckpt_plugin.backends import layout

# A manifest names the format and its version; a reader refuses others.
FORMAT_NAME = "flax_ckpt_plugin"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA_DIR = layout.DATA_DIR  # Where the backends find the data files.


# The most bytes of one process's shard table (the manifest's own cap).
MAX_TABLE_BYTES = 256 << 20


class Scope(NamedTuple):
  """A step that holds only the shards of one process of a job (every
  distinct shard it held, replicas included): what that process needs to
  restore itself, in the local tier. Its arrays are not covered whole."""
  process_index: int
  process_count: int


def data_file(process_index: int) -> str:
  return f"{DATA_DIR}/process_{process_index:05d}.bin"


def index_file(process_index: int) -> str:
  return f"{DATA_DIR}/process_{process_index:05d}.json"


def views_file(process_index: int) -> str:
  """How that process sees every leaf; read only if its digest differs."""
  return f"{DATA_DIR}/process_{process_index:05d}.views.json"
