"""A restore in which storage serves each byte once, whatever the replicas.

When a target array is replicated over several processes (data
parallelism; the replicas of HSDP), every process reading its own copy
pulls the state from storage once per process: 64 hosts, 64 copies of the
egress. Here the processes that need a region split it instead: each reads
a contiguous range of its rows, as the save cut it (checksums verified),
and each of its devices holding the region contributes a slot of that
range. One jitted program over the target's own mesh gathers the slots
along the replica axes, so that every device gets the whole region. No
socket of our own. Only the primary reads the manifest; the others receive
it through the coordinator.

A region under `writeplan.SPLIT_BYTES` (which the save wrote whole) is
read whole by one process (the one that has read least so far), into the
slot of one of its devices. A collective costs about the same whatever
its size (20 ms each here with 4 processes), so the small leaves that are
replicated on every device are packed (`_Pack`): each device contributes
one slot holding the leaves it read, one collective gathers the slots,
and each process cuts the leaves out on the host. Regions under
`MIN_SHARED_BYTES` are not shared (a page costs storage little). Those,
and the leaves it does not take (Python scalars, numpy and
non-`NamedSharding` targets, PRNG keys, dtypes XLA does not bitcast or JAX
holds narrower (64-bit ones without `jax_enable_x64`), bytes saved
big-endian, regions of unequal rows or cut differently, arrays held by one
process per region), are read by each process as in
`restore.restore_tree`.

Memory: a process holds, per shared region, about its range of the rows
(each local device's slot, padded to the longest slot) besides the result;
for a region read whole by one process, a block of its size per device,
except packed leaves: every device then holds the batch's packed leaves
once (all slots), and the process one host copy of them.

The shared leaves go in batches of about `BATCH_BYTES`, one program each,
started (JAX dispatches it and returns) as soon as a batch is read, so
that the collectives of one batch run while the next is read.

Called by every process with the same `key` (see `restore`). Every process
starts every program, whatever it meets: one whose file is damaged goes
on with zeros and raises its error once its programs ran, and the
agreement that follows tells all to drop the result (and try an older
step), so none waits in a collective for another.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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


# Smaller regions are read by every process that needs them: reading them
# costs storage little.
MIN_SHARED_BYTES = 4 << 10
# Shared leaves go in batches of about this many bytes, one program each:
# a batch is shared while the next is read. A collective costs about 20 ms
# here whatever its size, so batches are not smaller.
BATCH_BYTES = 16 << 20


class _Split(NamedTuple):
  """How one replicated leaf is read and spread: each device holding a
  region contributes a slot of `rows` rows of it (its share of its
  process's range, padded with zeros), and the program gathers the slots
  along the replica axes and takes the region's rows back in order
  (`index`: each row's position in the slots laid end to end)."""
  stacked: NamedSharding  # Of the slots the devices contribute...
  shape: tuple[int, ...]  # ...whose global shape is this.
  # Per device holding a region: (its region, the rows of it it holds).
  parts: dict[Any, tuple[Index, Index]]
  rows: int  # Rows per slot.
  index: np.ndarray


def _split(target: Any, load: dict[int, int] | None = None
           ) -> _Split | None:
  """The plan of a target leaf whose regions several processes need (an
  array of a dtype that travels as bytes, in regions of equal rows of
  `MIN_SHARED_BYTES` or more), else None.

  A region of `writeplan.SPLIT_BYTES` or more is cut into one row range
  per process that needs it, as a save cuts it (so each reads what one
  piece of the save holds, and no checksum block twice), and each range
  into one slot per device of the process holding the region. A smaller
  region (which the save wrote whole) is read whole by the process that
  has read the fewest bytes so far, into the slot of its first device
  holding it (`load`: bytes per process, shared by the leaves of one
  restore in order, so the same on every process).
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
  spare, stacked, replicas = peer.replica_axes(sharding, len(shape))
  itemsize = np.dtype(dtype).itemsize
  return _gathered(by_region, sharding.mesh, spare, shape, itemsize,
                   stacked, replicas, load)


@functools.lru_cache(maxsize=64)
def _positions(mesh: Any, spare: tuple[str, ...]) -> dict[Any, int]:
  """Device: its index along the replica (`spare`) axes of `mesh`."""
  spare_axes = [mesh.axis_names.index(a) for a in spare]
  position = {}
  for coords, device in np.ndenumerate(mesh.devices):
    position[device] = int(np.ravel_multi_index(
        [coords[a] for a in spare_axes],
        [mesh.devices.shape[a] for a in spare_axes])) if spare_axes else 0
  return position


def _gathered(by_region, mesh, spare, shape, itemsize, stacked, replicas,
              load) -> _Split | None:
  """The plan (see `_Split`), or None: regions under `MIN_SHARED_BYTES`,
  of unequal rows, or cut in different places."""
  position = _positions(mesh, tuple(spare))
  regions = sorted(by_region)
  lengths = {hi - lo for (lo, hi), *_ in regions}
  nbytes = math.prod(hi - lo for lo, hi in regions[0]) * itemsize
  if len(lengths) != 1 or nbytes < MIN_SHARED_BYTES:
    return None
  length = lengths.pop()
  whole = None  # The process that reads every (small) region whole.
  if nbytes < writeplan.SPLIT_BYTES:
    holders = set.intersection(*({d.process_index for d in by_region[r]}
                                 for r in regions))
    whole = min(holders, key=lambda p: (load.get(p, 0), p), default=None)
    if whole is None:
      return None
  # Device: the rows of its region it contributes (none if the region has
  # fewer rows than processes holding it).
  slots: dict[Any, tuple[int, int]] = {d: (0, 0) for d in position}
  layouts = set()
  for region in regions:
    devices = sorted(by_region[region], key=position.get)
    procs = sorted({d.process_index for d in devices})
    layout = [None] * replicas
    for proc, (a, b) in zip(procs, writeplan.cuts(
        length, min(len(procs), length))):
      mine = [d for d in devices if d.process_index == proc]
      if whole is not None:  # All rows to its least loaded device.
        mine, (a, b) = [min((d for d in devices if d.process_index == whole),
                            key=lambda d: (load.get(("device", d.id), 0),
                                           position[d]))], (0, length)
        load[("device", mine[0].id)] = load.get(
            ("device", mine[0].id), 0) + nbytes
      for d, (c, e) in zip(mine, writeplan.cuts(b - a, len(mine))):
        slots[d] = (a + c, a + e)
        layout[position[d]] = (a + c, a + e)
      if whole is not None:
        break
    layouts.add(tuple(layout))
  if len(layouts) != 1:
    return None
  reads: dict[int, int] = {}
  for d, (lo, hi) in slots.items():
    if hi > lo:
      reads[d.process_index] = reads.get(d.process_index, 0) + (
          nbytes // length * (hi - lo))
  for proc, n in reads.items():
    load[proc] = load.get(proc, 0) + n
  layout = layouts.pop()
  rows = max(1, max((hi - lo for lo, hi in filter(None, layout)), default=1))
  index = np.empty(length, np.int32)
  for slot, cut in enumerate(layout):
    if cut is not None:
      index[cut[0]:cut[1]] = slot * rows + np.arange(cut[1] - cut[0])
  parts = {}
  for region in regions:
    for d in by_region[region]:
      lo, hi = slots[d]
      parts[d] = (region, ((region[0][0] + lo, region[0][0] + hi),)
                  + region[1:])
  regions_0 = shape[0] // length
  return _Split(stacked, (replicas, regions_0 * rows) + shape[1:] + (
      itemsize,), parts, rows, index)


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
  log.debug("%s: restoring together", where)
  shared = f"{key}/manifest"
  own: list[manifest_lib.Manifest] = []

  def share():
    if reads_manifest:
      raw = read_manifest()
      own.append(manifest_lib.of_step(raw, step_dir, step))  # Valid UTF-8.
      groups.share_text(coord, shared, raw.decode("utf-8"))

  _check(coordinator_lib.agree(coord, f"{key}/shared", share,
                               timeout_ms=timeout_ms), where,
         primary_reads=True)

  def prepare():
    log.debug("%s: manifest shared", where)
    manifest = own[0] if own else manifest_lib.of_step(
        groups.fetch_text(coord, shared, timeout_ms).encode("utf-8"),
        step_dir, step)
    return _prepare(step_dir, manifest, target, backend, verify, where,
                    before)

  outcome = coordinator_lib.agree(coord, f"{key}/read", prepare,
                                  timeout_ms=timeout_ms)
  if reads_manifest:  # Every process has it now: free the service's copy.
    try:
      coord.kv_delete(shared)
    except Exception as e:  # pylint: disable=broad-except
      # Not worth leaving the others alone in the collective.
      log.warning("could not delete the shared manifest %s: %s", shared, e)
  _check(outcome, where)
  return _run(*outcome.result)


def _check(outcome: coordinator_lib.Outcome, where: str,
           primary_reads: bool = False) -> None:
  """Raises what a phase's failures mean here (see `restore`);
  `primary_reads`: the phase in which only the primary reads (a step it
  finds unfinalized is so for all)."""
  if outcome.error is not None:
    raise outcome.error
  if not outcome.failures:
    return
  text = coordinator_lib.describe_failures(outcome.failures)
  kinds = {f[0] for f in outcome.failures.values()}
  if primary_reads and kinds == {"CheckpointNotFoundError"}:
    raise CheckpointNotFoundError(
        "; ".join(m for _, m in outcome.failures.values()))
  if kinds & {"CheckpointCorruptedError", "FileNotFoundError",
              "CheckpointNotFoundError", "Unsuitable"}:
    raise fallback.Unsuitable(f"{where} is damaged on other processes:"
                              f" {text}")
  raise RestoreFailedError(f"restoring {where} failed on other processes:"
                           f" {text}")


def _prepare(step_dir: Any, manifest: manifest_lib.Manifest, target: Any,
             backend: Any, verify: bool, where: str, before: Any):
  """Matches the target, reads this process's parts and its own leaves,
  and starts the programs that share them; see `_read`."""
  targets, treedef = leaf_paths(target)
  saved = manifest.leaf_by_path
  matching.match_structure(saved, [(p, t) for p, _, t in targets], step_dir)
  for path, _, _ in targets:
    matching.check_key_impl(saved[path], where)
  leaves, load = [], {}
  for path, _, t in targets:
    t = restore_lib.on_context_mesh(path, t)
    leaf = saved[path]
    # Read alone: bytes saved big-endian (by an older version), which need
    # a swap on the host, and dtypes JAX holds narrower (int64 without
    # jax_enable_x64), which the program cannot bitcast to. The manifest
    # says so alike on every process.
    split = None if (
        leaf.dtype is None or leaf.dtype.byteorder == ">"
        or jax.dtypes.canonicalize_dtype(leaf.dtype) != leaf.dtype) else (
            _split(t, load))
    leaves.append((leaf, t, split))
  batches = _batches(leaves)
  packs = [_pack(leaves, batch) for batch in batches]
  # The programs depend on the shapes alone: traced and compiled on a
  # thread while this one reads, with the caller's `jax_enable_x64` (a
  # per-thread setting, as under `jax.enable_x64`).
  x64 = jax.config.jax_enable_x64

  def build(batch: list[int], pack: _Pack | None) -> Any:
    alone = [i for i in batch if pack is None or i not in pack.pieces]
    how = [(leaves[i][0].dtype, leaves[i][2]) for i in alone]

    def program(flat, stacked):
      return (_assemble(stacked, [(d, s.rows, s.index, s.stacked)
                                  for d, s in how]),
              None if pack is None else _constrain(flat, pack.everywhere))

    with jax.enable_x64(x64):
      return jax.jit(
          program,
          out_shardings=([leaves[i][1].sharding for i in alone],
                         pack and pack.everywhere)).lower(
              pack and jax.ShapeDtypeStruct(
                  (len(pack.devices), pack.length), np.uint8,
                  sharding=pack.sharding),
              [jax.ShapeDtypeStruct(s.shape, np.uint8, sharding=s.stacked)
               for _, s in how]).compile()

  with concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix="flax_ckpt_plugin-compile") as pool:
    compiling = [pool.submit(build, batch, pack)  # In order.
                 for batch, pack in zip(batches, packs)]
    extra, plans, nbytes = _read(step_dir, manifest, backend, verify, where,
                                 leaves, batches, packs, compiling, before)
  return treedef, plans, nbytes, extra


def _batches(leaves: list) -> list[list[int]]:
  """The shared leaves (their positions) in runs of about `BATCH_BYTES`,
  in order: one program each, so that sharing one runs while the next is
  read. The same on every process."""
  batches, size = [[]], 0
  for i, (leaf, _, split) in enumerate(leaves):
    if split is None:
      continue
    if size >= BATCH_BYTES:
      batches.append([])
      size = 0
    batches[-1].append(i)
    size += leaf.nbytes
  return batches if batches[0] else []


class _Pack(NamedTuple):
  """The small replicated leaves of a batch, packed so that one collective
  shares them all. Each device of the mesh contributes one slot of
  `length` bytes: the leaves it read, end to end (`pieces`: per leaf
  position, (slot, offset, bytes, device, first row, end row) of each
  piece, in row order). The program gathers the slots on every device;
  each process then cuts the leaves out on the host and puts them on its
  devices (`_run`). A program that cut them out itself took XLA about
  13 ms per leaf to compile (8 devices), longer than the reads."""
  sharding: NamedSharding  # [slots, length], a slot per device of the mesh.
  everywhere: NamedSharding  # The same, on every device.
  devices: list[Any]  # Slot k is devices[k]'s.
  length: int
  pieces: dict[int, list[tuple[int, int, int, Any, int, int]]]


def _pack(leaves: list, batch: list[int]) -> _Pack | None:
  """The pack of a batch's leaves under `writeplan.SPLIT_BYTES` that are
  replicated on every device of one mesh (the mesh of the first), or None
  when fewer than two are. Their slots pack into one array; a larger leaf,
  or one sharded over some axis, keeps its own."""
  def replicated(i):
    leaf, t, _ = leaves[i]
    return (leaf.nbytes < writeplan.SPLIT_BYTES
            and all(e is None for e in t.sharding.spec))
  chosen = [i for i in batch if replicated(i)]
  if len(chosen) < 2:
    return None
  mesh = leaves[chosen[0]][1].sharding.mesh
  chosen = [i for i in chosen if leaves[i][1].sharding.mesh == mesh]
  devices = list(mesh.devices.flat)
  slot = {d: k for k, d in enumerate(devices)}
  fill = [0] * len(devices)
  pieces = {}
  for i in chosen:
    leaf, _, split = leaves[i]
    row = leaf.nbytes // leaf.shape[0]
    mine = []
    for d, (_, rows) in sorted(split.parts.items(),
                               key=lambda kv: kv[1][1][0]):
      lo, hi = rows[0]
      if hi > lo:
        k = slot[d]
        mine.append((k, fill[k], (hi - lo) * row, d, lo, hi))
        fill[k] += (hi - lo) * row
    pieces[i] = mine
  return _Pack(NamedSharding(mesh, PartitionSpec(mesh.axis_names, None)),
               NamedSharding(mesh, PartitionSpec()), devices,
               max(1, max(fill)), pieces)


def _read(step_dir: Any, manifest: manifest_lib.Manifest, backend: Any,
          verify: bool, where: str, leaves: list, batches: list[list[int]],
          packs: list[_Pack | None], compiling: list, before: Any
          ) -> tuple[Any, list, int]:
  """Runs `before(manifest)`, reads this process's leaves and its parts
  of the shared ones, and starts each batch's program once its parts are
  read, while the next batch is read.

  Every process starts every program, whatever happens here: a process
  that fails (a damaged file) goes on with zeros in its slots and raises
  its error once all programs ran, so that no other process waits in a
  collective for it; the agreement (`restore`) then tells all to drop the
  result.

  Returns:
    What `before` returned; per leaf, ("own", its value), ("shared",
    (batch, position among the batch's outputs)) or ("packed", (batch,
    target, record, pieces)); the programs' outputs and the packs; the
    bytes read.
  """
  reader = ByteReader(step_dir, manifest.files, backend)
  lr_args = {"reader": reader, "verify": verify,
             "block": manifest.checksum_block_bytes, "where": where}
  batch_of = {i: (b, k) for b, batch in enumerate(batches)
              for k, i in enumerate(batch)}
  slots: dict[int, jax.Array] = {}
  flats: dict[int, dict[Any, np.ndarray]] = {}  # Per batch: packed slots.
  outputs: list[Any] = []
  plans: list[Any] = []
  error = extra = None
  t0 = time.perf_counter()
  try:
    try:
      extra = None if before is None else before(manifest)
    except Exception as e:  # pylint: disable=broad-except
      error = e
    for i, (leaf, t, split) in enumerate(leaves):
      if split is None:
        if error is None:
          try:
            plans.append(("own", restore_lib.restore_leaf(leaf, t, lr_args)))
            continue
          except Exception as e:  # pylint: disable=broad-except
            error = e
        plans.append(("own", None))
        continue
      b, k = batch_of[i]
      pack = packs[b]
      if pack is not None and pack.pieces and b not in flats:
        flats[b] = {d: np.zeros((1, pack.length), np.uint8)
                    for d in pack.devices
                    if d.process_index == jax.process_index()}
      try:
        if pack is not None and i in pack.pieces:
          if error is None:
            _fill(flats[b], leaf, t, split, pack.pieces[i], lr_args)
        else:
          slots[i] = _slots(leaf, t, split, lr_args, read=error is None)
      except Exception as e:  # pylint: disable=broad-except
        error = e
        if pack is None or i not in pack.pieces:
          slots[i] = _slots(leaf, t, split, lr_args, read=False)
      plans.append(("packed", (b, t, leaf, pack.pieces[i]))
                   if pack is not None
                   and i in pack.pieces else ("shared", (b, sum(
                       j not in (pack.pieces if pack else ()) for j in
                       batches[b][:k]))))
      if k == len(batches[b]) - 1:  # The batch is read: share it.
        flat = None
        if pack is not None:
          flat = jax.make_array_from_single_device_arrays(
              (len(pack.devices), pack.length), pack.sharding,
              [jax.device_put(x, d) for d, x in flats.pop(b).items()])
        arrays = [slots.pop(j) for j in batches[b] if j in slots]
        outputs.append(compiling[b].result()(flat, arrays))
        del arrays, flat
  finally:
    reader.close()
  log.debug("%s: read %d bytes in %.2f s (%d batches shared)", where,
            reader.bytes_read, time.perf_counter() - t0, len(batches))
  if error is not None:
    jax.block_until_ready(outputs)  # Every process ran them: none waits.
    raise error
  return extra, (plans, outputs, packs), reader.bytes_read


def _fill(flats: dict[Any, np.ndarray], leaf: Any, t: Any, split: _Split,
          pieces: list, lr_args: dict) -> None:
  """Reads this process's rows of a packed leaf into its devices' slots."""
  del t, split
  lr = LeafReader(leaf=leaf, **lr_args)
  rest = tuple((0, n) for n in leaf.shape[1:])
  mine = [p for p in pieces if p[3] in flats]
  if not mine:
    return
  lo, hi = min(p[4] for p in mine), max(p[5] for p in mine)
  data = peer.as_bytes(lr.read(((lo, hi),) + rest)).reshape(hi - lo, -1)
  for _, offset, n, device, a, b in mine:  # Each read once.
    flats[device][0, offset:offset + n] = data[a - lo:b - lo].reshape(-1)


def _slots(leaf: Any, t: Any, split: _Split, lr_args: dict, *, read: bool
           ) -> jax.Array:
  """This process's slots of a shared leaf (zeros unless `read`)."""
  local = {d: normalize_index(i, leaf.shape) for d, i in
           t.sharding.addressable_devices_indices_map(leaf.shape).items()}
  ranges: dict[Index, tuple[int, int]] = {}  # This process's, per region.
  for device, region in local.items():
    lo, hi = split.parts.get(device, (None, ((0, 0),)))[1][0]
    if hi > lo:
      a, b = ranges.get(region, (lo, hi))
      ranges[region] = (min(a, lo), max(b, hi))
  got = {}
  if read:
    lr = LeafReader(leaf=leaf, **lr_args)
    got = {region: (lo, peer.as_bytes(lr.read(((lo, hi),) + region[1:])))
           for region, (lo, hi) in ranges.items()}  # Each read once.
  blocks = []
  for device, region in local.items():
    dims = tuple(hi - lo for lo, hi in region) + (leaf.dtype.itemsize,)
    block = np.zeros((1, split.rows) + dims[1:], np.uint8)
    lo, hi = split.parts.get(device, (None, ((0, 0),)))[1][0]
    if hi > lo and read:
      first, data = got[region]
      block[0, :hi - lo] = data[lo - first:hi - first]
    blocks.append(jax.device_put(block, device))
  return jax.make_array_from_single_device_arrays(split.shape, split.stacked,
                                                  blocks)


def _runs(index: np.ndarray) -> list[tuple[int, int]]:
  """`index` as [start, stop) ranges of consecutive positions, in order."""
  breaks = np.flatnonzero(np.diff(index) != 1) + 1
  return [(int(run[0]), int(run[-1]) + 1)
          for run in np.split(index, breaks) if len(run)]


def _constrain(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """`x` laid out as `sharding` says, on a mesh of Explicit axes or not."""
  if any(t == jax.sharding.AxisType.Explicit
         for t in getattr(sharding.mesh, "axis_types", ())):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _assemble(stacked: list[jax.Array], how: list) -> list[jax.Array]:
  """Every device's region, from the slots contributed (see `_Split`)."""
  out = []
  for x, (dtype, rows, index, sharding) in zip(stacked, how):
    # The gather itself, said explicitly (the axis of slots no longer
    # sharded), so that it is the same on meshes of Auto or Explicit axes,
    # on which the slicing below would be refused.
    x = _constrain(x, NamedSharding(
        sharding.mesh, PartitionSpec(None, *sharding.spec[1:])))
    slots, regions, rest = x.shape[0], x.shape[1] // rows, x.shape[2:]
    x = jnp.moveaxis(x.reshape((slots, regions, rows) + rest), 1, 0)
    x = x.reshape((regions, slots * rows) + rest)
    # The slots end to end, then the rows in order: static slices, not a
    # gather by index, whose output sharding cannot be inferred on a mesh
    # of Explicit axes (`jax.make_mesh`'s).
    x = jnp.concatenate([x[:, a:b] for a, b in _runs(index)], axis=1)
    u8 = x.reshape((regions * len(index),) + rest)
    out.append(peer.from_bytes(u8, dtype))
  return out


def _run(treedef: Any, plans: tuple[list, list, list], nbytes: int,
         extra: Any) -> tuple[Any, int, Any]:
  """Waits for the programs that `_read` started; the tree."""
  t = time.perf_counter()
  kinds, outputs, _ = plans
  outputs = jax.block_until_ready(outputs)
  log.debug("shared %d batches in %.2f s after the reads", len(outputs),
            time.perf_counter() - t)
  hosts = {b: np.asarray(flat.addressable_shards[0].data)
           for b, (_, flat) in enumerate(outputs) if flat is not None}
  leaves = []
  for kind, value in kinds:
    if kind == "own":
      leaves.append(value)
    elif kind == "shared":
      leaves.append(outputs[value[0]][0][value[1]])
    else:  # Cut out of the gathered slots, on the host.
      b, target, leaf, pieces = value
      host = hosts[b]
      data = np.concatenate([host[k, offset:offset + n]
                             for k, offset, n, *_ in pieces])
      leaves.append(restore_lib.from_host(
          leaf, target, data.view(leaf.dtype).reshape(leaf.shape),
          same_everywhere=True))
  return jax.tree_util.tree_unflatten(treedef, leaves), nbytes, extra
