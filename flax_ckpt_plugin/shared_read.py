"""A restore in which storage serves each byte once, whatever the replicas.

When a target array is replicated over several processes (data
parallelism; the replicas of HSDP), every process reading its own copy
pulls the state from storage once per process: 64 hosts, 64 copies of the
egress. Here the processes that need a region split it instead: each reads
a contiguous range of its rows (checksums verified), and one jitted
program over the target's own mesh gives every device the whole region,
with the same sum of bytes as `peer` (each device contributes its range's
bytes at their place and zeros elsewhere, one contribution per process;
the sum over the replica axes holds every byte once, so it is the region,
bit for bit). No socket of our own.

Leaves it does not take (Python scalars, numpy and non-`NamedSharding`
targets, PRNG keys, dtypes XLA does not bitcast or JAX holds narrower
(64-bit ones without `jax_enable_x64`), bytes saved big-endian, arrays
held by one process per region) are read by each process as in
`restore.restore_tree`.

Memory: a process holds, per replicated leaf, a block of the region's
bytes for each of its devices (zeros but for its range) and the result,
so a restore peaks at about the target's bytes times (devices per process
+ 1) on the host, against one copy plus the result when each reads alone.

Called by every process with the same `key` (see `restore`): the reads are
agreed on before anyone enters the program, so a damaged file on one
process is known to all, and none waits in a collective for it.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from flax_ckpt_plugin import coordinator as coordinator_lib
from flax_ckpt_plugin import fallback
from flax_ckpt_plugin import groups
from flax_ckpt_plugin import manifest as manifest_lib
from flax_ckpt_plugin import matching
from flax_ckpt_plugin import peer
from flax_ckpt_plugin import restore as restore_lib
from flax_ckpt_plugin import writeplan
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.errors import RestoreFailedError
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.reader import ByteReader
from flax_ckpt_plugin.reader import LeafReader
from flax_ckpt_plugin.staging import bits_dtype
from flax_ckpt_plugin.treepaths import Index
from flax_ckpt_plugin.treepaths import leaf_paths
from flax_ckpt_plugin.treepaths import normalize_index


class _Split(NamedTuple):
  """How one replicated leaf is read and spread."""
  stacked: NamedSharding  # Of the [replicas, *shape, itemsize] bytes.
  replicas: int
  # Per device that reads: (its region, the part of it that it reads).
  parts: dict[Any, tuple[Index, Index]]


def _split(target: Any, load: dict[int, int] | None = None
           ) -> _Split | None:
  """The plan of a target leaf whose regions several processes need (an
  array of a dtype that travels as bytes), else None.

  A region of `writeplan.SPLIT_BYTES` or more is cut into one row range per
  process that needs it, as a save cuts it (so each reads what one piece
  of the save holds, and no checksum block twice); a smaller one is read
  whole by the process that has read the fewest bytes so far (`load`,
  shared by the leaves of one restore, in order: the same on every
  process).
  """
  load = {} if load is None else load
  if not isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
    return None
  sharding, shape, dtype = getattr(target, "sharding", None), tuple(
      target.shape), target.dtype
  if (not isinstance(sharding, NamedSharding) or not shape
      or jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)
      or (dtype != np.bool_ and bits_dtype(dtype) is None)):
    return None
  by_region: dict[Index, list[Any]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    by_region.setdefault(normalize_index(index, shape), []).append(device)
  if all(len({d.process_index for d in ds}) < 2
         for ds in by_region.values()):
    return None  # No region needed by two processes: each reads its own.
  mesh, spec = sharding.mesh, tuple(sharding.spec)
  used = set()
  for entry in spec:
    used.update(entry if isinstance(entry, tuple) else
                () if entry is None else (entry,))
  spare = tuple(a for a in mesh.axis_names if a not in used)
  spec = spec + (None,) * (len(shape) - len(spec))
  stacked = NamedSharding(mesh, PartitionSpec(spare or None, *spec, None))
  itemsize = np.dtype(dtype).itemsize
  parts = {}
  for region, devices in sorted(by_region.items()):
    first: dict[int, Any] = {}  # Each process's first device holding it.
    for d in devices:
      first.setdefault(d.process_index, d)
    procs = sorted(first, key=lambda p: (load.get(p, 0), p))
    start, stop = region[0]
    nbytes = math.prod(hi - lo for lo, hi in region) * itemsize
    count = 1
    if nbytes >= writeplan.SPLIT_BYTES:
      count = max(1, min(len(procs), stop - start))
      procs = sorted(procs)  # Equal cuts: who reads which does not matter.
    for proc, (a, b) in zip(procs, writeplan.cuts(stop - start, count)):
      parts[first[proc]] = (region, ((start + a, start + b),) + region[1:])
      load[proc] = load.get(proc, 0) + nbytes * (b - a) // max(
          1, stop - start)
  replicas = math.prod(mesh.shape[a] for a in spare)
  return _Split(stacked, replicas, parts)


def worth_it(target: Any) -> bool:
  """Whether some region of `target` is needed by several processes.

  Depends on the target alone (its shardings are the same on every
  process), so every process decides the same.
  """
  return jax.process_count() > 1 and any(
      _split(t) is not None for t in jax.tree.leaves(target))


def restore(coord: coordinator_lib.Coordinator, key: str, step_dir: Any,
            read_manifest: Any, target: Any, *, step: int,
            reads_manifest: bool, backend: Any, verify: bool,
            timeout_ms: int, before: Any = None) -> tuple[Any, int, Any]:
  """Restores `step` from `step_dir` like `target`; see the module doc.

  Called on every process with the same `key`, one no call used before.
  The process with `reads_manifest` (one: the primary) calls
  `read_manifest()` for the raw bytes of the step's manifest (checking
  first that the step is finalized) and shares them through the
  coordinator; the others read no manifest, so storage serves it once.
  `before(manifest)` then runs on every process (the data state's checks).
  Both run inside agreed phases, so that an error on one process is known
  to all.

  Returns:
    The tree, the bytes this process read, and what `before` returned.

  Raises:
    CheckpointCorruptedError, FileNotFoundError: this process's files.
    CheckpointNotFoundError: the step is not finalized (raised by all).
    fallback.Unsuitable: another process found the step damaged, or not
      for it (skip it).
    RestoreFailedError: another process failed otherwise.
    StructureMismatchError: the target does not fit (raised by all).
  """
  where = str(step_dir)
  shared = f"{key}/manifest"
  own: list[manifest_lib.Manifest] = []

  def share():
    if reads_manifest:
      raw = read_manifest()
      own.append(manifest_lib.of_step(raw, step_dir, step))  # Valid UTF-8.
      groups.share_text(coord, shared, raw.decode("utf-8"))

  _check(coordinator_lib.agree(coord, f"{key}/shared", share,
                               timeout_ms=timeout_ms), where)

  def prepare():
    manifest = own[0] if own else manifest_lib.of_step(
        groups.fetch_text(coord, shared, timeout_ms).encode("utf-8"),
        step_dir, step)
    extra = None if before is None else before(manifest)
    return _prepare(step_dir, manifest, target, backend, verify,
                    where) + (extra,)

  outcome = coordinator_lib.agree(coord, f"{key}/read", prepare,
                                  timeout_ms=timeout_ms)
  if reads_manifest:  # Every process has it now: free the service's copy.
    coord.kv_delete(shared)
  _check(outcome, where)
  return _run(*outcome.result)


def _check(outcome: coordinator_lib.Outcome, where: str) -> None:
  """Raises what a phase's failures mean here (see `restore`)."""
  if outcome.error is not None:
    raise outcome.error
  if not outcome.failures:
    return
  text = coordinator_lib.describe_failures(outcome.failures)
  kinds = {f[0] for f in outcome.failures.values()}
  if kinds == {"CheckpointNotFoundError"}:  # The primary's, alone.
    raise CheckpointNotFoundError(
        "; ".join(m for _, m in outcome.failures.values()))
  if kinds & {"CheckpointCorruptedError", "FileNotFoundError",
              "CheckpointNotFoundError", "Unsuitable"}:
    raise fallback.Unsuitable(f"{where} is damaged on other processes:"
                              f" {text}")
  raise RestoreFailedError(f"restoring {where} failed on other processes:"
                           f" {text}")


def _prepare(step_dir: Any, manifest: manifest_lib.Manifest, target: Any,
             backend: Any, verify: bool, where: str):
  """Matches the target, reads this process's parts and its own leaves,
  and builds the program; everything that can fail fails here."""
  targets, treedef = leaf_paths(target)
  saved = manifest.leaf_by_path
  matching.match_structure(saved, [(p, t) for p, _, t in targets], step_dir)
  for path, _, _ in targets:
    matching.check_key_impl(saved[path], where)
  t0 = time.perf_counter()
  reader = ByteReader(step_dir, manifest.files, backend)
  lr_args = {"reader": reader, "verify": verify,
             "block": manifest.checksum_block_bytes, "where": where}
  plans, load = [], {}
  try:
    for path, _, t in targets:
      t = restore_lib.on_context_mesh(path, t)
      leaf = saved[path]
      # Read alone: bytes saved big-endian (by an older version), which
      # need a swap on the host, and dtypes JAX holds narrower (int64
      # without jax_enable_x64), which the program cannot bitcast to. The
      # manifest says so alike on every process.
      split = None if (
          leaf.dtype is None or leaf.dtype.byteorder == ">"
          or jax.dtypes.canonicalize_dtype(leaf.dtype) != leaf.dtype) else (
              _split(t, load))
      if split is None:
        plans.append(("own", restore_lib.restore_leaf(leaf, t, lr_args)))
        continue
      lr = LeafReader(leaf=leaf, **lr_args)
      blocks = []
      for device, index in t.sharding.addressable_devices_indices_map(
          leaf.shape).items():
        region = normalize_index(index, leaf.shape)
        block = np.zeros((1,) + tuple(hi - lo for lo, hi in region)
                         + (leaf.dtype.itemsize,), np.uint8)
        if device in split.parts:
          _, part = split.parts[device]
          rows = slice(part[0][0] - region[0][0], part[0][1] - region[0][0])
          block[0, rows] = peer.as_bytes(lr.read(part))
        blocks.append(jax.device_put(block, device))
      array = jax.make_array_from_single_device_arrays(
          (split.replicas,) + leaf.shape + (leaf.dtype.itemsize,),
          split.stacked, blocks)
      plans.append(("split", (array, leaf.dtype, t.sharding)))
  finally:
    reader.close()
  t = time.perf_counter()
  split = [p for kind, p in plans if kind == "split"]
  program = jax.jit(
      functools.partial(peer.sum_of_bytes, dtypes=tuple(d for _, d, _ in split)),
      out_shardings=([s for _, _, s in split], None))
  compiled = program.lower([a for a, _, _ in split], None).compile()
  log.debug("%s: read %d bytes in %.2f s, compiled in %.2f s", where,
            reader.bytes_read, t - t0, time.perf_counter() - t)
  return treedef, plans, compiled, reader.bytes_read


def _run(treedef: Any, plans: list, compiled: Any, nbytes: int, extra: Any
         ) -> tuple[Any, int, Any]:
  """The collective part: every process, the same program."""
  t = time.perf_counter()
  arrays = [p[0] for kind, p in plans if kind == "split"]
  out, _ = jax.block_until_ready(compiled(arrays, None))
  del arrays
  log.debug("shared %d leaves in %.2f s", len(out), time.perf_counter() - t)
  gathered = iter(out)
  leaves = [next(gathered) if kind == "split" else value
            for kind, value in plans]
  return jax.tree_util.tree_unflatten(treedef, leaves), nbytes, extra
