"""A step written by Orbax, converted into a finalized step of ours.

`import_orbax(source, dest)` reads the PyTree of one Orbax step (saved with
`StandardSave`/`PyTreeSave`, by a `CheckpointManager` or a bare
`Checkpointer`) and saves it with our `CheckpointManager(dest)`, so that it
is finalized and checksummed like any other step; `flax-ckpt import-orbax`
runs it from a shell. `locate` finds the tree and the step number without
Orbax; only `read_tree` imports `orbax.checkpoint`, from the `[orbax]` extra,
so nothing else in the package ever imports it.

Key paths: Orbax keeps a tree as nested dicts (string keys) and lists, and a
key path of ours names each level by its key or index alone
(`treepaths.path_string`), so a `TrainState`'s `opt_state[0].mu` restored by
Orbax as `{'opt_state': [{'mu': ...}, None]}` is `opt_state/0/mu/...` on both
sides: the imported step restores into the user's own `TrainState` or NNX
state, leaf for leaf.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from etils import epath
import jax
import numpy as np

from flax_ckpt_plugin import atomicity
from flax_ckpt_plugin import backend as backend_lib
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import CheckpointExistsError
from flax_ckpt_plugin.manager import CheckpointManager

ORBAX_MISSING = ("import-orbax needs orbax-checkpoint: pip install"
                 " 'flax_ckpt_plugin[orbax]'")

# The file of a PyTree that Orbax wrote (StandardSave, PyTreeSave), and the
# file of a step of Orbax's CheckpointManager or Checkpointer.
TREE_FILE = "_METADATA"
STEP_FILE = "_CHECKPOINT_METADATA"
# In the name of a save that Orbax has not finished (then renamed).
_ORBAX_TMP = ".orbax-checkpoint-tmp"
# A step directory's name: `5`, or Orbax's `step_prefix` form `checkpoint_5`.
_STEP_NAME = re.compile(r"(?:.+_)?(\d+)")


class OrbaxNotInstalledError(ImportError):
  """orbax-checkpoint, which the import needs, is not installed."""


class OrbaxImportError(ValueError):
  """The source or the destination needs an option, or is refused.

  The step number cannot be told from the directory's name (give `step`),
  the step holds several PyTree items (give `item`), or the destination
  overlaps the source or holds Orbax steps that opening it would delete.
  """


class OrbaxReadError(CheckpointCorruptedError):
  """Orbax could not read the step, or it holds values that a checkpoint of
  ours cannot hold (strings)."""


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


def _import_orbax_checkpoint() -> Any:
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise OrbaxNotInstalledError(f"{ORBAX_MISSING} ({e})") from e
  return ocp


def _host_scalar(value: Any, dtype: Any) -> Any:
  """A scalar Orbax saved, with the dtype Orbax recorded for it.

  Orbax saves a Python scalar as `np.asarray(value)` and restores every
  scalar as a Python one: a recorded dtype that numpy gives the value
  (int64 for an int, float64 for a float, bool) was a Python scalar, and
  stays one, so it restores into a `TrainState.step` that is a Python int;
  any other (a numpy float32 scalar) becomes a 0-d numpy array of it.
  """
  if dtype is None or np.asarray(value).dtype == np.dtype(dtype):
    return value
  return np.asarray(value, dtype=dtype)


def read_tree(tree_dir: epath.PathLike) -> Any:
  """The tree Orbax saved in `tree_dir`, restored in this process alone.

  Restored without a target, from Orbax's own metadata: the structure as
  nested dicts and lists, every `jax.Array` whole on this host's first CPU
  device (whatever mesh saved it: no device of that mesh is needed), typed
  PRNG keys as keys (Orbax records their impl), arrays Orbax saved as numpy
  as numpy, scalars as `_host_scalar` says.

  Raises:
    OrbaxNotInstalledError: orbax-checkpoint is not installed.
    OrbaxReadError: Orbax could not read the tree, or it holds strings.
  """
  ocp = _import_orbax_checkpoint()
  path = epath.Path(tree_dir)
  if not path.is_absolute() and "://" not in os.fspath(tree_dir):
    path = path.absolute()  # Orbax wants absolute paths.
  handler = ocp.PyTreeCheckpointHandler()
  try:
    metadata = handler.metadata(path)
  except Exception as e:  # pylint: disable=broad-except
    raise OrbaxReadError(f"Orbax could not read the metadata of {path}:"
                         f" {type(e).__name__}: {e}") from e
  # Newer orbax-checkpoint wraps the tree in a TreeMetadata; 0.6 returns it.
  metadata = getattr(metadata, "tree", metadata)
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  value_metadata = ocp.metadata

  def restore_args(keypath: Any, meta: Any) -> Any:
    if isinstance(meta, value_metadata.ScalarMetadata):
      return ocp.RestoreArgs()
    if isinstance(meta, value_metadata.ArrayMetadata):
      if meta.sharding is None:  # Saved from a numpy array.
        return ocp.RestoreArgs(restore_type=np.ndarray)
      return ocp.ArrayRestoreArgs(sharding=cpu)
    what = (type(meta).__name__.removesuffix("Metadata").lower()
            or type(meta).__name__)
    raise OrbaxReadError(
        f"leaf {jax.tree_util.keystr(keypath)} of {path} is a {what}, which"
        " a checkpoint of ours cannot hold (leaves are arrays and Python"
        " int/float/bool)")

  args = jax.tree_util.tree_map_with_path(restore_args, metadata)
  checkpointer = ocp.Checkpointer(handler)
  try:
    tree = checkpointer.restore(path,
                                args=ocp.args.PyTreeRestore(restore_args=args))
  except Exception as e:  # pylint: disable=broad-except
    raise OrbaxReadError(f"Orbax could not restore {path}:"
                         f" {type(e).__name__}: {e}") from e
  finally:
    checkpointer.close()
  return jax.tree.map(
      lambda meta, value: _host_scalar(value, meta.dtype) if isinstance(
          meta, value_metadata.ScalarMetadata) else value, metadata, tree)


def _check_dest(found: OrbaxStep, dest: epath.Path, name: str) -> None:
  """Refuses a destination where the save would harm something or fail.

  Runs before a manager opens `dest` (named `name` in errors), which claims
  the directory and removes what looks like unfinished steps of ours: Orbax
  steps among them.
  """
  if atomicity.is_finalized(dest / str(found.step)):
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
    orbax_steps = [e.name for e in atomicity.unfinished_entries(dest)
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

  Reads the tree with Orbax (`read_tree`) and saves it with
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
    OrbaxNotInstalledError: orbax-checkpoint is not installed.
    OrbaxReadError: see `read_tree`.
  """
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
