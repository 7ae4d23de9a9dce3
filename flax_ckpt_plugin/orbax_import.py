"""A step written by Orbax, converted into a finalized step of ours.

`import_orbax(source, dest)` reads the PyTree of one Orbax step (saved with
`StandardSave`/`PyTreeSave`, by a `CheckpointManager` or a bare
`Checkpointer`) and saves it with our `CheckpointManager(dest)`, so that it
is finalized and checksummed like any other step; `flax-ckpt import-orbax`
runs it from a shell. Orbax itself is never imported: `locate` finds the
tree and the step number from the directory's files, and `read_tree` reads
the tree's structure from Orbax's JSON metadata and its arrays with
tensorstore, the library that Orbax writes them with (flax installs it; the
`[orbax]` extra names it), rather than a second reader of zarr and OCDBT.

Key paths: Orbax keeps a tree as nested dicts (string keys) and lists, and a
key path of ours names each level by its key or index alone
(`treepaths.path_string`), so a `TrainState`'s `opt_state[0].mu`, read as `{'opt_state': [{'mu': ...}, None]}` is `opt_state/0/mu/...` on both
sides: the imported step restores into the user's own `TrainState` or NNX
state, leaf for leaf.
"""

from __future__ import annotations

import dataclasses
import json
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

TENSORSTORE_MISSING = ("import-orbax needs tensorstore (flax installs it):"
                       " pip install 'flax_ckpt_plugin[orbax]'")

# The file of a PyTree that Orbax wrote (StandardSave, PyTreeSave), and the
# file of a step of Orbax's CheckpointManager or Checkpointer.
TREE_FILE = "_METADATA"
STEP_FILE = "_CHECKPOINT_METADATA"
# In the name of a save that Orbax has not finished (then renamed).
_ORBAX_TMP = ".orbax-checkpoint-tmp"
# A step directory's name: `5`, or Orbax's `step_prefix` form `checkpoint_5`.
_STEP_NAME = re.compile(r"(?:.+_)?(\d+)")
# The kinds of key that `_METADATA` records for each level of a key path.
_SEQUENCE_KEY, _DICT_KEY = 1, 2
# Leaves that Orbax records with no data: empty containers and None.
_EMPTY = {"None": lambda: None, "Dict": dict, "List": list, "Tuple": list,
          "NamedTuple": lambda: None}
# Leaves stored as arrays: `jax.Array`, numpy arrays, Python/numpy scalars.
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


class TensorstoreNotInstalledError(ImportError):
  """tensorstore, which reads the arrays Orbax wrote, is not installed."""


class OrbaxImportError(ValueError):
  """The source or the destination needs an option, or is refused.

  The step number cannot be told from the directory's name (give `step`),
  the step holds several PyTree items (give `item`), or the destination
  overlaps the source or holds Orbax steps that opening it would delete.
  """


class OrbaxReadError(CheckpointCorruptedError):
  """The step's metadata or arrays cannot be read, or it holds values that a
  checkpoint of ours cannot hold (strings)."""


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


def _import_tensorstore() -> Any:
  try:
    import tensorstore  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise TensorstoreNotInstalledError(f"{TENSORSTORE_MISSING} ({e})") from e
  return tensorstore


def _keystr(keys: list[tuple[str, int]]) -> str:
  """A key path as `jax.tree_util.keystr` writes it: `['opt_state'][0]`."""
  return "".join(f"[{key!r}]" if kind == _DICT_KEY else f"[{key}]"
                 for key, kind in keys)


