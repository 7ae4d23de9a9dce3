"""The names of things in a checkpoint directory, and its checksum block.

    <directory>/_WRITER                 the newest writer's claim (JSON)
    <directory>/<step>/                 a step; finalized iff it holds:
    <directory>/<step>/_COMMITTED       the commit marker, written last
    <directory>/<step>/manifest.json    what the step holds (`FORMAT_NAME`)
    <directory>/<step>.partial/         a step being written (rename mode)
    <directory>/<step>.deleting/        a step being deleted
    <directory>/<step>.damaged[N]/      a step set aside by a restore

`atomicity` decides when each appears; the storage backends make and remove
them; `storage` fills a step.
"""

from __future__ import annotations

# A manifest names the format and its version; a reader refuses others.
FORMAT_NAME = "flax_ckpt_plugin"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMIT_MARKER = "_COMMITTED"
DATA_DIR = "data"  # A step's data files and shard tables.
WRITER_FILE = "_WRITER"
# Object stores: a random token that `CommitFilePath.prepare` writes into the
# step, standing in for the inode that identifies a local directory.
ATTEMPT_FILE = "_ATTEMPT"
TMP_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
# A finalized step that failed verification at restore, kept for a person.
DAMAGED_SUFFIX = ".damaged"
# Every shard carries a CRC-32C per block of this many bytes (the last block
# may be shorter), so a reader of part of a shard verifies whole blocks only.
CHECKSUM_BLOCK = 4 << 20


def step_from_name(name: str) -> int | None:
  """The step a directory name stands for, or None if it is not a step."""
  if name.isascii() and name.isdigit() and str(int(name)) == name:
    return int(name)
  return None
