"""A PyTree stored as zarr arrays under a JSON tree metadata, read without
the library that wrote it: the layout of Orbax's `StandardSave` and
`PyTreeSave`.

`read_tree(directory)` rebuilds the tree from `_METADATA` (each leaf's key
path, as (key, kind) pairs, and its value type) and reads its arrays (zarr 2
or 3, in an OCDBT database or one directory each) with tensorstore, the
library Orbax writes them with; flax depends on it, and the `[orbax]` extra
names it. A hand-written reader of OCDBT and zarr would be a worse copy.
Nothing here imports Orbax. `importer` converts the tree into a step of ours.
"""

from __future__ import annotations

import json
import os
from typing import Any

from etils import epath
import numpy as np

from flax_ckpt_plugin.errors import CheckpointCorruptedError

TENSORSTORE_MISSING = ("import-orbax needs tensorstore (flax installs it):"
                       " pip install 'flax_ckpt_plugin[orbax]'")

# The file of a PyTree that Orbax wrote (StandardSave, PyTreeSave).
TREE_FILE = "_METADATA"
# The kinds of key that `_METADATA` records for each level of a key path.
_SEQUENCE_KEY, _DICT_KEY = 1, 2
# Leaves that Orbax records with no data: empty containers and None.
_EMPTY = {"None": lambda: None, "Dict": dict, "List": list, "Tuple": list,
          "NamedTuple": lambda: None}
# Leaves stored as arrays: `jax.Array`, numpy arrays, Python/numpy scalars.
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


class TensorstoreNotInstalledError(ImportError):
  """tensorstore, which reads the arrays Orbax wrote, is not installed."""


class OrbaxReadError(CheckpointCorruptedError):
  """The tree's metadata or arrays cannot be read, or it holds values that a
  checkpoint of ours cannot hold (strings)."""


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
  # JAX is imported here: the command line imports this module, and
  # `importer.cmd_import_orbax` keeps JAX on the host before it reads.
  import jax  # pylint: disable=g-import-not-at-top
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