def _read_json(path: epath.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise OrbaxReadError(f"cannot read Orbax's metadata {path}:"
                         f" {type(e).__name__}: {e}") from e


def _entries(tree_dir: epath.Path) -> tuple[dict[str, Any], list[Any]]:
  """The options and the leaves that `_METADATA` records.

  Each leaf: its key path as (key, kind) pairs, and its value metadata
  (`value_type`, `skip_deserialize`).
  """
  path = tree_dir / TREE_FILE
  metadata = _read_json(path)
  tree = metadata.get("tree_metadata") if isinstance(metadata, dict) else None
  if not isinstance(tree, dict):
    raise OrbaxReadError(
        f"{path} has no 'tree_metadata': not a PyTree that Orbax 0.5 or"
        " later wrote")
  leaves = []
  for name, entry in tree.items():
    try:
      keys = [(str(k["key"]), int(k["key_type"])) for k in entry["key_metadata"]]
      value = dict(entry["value_metadata"])
      value["value_type"] = str(value["value_type"])
    except (KeyError, TypeError, ValueError) as e:
      raise OrbaxReadError(f"{path}: the entry of {name} is damaged"
                           f" ({type(e).__name__}: {e})") from e
    bad = [kind for _, kind in keys if kind not in (_SEQUENCE_KEY, _DICT_KEY)]
    if bad or not keys:
      raise OrbaxReadError(f"{path}: the entry of {name} has key types {bad}"
                           " (Orbax writes 1, a sequence index, and 2, a dict"
                           " key)")
    leaves.append((keys, value))
  return metadata, leaves


def _key_impls(tree_dir: epath.Path) -> dict[str, str]:
  """The PRNG key impl of each typed key array, by Orbax's parameter name.

  Orbax saves a typed key array as its key data and records the impl in
  each process's `array_metadatas/process_N` file.
  """
  impls = {}
  directory = tree_dir / "array_metadatas"
  if not directory.exists():
    return impls
  for path in sorted(directory.iterdir()):
    for entry in _read_json(path).get("array_metadatas", ()):
      meta = entry.get("array_metadata", {})
      impl = (meta.get("ext_metadata") or {}).get("random_key_impl")
      if impl:
        impls[meta["param_name"]] = impl
  return impls


def _kvstore_base(path: epath.Path) -> str:
  text = os.fspath(path)
  return text if "://" in text else "file://" + os.path.abspath(text)


def _array_stores(ts: Any, tree_dir: epath.Path, options: dict[str, Any],
                  names: list[str]) -> dict[str, Any]:
  """The tensorstore spec of each array Orbax wrote, by parameter name.

  With OCDBT (Orbax's default) the arrays are keys of one OCDBT database:
  the directory's own, which Orbax merges from the per-process ones at the
  end of a save, else (a save whose merge did not run) those of the
  `ocdbt.process_N` subdirectories. Without it each array is a directory.
  """
  driver = "zarr3" if options.get("use_zarr3") else "zarr"
  if not options.get("use_ocdbt", True):
    return {name: {"driver": driver,
                   "kvstore": _kvstore_base(tree_dir / name)} for name in names}
  bases = ([tree_dir] if (tree_dir / "manifest.ocdbt").exists() else
           sorted(p for p in tree_dir.iterdir()
                  if p.name.startswith("ocdbt.process_")))
  where = {}
  for base in bases:
    try:
      store = ts.KvStore.open({"driver": "ocdbt",
                               "base": _kvstore_base(base)}).result()
      keys = store.list().result()
    except Exception as e:  # pylint: disable=broad-except
      raise OrbaxReadError(f"cannot open Orbax's OCDBT database in {base}:"
                           f" {type(e).__name__}: {e}") from e
    for key in keys:
      where.setdefault(key.decode().split("/", 1)[0], base)
  return {name: {"driver": driver,
                 "kvstore": {"driver": "ocdbt",
                             "base": _kvstore_base(where[name]),
                             "path": name}}
          for name in names if name in where}


def _scalar(value: np.ndarray) -> Any:
  """A scalar Orbax saved, as Orbax restores it.

  Orbax saves a Python scalar as `np.asarray(value)` and restores every
  scalar as a Python one: a dtype that numpy gives a Python scalar (int64
  for an int, float64 for a float, bool) was one, and stays one, so it
  restores into a `TrainState.step` that is a Python int; any other (a
  numpy float32 scalar) stays a 0-d numpy array of its dtype.
  """
  if value.dtype in (np.int64, np.float64, np.bool_):
    return value.item()
  return value


def _nest(leaves: list[tuple[list[tuple[str, int]], Any]], where: str) -> Any:
  """Nested dicts and lists from (key path, value) pairs.

  A level whose keys are sequence indices becomes a list, in index order.
  """
  root: dict[str, Any] = {}
  lists = set()  # The prefixes whose keys are sequence indices.
  for keys, value in leaves:
    node = root
    for depth, (key, kind) in enumerate(keys):
      if kind == _SEQUENCE_KEY:
        lists.add(tuple(k for k, _ in keys[:depth]))
      if depth == len(keys) - 1:
        node[key] = value
      else:
        node = node.setdefault(key, {})

  def build(node: Any, prefix: tuple[str, ...]) -> Any:
    if not isinstance(node, dict) or not node:
      return node
    if prefix not in lists:
      return {k: build(v, prefix + (k,)) for k, v in node.items()}
    try:
      indices = sorted(node, key=int)
    except ValueError:
      indices = sorted(node)
    if indices != [str(i) for i in range(len(indices))]:
      raise OrbaxReadError(f"{where}: the list at {list(prefix)} has indices"
                           f" {indices}, not 0 to {len(indices) - 1}")
    return [build(node[i], prefix + (i,)) for i in indices]

  return build(root, ())


def read_tree(tree_dir: epath.PathLike) -> Any:
  """The tree Orbax saved in `tree_dir`, read without Orbax.

  The structure comes from Orbax's `_METADATA` (JSON): nested dicts and
  lists, empty containers and None as Orbax records them. The arrays are
  zarr arrays (zarr 2 or 3, in an OCDBT database or a directory each),
  read with tensorstore, the library Orbax wrote them with. Every
  `jax.Array` comes back whole on this host's first CPU device (whatever
  mesh saved it: no device of that mesh is needed), typed PRNG keys as keys
  (Orbax records their impl), arrays Orbax saved as numpy as numpy,
  scalars as `_scalar` says.

  Raises:
    TensorstoreNotInstalledError: tensorstore is not installed.
    OrbaxReadError: a metadata file or an array cannot be read, or the
      tree holds values that a checkpoint of ours cannot hold (strings).
  """
  ts = _import_tensorstore()
  path = epath.Path(tree_dir)
  options, entries = _entries(path)
  _nest([(keys, None) for keys, _ in entries], os.fspath(path / TREE_FILE))
  arrays = {}
  for keys, meta in entries:
    if meta.get("skip_deserialize") or meta["value_type"] in _EMPTY:
      continue
    if meta["value_type"] not in _ARRAY_TYPES:
      what = meta["value_type"]
      raise OrbaxReadError(
          f"leaf {_keystr(keys)} of {path} is a {what}, which a checkpoint of"
          " ours cannot hold (leaves are arrays and Python int/float/bool)")
    arrays[".".join(k for k, _ in keys)] = keys
  specs = _array_stores(ts, path, options, list(arrays))
  impls = _key_impls(path)
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  values = []
  for keys, meta in entries:
    typ = meta["value_type"]
    if meta.get("skip_deserialize") or typ in _EMPTY:
      values.append((keys, _EMPTY.get(typ, lambda: None)()))
      continue
    name = ".".join(k for k, _ in keys)
    if name not in specs:
      raise OrbaxReadError(f"leaf {_keystr(keys)} of {path}: Orbax's array"
                           f" {name!r} is not in the checkpoint's files")
    try:
      value = ts.open(specs[name], open=True, read=True).result().read(
      ).result()
    except Exception as e:  # pylint: disable=broad-except
      raise OrbaxReadError(f"cannot read leaf {_keystr(keys)} of {path}"
                           f" (Orbax's array {name!r}): {type(e).__name__}:"
                           f" {e}") from e
    value = np.asarray(value)
    if typ == "scalar":
      value = _scalar(value)
    elif typ == "jax.Array":
      value = jax.device_put(value, cpu)
      if name in impls:
        value = jax.random.wrap_key_data(value, impl=impls[name])
    values.append((keys, value))
  return _nest(values, os.fspath(path / TREE_FILE))


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
