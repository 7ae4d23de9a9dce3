"""The names of the entries of a checkpoint directory that the storage
backends make and remove.

    <directory>/_WRITER                 the newest writer's claim (JSON)
    <directory>/<step>/                 a step; finalized iff it holds:
    <directory>/<step>/_COMMITTED       the commit marker, written last
    <directory>/<step>/data/            its data files (`format.files`)
    <directory>/<step>.partial/         a step being written (rename mode)
    <directory>/<step>.deleting/        a step being deleted
    <directory>/<step>.damaged[N]/      a step set aside by a restore

`atomicity` decides when each appears; the storage backends make and remove
them; what a step holds is `format`'s (`format.files`: the manifest, the
format's name and version, the checksum block).
"""

from __future__ import annotations

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


def step_from_name(name: str) -> int | None:
  """The step a directory name stands for, or None if it is not a step."""
  if name.isascii() and name.isdigit() and str(int(name)) == name:
    return int(name)
  return None
