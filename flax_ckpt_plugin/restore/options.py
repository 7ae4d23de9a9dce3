"""How a restore reads and matches a step: `RestoreOptions`.

The user's keywords (`verify`, `partial`, `missing`, `cast`, `rename`) are
taken where a call enters the package (`CheckpointManager.restore` and its
siblings, `load_safetensors`, the callback's `restore_or_initialize`),
checked there once, and handed down to the matching, reading and placing
as this one value.
"""

from __future__ import annotations

import dataclasses

from flax_ckpt_plugin.restore import renaming

MISSING = ("error", "keep")


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
  """A restore's options, checked (see `CheckpointManager.restore`).

  Attributes:
    verify: check the CRC-32C of every block read.
    partial: restore the target's leaves alone; the checkpoint's other
      leaves are no mismatch, and no byte of them is read.
    missing: "keep": a target leaf that the checkpoint lacks keeps the
      target's value; "error": a mismatch.
    cast: convert leaves saved in another dtype than the target's
      (`casting`), while they are read.
    rename: the checkpoint's paths to the target's, as a user gives them
      (rules or a function) or checked; always a `renaming.Renaming` once
      made (one that keeps every name for None).

  Raises:
    ValueError: `missing` is neither "keep" nor "error".
    renaming.RenameError: a rename rule that is not a regular expression.
  """
  verify: bool = True
  partial: bool = False
  missing: str = "error"
  cast: bool = False
  rename: renaming.Renaming | renaming.Rename | None = None

  def __post_init__(self):
    if self.missing not in MISSING:
      raise ValueError(
          f"missing must be one of {MISSING}, got {self.missing!r}")
    object.__setattr__(self, "rename", renaming.Renaming.of(self.rename))
