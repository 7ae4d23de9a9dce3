"""Restore a step into a target pytree, on the target's devices and shardings.

The target is a concrete pytree (e.g. a Flax `TrainState` as created at start)
or an abstract one from `jax.eval_shape`, whose `jax.ShapeDtypeStruct` leaves
may carry `sharding=`. The result has the target's tree type, so non-array
parts of a `TrainState` (`apply_fn`, `tx`) come from the target. Each process
reads only the byte ranges that its addressable target shards need, so a
checkpoint written by any number of devices can be read by any other.
Every leaf is matched against the target (paths, shapes, dtypes; see
`matching`) before any data is read; `reader.LeafReader` then reads the
regions (through a `casting.CastReader` where a restore with `cast=True`
converts the dtype), and `placement` puts them on the devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Iterable

from etils import epath
import jax
import numpy as np

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.restore import window as window_lib
from flax_ckpt_plugin.restore import placement
from flax_ckpt_plugin.restore import renaming
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.format.records import held_elements
from flax_ckpt_plugin.format.records import Index
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.format.records import Manifest
from flax_ckpt_plugin.restore.data_files import ByteReader
from flax_ckpt_plugin.restore.options import RestoreOptions
from flax_ckpt_plugin.restore.reader import LeafReads
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.restore.matching import check_key_impl
from flax_ckpt_plugin.restore.matching import match_structure
from flax_ckpt_plugin.format.treepaths import leaf_paths
from flax_ckpt_plugin.format.treepaths import normalize_index

# Leaves restored at once: reads and checksums release the GIL.
_THREADS = min(8, os.cpu_count() or 1)
# Daemon threads: one stuck in a read is left behind once the read's
# deadline passed (`deadlines.Pool`).
_POOL = deadlines.Pool(_THREADS, "flax_ckpt_plugin-restore")


_BATCH_BYTES = 8 << 20  # Small leaves restored per task, in bytes.
_BATCH_LEAVES = 128  # And in leaves: a task costs about 100 us to hand out.


def _batches(targets: list[tuple[str, Any]], saved: dict[str, LeafRecord]
             ) -> list[list[tuple[str, Any]]]:
  """Consecutive leaves grouped into tasks of about `_BATCH_BYTES`."""
  out: list[list[tuple[str, Any]]] = []
  size = 0
  for path, leaf in targets:
    nbytes = saved[path].nbytes
    if (not out or size + nbytes > _BATCH_BYTES
        or len(out[-1]) >= _BATCH_LEAVES):
      out.append([])
      size = 0
    out[-1].append((path, leaf))
    size += nbytes
  return out


def _regions(saved: LeafRecord, target: Any) -> list[Index]:
  """The regions of `saved` that this process restores for `target`."""
  whole = tuple((0, d) for d in saved.shape)
  if (saved.is_scalar or saved.key_impl is not None  # Keys: read whole.
      or not isinstance(target, (jax.Array, jax.ShapeDtypeStruct))):
    return [whole]
  indices = placement.target_sharding(target).addressable_devices_indices_map(
      saved.shape).values()
  return [whole if i is None else normalize_index(i, saved.shape)
          for i in indices]


def _check_held(saved: dict[str, LeafRecord], targets: list[tuple[str, Any]],
                where: str) -> None:
  """For a step of one process's shards (`Manifest.scope`): raises unless
  it holds every region this process restores (same shardings as saved).

  Raises:
    CheckpointNotFoundError: names the first leaf and region not held.
  """
  for path, target in targets:
    leaf = saved[path]
    if leaf.is_scalar:
      continue
    for region in _regions(leaf, target):
      if held_elements(leaf.shards, region) != math.prod(
          hi - lo for lo, hi in region):
        raise CheckpointNotFoundError(
            f"{where}, leaf {path!r}: holds only this process's shards as"
            f" saved, and not region {[list(r) for r in region]} that the"
            " target places here (another sharding or process layout?)")


def _restore_batch(batch: list[tuple[LeafRecord, Any]], reads: LeafReads,
                   window: window_lib.RestoreWindow) -> list[Any]:
  ranges = [] if len(batch) < 2 else [
      r for saved, target in batch if not saved.is_scalar
      for r in reads.open(saved).small_shard_ranges(
          _regions(saved, target))]
  with reads.reader.coalesced(ranges):
    return [placement.restore_leaf(saved, target, reads, window=window)
            for saved, target in batch]


def plain_target(leaves: Iterable[LeafRecord],
                 rename: renaming.Renaming | None = None) -> Any:
  """A target for restoring `leaves` (a step's) without one of the user's.

  Nested dicts with string keys, as `flax.serialization.to_state_dict`
  spells a tree (attribute names, list indices as '0', '1'...), so
  `flax.serialization.from_state_dict(state, restored)` puts the result
  into a `TrainState`. Array leaves come back as whole numpy arrays on the
  host, Python scalars as themselves, typed PRNG keys as JAX key arrays on
  the first local device. A tree that is one leaf is that leaf. Nodes
  without leaves (an `optax.EmptyState`) have no entry. With a `rename`,
  the leaves are under their target paths (split at '/'), and those it
  drops are left out.
  """
  root: dict[str, Any] = {}
  leaves = list(leaves)
  renamed = None
  if rename is not None and rename.renames:
    renamed = {old: new for new, old in rename.names(
        leaf.path for leaf in leaves).items()}
  for leaf in leaves:
    if renamed is not None and leaf.path not in renamed:
      continue
    if leaf.is_scalar:
      placeholder = leaf.value
    elif leaf.key_impl is not None:
      placeholder = jax.eval_shape(
          functools.partial(jax.random.wrap_key_data, impl=leaf.key_impl),
          jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    else:  # Zero strides: shape and dtype, no memory.
      placeholder = np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
    if renamed is not None:
      names = renamed[leaf.path].split("/")
    elif not leaf.keys:
      return placeholder
    else:
      names = [str(next(iter(k.values()))) for k in leaf.keys]
    node = root
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = placeholder
  return root


@dataclasses.dataclass(frozen=True)
class Source:
  """Where the leaves of a restore are: a step's data files, or any files
  whose arrays lie whole and in C order at known byte ranges (safetensors
  files: `safetensors_load`).

  Attributes:
    directory: the folder of the files; their names are relative to it.
    files: each file's name and the size it must have at least.
    leaves: the saved leaves, their shards in `files`.
    block: bytes per checksum of the shards (when they have checksums).
    where: how messages name the source ("step 5 in /ckpt/5").
    shown: how a structure mismatch names it ("the tree in ...").
    scope: see `Manifest.scope`.
    call: the function that the hints of a mismatch name.
    within: no file may lead outside this folder (default: `directory`).
  """
  directory: epath.Path
  files: dict[str, int]
  leaves: tuple[LeafRecord, ...]
  block: int
  where: str
  shown: Any
  scope: tuple[int, int] | None = None
  call: str = "restore"
  within: epath.Path | None = None


def restore_tree(step_dir: epath.Path, manifest: Manifest, target: Any,
                 options: RestoreOptions = RestoreOptions(), *,
                 backend: interface.Backend | None = None,
                 io_timeout_secs: float = deadlines.IO_TIMEOUT_SECS
                 ) -> tuple[Any, int]:
  """Builds a pytree like `target` from the step at `step_dir`.

  Args:
    step_dir: the finalized step directory.
    manifest: its manifest, from `manifest.read`.
    target: the concrete or abstract pytree to restore like.
    options: verify, partial, missing, cast and rename (`RestoreOptions`;
      a cast is logged in one line that counts the leaves, and target
      leaves kept with `missing="keep"` in one that names them).
    backend: the directory's storage (default: by the path's scheme).
    io_timeout_secs: the deadline of each read of storage.

  Returns:
    The pytree, and the number of bytes this process read from data files.

  Raises:
    StructureMismatchError: leaf paths, shapes or dtypes differ; the message
      names every such leaf and both sides. Raised before any data is read,
      except for an integer that a narrower target cannot hold (`cast`).
    CheckpointCorruptedError: data files are missing, short, inconsistent
      or fail their checksums; the message names the file, step and leaf.
    CheckpointNotFoundError: a step of one process's shards does not hold
      what this process restores (raised before any data is read).
    renaming.RenameError: the rename gives two leaves one name.
    StorageTimeoutError: a read did not return within `io_timeout_secs`;
      names the file and the bytes.
  """
  return restore_records(
      Source(directory=step_dir, files=manifest.files,
             leaves=manifest.leaves, block=manifest.checksum_block_bytes,
             where=f"step {manifest.step} in {step_dir}", shown=step_dir,
             scope=manifest.scope),
      target, options, backend=backend, io_timeout_secs=io_timeout_secs)


def restore_records(source: Source, target: Any, options: RestoreOptions, *,
                    backend: interface.Backend | None,
                    io_timeout_secs: float = deadlines.IO_TIMEOUT_SECS
                    ) -> tuple[Any, int]:
  """`restore_tree` of any `Source`: the same matching, casting, reading
  and placing. `options.verify` only where its shards carry checksums."""
  rename = options.rename
  saved = rename.apply(source.leaves)
  targets, treedef = leaf_paths(target)
  where = source.where
  kept = set(match_structure(
      saved, [(p, leaf) for p, _, leaf in targets], source.shown, options,
      call=source.call,
      explain=lambda: rename.explain(leaf.path for leaf in source.leaves)))
  if kept:
    log.warning("%s: %d target leaves are not in the checkpoint and keep"
                " the target's values: %s", where, len(kept), sorted(kept))
  order = [p for p, _, _ in targets]
  given = {p: leaf for p, _, leaf in targets if p in kept}
  for path, _, _ in targets:  # Now each impl is the target's, so known.
    if path not in kept:
      check_key_impl(saved[path], where)
  targets = [(p, placement.on_context_mesh(p, leaf)) for p, _, leaf in targets
             if p not in kept]
  if options.cast:
    placement.log_casts(where, saved, targets)
  batches = _batches(targets, saved)
  if source.scope is not None:
    _check_held(saved, targets, where)
  in_flight = deadlines.InFlight(io_timeout_secs, where)
  reader = ByteReader(source.directory, source.files, backend,
                      within=source.within, in_flight=in_flight)
  reads = LeafReads(reader=reader, verify=options.verify,
                    block=source.block, where=where, cast=options.cast)
  window = window_lib.RestoreWindow()
  try:
    leaves = [leaf for batch in deadlines.wait_all(
        [_POOL.submit(_restore_batch, [(saved[p], leaf) for p, leaf in batch],
                      reads, window, watcher=in_flight)
         for batch in batches],
        in_flight=in_flight, pool=_POOL, first_error=True) for leaf in batch]
    # The transfers out of pinned buffers: their error is the restore's,
    # and their buffers go back to the pool.
    window.wait()
  finally:
    if not in_flight.given_up:  # Else stuck reads may still use the files.
      reader.close()
  if given:
    read = iter(leaves)
    leaves = [given[p] if p in given else next(read) for p in order]
  return jax.tree_util.tree_unflatten(treedef, leaves), reader.bytes_read
