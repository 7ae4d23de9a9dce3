"""A step written by Orbax, converted into a finalized step of ours.

`import_orbax(source, dest)` reads the PyTree of one Orbax step (saved with
`StandardSave`/`PyTreeSave`, by a `CheckpointManager` or a bare
`Checkpointer`) and saves it with our `CheckpointManager(dest)`, so that it
is finalized and checksummed like any other step; `flax-ckpt import-orbax`
(`cmd_import_orbax`) runs it from a shell. Orbax itself is never imported: `locate` finds the
tree and the step number from the directory's files, and `zarr_tree` reads
the tree (`read_tree`), its structure from Orbax's JSON metadata and its
arrays with tensorstore.

Key paths: Orbax keeps a tree as nested dicts (string keys) and lists, and a
key path of ours names each level by its key or index alone
(`treepaths.path_string`), so a `TrainState`'s `opt_state[0].mu`, read as
`{'opt_state': [{'mu': ...}, None]}`, is `opt_state/0/mu/...` on both sides:
the imported step restores into the user's own `TrainState` or NNX state,
leaf for leaf.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import TextIO

from etils import epath

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.errors import CheckpointExistsError
from flax_ckpt_plugin.tools import zarr_tree
from flax_ckpt_plugin.tools.commands import CliError
from flax_ckpt_plugin.tools.commands import EXIT_EXISTS
from flax_ckpt_plugin.tools.commands import EXIT_OK
from flax_ckpt_plugin.tools.commands import EXIT_USAGE
from flax_ckpt_plugin.tools.commands import leaf_summary
from flax_ckpt_plugin.tools.commands import leaf_type
from flax_ckpt_plugin.tools.commands import PROG
from flax_ckpt_plugin.tools.commands import read_manifest
from flax_ckpt_plugin.tools.inventory import table
from flax_ckpt_plugin.tools.inventory import zero_d_values
from flax_ckpt_plugin.tools.verify import human_size

# The file of a step of Orbax's CheckpointManager or Checkpointer.
STEP_FILE = "_CHECKPOINT_METADATA"
TREE_FILE = zarr_tree.TREE_FILE
# In the name of a save that Orbax has not finished (then renamed).
_ORBAX_TMP = ".orbax-checkpoint-tmp"
# A step directory's name: `5`, or Orbax's `step_prefix` form `checkpoint_5`.
_STEP_NAME = re.compile(r"(?:.+_)?(\d+)")
TensorstoreNotInstalledError = zarr_tree.TensorstoreNotInstalledError
OrbaxReadError = zarr_tree.OrbaxReadError
read_tree = zarr_tree.read_tree


class OrbaxImportError(ValueError):
  """The source or the destination needs an option, or is refused.

  The step number cannot be told from the directory's name (give `step`),
  the step holds several PyTree items (give `item`), or the destination
  overlaps the source or holds Orbax steps that opening it would delete.
  """


@dataclasses.dataclass(frozen=True)
class OrbaxStep:
  """Where the PyTree of one Orbax step lies, found by `locate`."""
  source: epath.Path  # The directory given.
  tree_dir: epath.Path  # The directory that holds the tree's `_METADATA`.
  item: str | None  # The item of a CheckpointManager step; None: no item.
  step: int  # The step number the import saves it as.


@dataclasses.dataclass(frozen=True)
class ImportResult:
  """What `import_orbax` converted and wrote."""
  source: OrbaxStep  # What was read.
  directory: epath.Path  # The destination checkpoint directory.
  path: epath.Path  # The finalized step directory written.
  leaves: int  # Leaves of the tree.
  total_bytes: int  # Bytes of array data written.


def _step_number(name: str) -> int | None:
  match = _STEP_NAME.fullmatch(name)
  return None if match is None else int(match.group(1))


def locate(source: epath.PathLike, *, item: str | None = None,
           step: int | None = None) -> OrbaxStep:
  """Finds the PyTree of an Orbax step, and its step number, without Orbax.

  `source` holds the tree itself (`_METADATA`: `StandardCheckpointer.save(
  path, ...)`, or an item directory such as `ckpts/5/default`), or is a
  step of Orbax's `CheckpointManager`, whose items are subdirectories
  (`default/`, or named items such as `state/`).

  Args:
    source: the Orbax step directory.
    item: which item of a CheckpointManager step (needed when it has
      several PyTree items).
    step: the step number; by default read from the directory's name
      (`5`, or Orbax's prefixed `checkpoint_5`, `step_5`).

  Raises:
    FileNotFoundError: no such directory, no such item, no Orbax PyTree in
      it, or a save that Orbax did not finish.
    OrbaxImportError: several PyTree items and no `item`; no `step` and
      the name holds none.
  """
  src = epath.Path(source)
  if not src.exists():
    raise FileNotFoundError(f"Orbax step directory {source} does not exist")
  if not src.is_dir():
    raise FileNotFoundError(f"{source} is not a directory")
  if _ORBAX_TMP in src.name:
    raise FileNotFoundError(f"{source} is a save that Orbax did not finish"
                            f" (its name holds {_ORBAX_TMP!r})")
  items = sorted(p.name for p in src.iterdir()
                 if p.is_dir() and (p / TREE_FILE).exists())
  if item is not None:
    tree_dir = src / item
    if not (tree_dir / TREE_FILE).exists():
      raise FileNotFoundError(
          f"{source} has no PyTree item {item!r} ({tree_dir / TREE_FILE}"
          f" does not exist); its PyTree items: {items}")
  elif (src / TREE_FILE).exists():
    tree_dir = src
  elif len(items) == 1:
    item = items[0]
    tree_dir = src / item
  elif items:
    raise OrbaxImportError(f"{source} holds several PyTree items {items}:"
                           " choose one with --item")
  else:
    steps = sorted((p for p in src.iterdir() if (p / STEP_FILE).exists()),
                   key=lambda p: (_step_number(p.name) is None, p.name))
    hint = (f"; it looks like an Orbax CheckpointManager directory: give one"
            f" of its steps, such as {steps[-1]}" if steps else "")
    raise FileNotFoundError(
        f"no Orbax PyTree checkpoint in {source}: no {TREE_FILE} file"
        " (StandardSave, PyTreeSave) and no item subdirectory holding one (a"
        f" CheckpointManager step){hint}")
  if step is None:
    step = _step_number(src.name)
  if step is None and tree_dir == src and (src.parent / STEP_FILE).exists():
    step = _step_number(src.parent.name)  # An item directory: ckpts/5/default.
  if step is None:
    raise OrbaxImportError(
        f"cannot tell the step number from the directory name {src.name!r}"
        " (Orbax names steps N or PREFIX_N, e.g. 5 or checkpoint_5): give it"
        " with --step N")
  if step < 0:
    raise OrbaxImportError(f"step must be >= 0, got {step}")
  return OrbaxStep(source=src, tree_dir=tree_dir, item=item, step=step)


def _check_dest(found: OrbaxStep, dest: epath.Path, name: str) -> None:
  """Refuses a destination where the save would harm something or fail.

  Runs before a manager opens `dest` (named `name` in errors), which claims
  the directory and removes what looks like unfinished steps of ours: Orbax
  steps among them.
  """
  if directory_lib.is_finalized(dest / str(found.step)):
    raise CheckpointExistsError(
        f"step {found.step} is already finalized in {name}: nothing was"
        " written (give another --step, or delete that step first)")
  src, dst = (os.fspath(p) for p in (found.source, dest))
  if "://" not in src and "://" not in dst:
    src, dst = (os.path.realpath(p) for p in (src, dst))
  src, dst = src.rstrip("/"), dst.rstrip("/")
  if src == dst or dst.startswith(src + "/") or src.startswith(dst + "/"):
    raise OrbaxImportError(
        f"the destination {name} and the Orbax step {found.source} overlap:"
        " give a destination outside the Orbax checkpoint directory")
  if dest.exists():
    orbax_steps = [e.name for e in directory_lib.unfinished_entries(dest)
                   if (e / STEP_FILE).exists() or (e / TREE_FILE).exists()]
    if orbax_steps:
      raise OrbaxImportError(
          f"{name} holds Orbax steps {orbax_steps}, which a checkpoint"
          " manager opening it would delete as unfinished steps of its own:"
          " give a destination of its own to the imported steps")


def import_orbax(source: epath.PathLike, dest: epath.PathLike, *,
                 item: str | None = None, step: int | None = None
                 ) -> ImportResult:
  """Converts the Orbax step `source` into a finalized step of `dest`.

  Reads the tree (`read_tree`) and saves it with
  `CheckpointManager(dest).save(step, tree)`, waits until it is finalized
  and closes the manager. `source` is only read. The manager claims `dest`
  for writing, as any writer does: do not import into a directory that a
  running job writes to.

  Args:
    source: the Orbax step directory (see `locate`).
    dest: our checkpoint directory (local, `gs://` or `s3://`).
    item: the item of a CheckpointManager step with several PyTree items.
    step: the step number; by default read from `source`'s name.

  Returns:
    An `ImportResult`.

  Raises:
    FileNotFoundError: see `locate`.
    OrbaxImportError: see `locate`; or `dest` overlaps `source`, or holds
      Orbax steps (which opening it for writing would delete).
    CheckpointExistsError: `dest` already holds the step (nothing written).
    TensorstoreNotInstalledError: tensorstore is not installed.
    OrbaxReadError: see `read_tree`.
  """
  # JAX is imported here, not with the module: the command line imports
  # this module, and `cmd_import_orbax` keeps JAX on the host first.
  import jax  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin.manager.manager import CheckpointManager  # pylint: disable=g-import-not-at-top
  found = locate(source, item=item, step=step)
  directory, _ = backend_lib.make_path(os.fspath(dest))
  _check_dest(found, directory, os.fspath(dest))
  tree = read_tree(found.tree_dir)
  leaves = len(jax.tree_util.tree_leaves(tree))
  with CheckpointManager(dest) as manager:
    manager.save(found.step, tree)
    del tree  # The snapshot holds its own copy.
    manager.wait_until_finished()
    stats = manager.last_save_stats
  return ImportResult(source=found, directory=manager.directory,
                      path=manager.directory / str(found.step), leaves=leaves,
                      total_bytes=stats.total_bytes)


# -- import-orbax --------------------------------------------------------------

# Leaves that import-orbax lists; `show` lists them all.
_IMPORT_LEAVES_SHOWN = 30


def _join(directory: str, step: int) -> str:
  return f"{directory.rstrip('/')}/{step}"


def cmd_import_orbax(args: argparse.Namespace, out: TextIO) -> int:
  """`flax-ckpt import-orbax` (see `cli`).

  The one command that needs JAX (and tensorstore, for Orbax's arrays). It
  runs on the host, never on an accelerator a job may be using.
  """
  if "jax" not in sys.modules:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  try:
    result = import_orbax(args.source, args.dest, item=args.item,
                          step=args.step)
  except (TensorstoreNotInstalledError, OrbaxImportError) as e:
    raise CliError(str(e), EXIT_USAGE) from e
  except FileExistsError as e:
    raise CliError(str(e), EXIT_EXISTS) from e
  found, step = result.source, result.source.step
  m = read_manifest(result.directory, step)
  values = zero_d_values(result.path, m)
  if args.json:
    out.write(json.dumps({
        "source": args.source, "item": found.item,
        "tree_dir": os.fspath(found.tree_dir), "directory": args.dest,
        "step": step, "path": _join(args.dest, step),
        "total_bytes": m.total_bytes, "leaf_count": len(m.leaves),
        "leaves": [leaf_summary(leaf, values) for leaf in m.leaves],
    }, indent=1) + "\n")
    return EXIT_OK
  item = "" if found.item is None else f" (Orbax item {found.item!r})"
  out.write(
      f"imported {args.source}{item} as step {step} of {args.dest}\n"
      f"step dir:  {_join(args.dest, step)} (finalized, with"
      f" {m.checksum_algorithm} checksums)\n"
      f"size:      {human_size(m.total_bytes)} of array data"
      f" ({m.total_bytes} bytes)\n"
      f"leaves:    {len(m.leaves)}\n")
  shown = m.leaves[:_IMPORT_LEAVES_SHOWN]
  if shown:
    rows = [["PATH", "TYPE", "BYTES"]]
    rows += [[leaf.path, leaf_type(leaf, values),
              "" if leaf.is_scalar else human_size(leaf.nbytes)]
             for leaf in shown]
    table(rows, out, indent="  ")
  if len(m.leaves) > len(shown):
    out.write(f"  ... and {len(m.leaves) - len(shown)} more: `{PROG} show"
              f" {args.dest} {step}` lists them all\n")
  return EXIT_OK
