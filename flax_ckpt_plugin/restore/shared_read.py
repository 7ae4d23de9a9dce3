"""A restore in which storage serves each byte once, whatever the replicas.

When a target array is replicated over several processes (data
parallelism; the replicas of HSDP), every process reading its own copy
pulls the state from storage once per process: 64 hosts, 64 copies of the
egress. Here the processes that need a region split it instead (the plan,
`read_plan`): each reads a contiguous range of its rows, as the save cut
it (checksums verified), and each of its devices holding the region
contributes a slot of that range; small leaves replicated on every device
travel packed, one slot per device. One jitted program per batch of leaves
(`share_program`) gathers the slots, so that every device gets the whole
region. No socket of our own. Only the primary reads the manifest; the others receive it
through the coordinator. Leaves the plan does not take are read by each
process as in `restore.restore_tree`.

Three phases, each agreed on by every process: the primary shares the
manifest; every process plans (nothing that can fail on one process alone
is left after this); every process reads, starting each batch's program
(JAX dispatches it and returns) as soon as the batch is read, so that one
batch's collectives run while the next is read. Every process starts every
program, whatever it meets: one whose file is damaged goes on with zeros
and raises its error once its programs ran, and the agreement that follows
tells all to drop the result (and try an older step), so none waits in a
collective for another. Leaves read alone are placed without a collective
(`placement.from_host`).

Memory: a process holds, per shared region, about its range of the rows
(each local device's slot, padded to the longest slot) besides the result;
for a region read whole by one process, a block of its size per device.
For a batch's packed leaves, every device holds all the slots (padded to
the longest), until the batch's leaves are cut out, and the process one
host copy of them meanwhile.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import jax
import numpy as np

from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.restore import matching
from flax_ckpt_plugin.restore import read_plan
from flax_ckpt_plugin.restore import placement
from flax_ckpt_plugin.restore import share_program
from flax_ckpt_plugin.restore import slots as slots_lib
from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.errors import RestoreFailedError
from flax_ckpt_plugin.errors import Unsuitable
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.restore.data_files import ByteReader
from flax_ckpt_plugin.restore.options import RestoreOptions
from flax_ckpt_plugin.restore.reader import LeafReads
from flax_ckpt_plugin.format.treepaths import leaf_paths
from flax_ckpt_plugin.multihost import keys


# The programs of shared reads are traced and compiled here, one at a time.
_COMPILES = deadlines.Pool(1, "flax_ckpt_plugin-compile")

def restore(meeting: meetings.Meeting, step_dir: Any, read_manifest: Any,
            target: Any, options: RestoreOptions, *, step: int,
            reads_manifest: bool, backend: Any, before: Any = None,
            io_timeout_secs: float = deadlines.IO_TIMEOUT_SECS
            ) -> tuple[Any, int, Any]:
  """Restores `step` from `step_dir` like `target`; see the module doc.

  Called on every process with the same `key`, one no call used before.
  The process with `reads_manifest` (one: the primary) calls
  `read_manifest()` for the raw bytes of the step's manifest (checking
  first that the step is finalized) and shares them through the
  coordinator; the others read no manifest, so storage serves it once.
  `before(manifest)` then runs on every process (the data state's checks).
  Both run inside agreed phases, so that an error on one process is known
  to all. Of the `options` (those of `restore_together`: never `partial`
  nor `missing`): with `cast`, leaves of another dtype than the target's
  are converted (`casting`), each read by every process that needs it;
  with `rename`, the checkpoint's leaves take their target paths first.
  Each read of storage has the deadline `io_timeout_secs`.

  Returns:
    The tree, the bytes this process read, and what `before` returned.

  Raises:
    CheckpointCorruptedError, FileNotFoundError: this process's files.
    StorageTimeoutError: a read of this process's did not return in time.
    CheckpointNotFoundError: the step is not finalized (raised by all).
    errors.Unsuitable: another process found the step damaged, or not
      for it (skip it).
    RestoreFailedError: another process failed otherwise.
    StructureMismatchError: the target does not fit (raised by all).
  """
  with _no_collection():
    return _restore(meeting, step_dir, read_manifest, target, options,
                    step=step, reads_manifest=reads_manifest,
                    backend=backend, before=before,
                    io_timeout_secs=io_timeout_secs)


@contextlib.contextmanager
def _no_collection():
  """Python's cyclic garbage collector paused (if it ran): a full
  collection (about 0.1 s with JAX loaded) in one process delays every
  process at the next agreement or collective."""
  was = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was:
      gc.enable()


def _restore(meeting: meetings.Meeting, step_dir, read_manifest, target,
             options, *, step, reads_manifest, backend, before,
             io_timeout_secs):
  coord = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  where = str(step_dir)
  log.debug("%s: restoring together", where)
  shared = keys.child(key, "manifest")
  own: list[manifest_lib.Manifest] = []

  def share():
    if reads_manifest:
      raw = read_manifest()
      own.append(manifest_lib.of_step(raw, step_dir, step))  # Valid UTF-8.
      meetings.share_text(coord, shared, raw.decode("utf-8"))

  _check(meetings.agree(meeting.under("shared"), share), where,
         primary_reads=True)

  def plan():
    log.debug("%s: manifest shared", where)
    manifest = own[0] if own else manifest_lib.of_step(
        meetings.fetch_text(coord, shared, timeout_ms).encode("utf-8"),
        step_dir, step)
    return (manifest,) + _plan(step_dir, manifest, target, where, options)

  # Whatever can fail on one process alone before the programs start
  # (fetching the manifest) fails in this phase, which starts none.
  outcome = meetings.agree(meeting.under("plan"), plan)
  if reads_manifest:  # Every process has it now: free the service's copy.
    try:
      coord.kv_delete(shared)
    except Exception as e:  # pylint: disable=broad-except
      log.warning("could not delete the shared manifest %s: %s", shared, e)
  _check(outcome, where)
  manifest, treedef, leaves, batches, packs = outcome.result
  outcome = meetings.agree(meeting.under("read"), lambda: _read(
      step_dir, manifest, backend, options, where, leaves, batches, packs,
      before, deadlines.InFlight(io_timeout_secs, where),
      timeout_ms / 1000))
  _check(outcome, where)
  return _run(treedef, *outcome.result)


def _check(outcome: meetings.Outcome, where: str,
           primary_reads: bool = False) -> None:
  """Raises what a phase's failures mean here (see `restore`);
  `primary_reads`: the phase in which only the primary reads (a step it
  finds unfinalized is so for all)."""
  if outcome.error is not None:
    raise outcome.error
  if not outcome.failures:
    return
  text = meetings.describe_failures(outcome.failures)
  kinds = {f[0] for f in outcome.failures.values()}
  if primary_reads and kinds == {"CheckpointNotFoundError"}:
    raise CheckpointNotFoundError(
        "; ".join(m for _, m in outcome.failures.values()))
  # A read that storage did not answer in time: not damage, but that
  # step cannot be had there now (`fallback` keeps it and tries older).
  if kinds & {"CheckpointCorruptedError", "FileNotFoundError",
              "CheckpointNotFoundError", "Unsuitable",
              "StorageTimeoutError"}:
    raise Unsuitable(f"{where} cannot be read on other processes (damaged,"
                     f" or not answered in time): {text}")
  raise RestoreFailedError(f"restoring {where} failed on other processes:"
                           f" {text}")


def _plan(step_dir: Any, manifest: manifest_lib.Manifest, target: Any,
          where: str, options: RestoreOptions
          ) -> tuple[Any, list, list, list]:
  """Matches the target and plans every leaf (see `read_plan`): the same
  on every process, and nothing read yet. A leaf cast to another dtype is
  read alone (`placement.restore_leaf` converts it).

  Returns:
    The target's treedef; per leaf, (record, target, `read_plan.Split` or
    None: read alone); the batches; their packs.
  """
  targets, treedef = leaf_paths(target)
  rename = options.rename
  saved = rename.apply(manifest.leaves)
  pairs = [(p, t) for p, _, t in targets]
  matching.match_structure(
      saved, pairs, step_dir, options,
      explain=lambda: rename.explain(leaf.path for leaf in manifest.leaves))
  for path, _, _ in targets:
    matching.check_key_impl(saved[path], where)
  converted = set(placement.log_casts(where, saved, pairs)
                  if options.cast else ())
  leaves, load, memo = [], {}, {}
  for path, _, t in targets:
    t = placement.on_context_mesh(path, t)
    leaf = saved[path]
    # Read alone: bytes saved big-endian (by an older version), which need
    # a swap on the host, and dtypes JAX holds narrower (int64 without
    # jax_enable_x64), which the program cannot bitcast to. The manifest
    # says so alike on every process.
    split = None if (
        leaf.dtype is None or leaf.dtype.byteorder == ">" or path in converted
        or jax.dtypes.canonicalize_dtype(leaf.dtype) != leaf.dtype) else (
            read_plan.split(t, load, memo))
    leaves.append((leaf, t, split))
  batches = read_plan.batches(leaves)
  return treedef, leaves, batches, [read_plan.pack(leaves, batch)
                                    for batch in batches]


def _read(step_dir: Any, manifest: manifest_lib.Manifest, backend: Any,
          options: RestoreOptions, where: str, leaves: list,
          batches: list[list[int]], packs: list[read_plan.Pack | None],
          before: Any, in_flight: deadlines.InFlight, compile_secs: float
          ) -> tuple[list, list, int, Any]:
  """Runs `before(manifest)`, reads this process's leaves and its parts
  of the shared ones, and starts each batch's program once its parts are
  read, while the next batch is read. The programs are traced and
  compiled on a thread meanwhile, with the caller's `jax_enable_x64` (a
  per-thread setting, as under `jax.enable_x64`), each waited for at most
  `compile_secs` (the others wait as long for this process at the next
  agreement). The reads are recorded in `in_flight`, with its deadline.

  Every process starts every program, whatever happens here: a process
  that fails (a damaged file) goes on with zeros in its slots and raises
  its error once all programs ran, so that no other process waits in a
  collective for it; the agreement (`restore`) then tells all to drop the
  result. Leaves it reads alone are placed without a collective (see
  `placement.from_host`), so skipping them after an error costs no one.

  Returns:
    Per leaf, ("own", its value), ("shared", (batch, position among the
    program's outputs)) or ("packed", (batch, target, record, pieces));
    the programs' outputs; the bytes read; what `before` returned.
  """
  x64 = jax.config.jax_enable_x64
  compiling = [_COMPILES.submit(share_program.compile_batch, leaves, batch,
                                pack, x64)  # In order, on one thread.
               for batch, pack in zip(batches, packs)]
  reader = ByteReader(step_dir, manifest.files, backend, in_flight=in_flight)
  reads = LeafReads(reader=reader, verify=options.verify,
                    block=manifest.checksum_block_bytes, where=where,
                    cast=options.cast)
  batch_of = {i: (b, k) for b, batch in enumerate(batches)
              for k, i in enumerate(batch)}
  slots: dict[int, jax.Array] = {}
  flats: dict[int, dict[Any, np.ndarray]] = {}  # Per batch: packed slots.
  own_outputs: dict[int, int] = {}  # Per batch: its program's outputs.
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
            plans.append(("own", placement.restore_leaf(leaf, t, reads)))
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
            slots_lib.fill(flats[b], leaf, pack.pieces[i], reads)
        else:
          slots[i] = slots_lib.leaf_slots(leaf, t, split, reads,
                                          read=error is None)
      except Exception as e:  # pylint: disable=broad-except
        error = e  # `slots.inputs` gives the leaf zeros.
      if pack is not None and i in pack.pieces:
        plans.append(("packed", (b, t, leaf, pack.pieces[i])))
      else:  # Its place among the program's own outputs.
        plans.append(("shared", (b, own_outputs.get(b, 0))))
        own_outputs[b] = own_outputs.get(b, 0) + 1
      if k == len(batches[b]) - 1:  # The batch is read: share it.
        program = compiling[b].result(timeout=compile_secs)
        try:
          inputs = slots_lib.inputs(leaves, batches[b], pack,
                                    flats.pop(b, None), slots, reads,
                                    zeros=False)
        except Exception as e:  # pylint: disable=broad-except
          error = error or e
          inputs = slots_lib.inputs(leaves, batches[b], pack, None, slots,
                                    reads, zeros=True)
        outputs.append(program(*inputs))
        del inputs
  finally:
    if not in_flight.given_up:  # Else stuck reads may still use the files.
      reader.close()
  log.debug("%s: read %d bytes in %.2f s (%d batches shared)", where,
            reader.bytes_read, time.perf_counter() - t0, len(batches))
  if error is not None:
    jax.block_until_ready(outputs)  # Every process ran them: none waits.
    raise error
  return plans, outputs, reader.bytes_read, extra


def _run(treedef: Any, kinds: list, outputs: list, nbytes: int, extra: Any
         ) -> tuple[Any, int, Any]:
  """Waits for the programs that `_read` started; the tree. The packed
  leaves are cut out of each batch's gathered slots on the host, one batch
  at a time, and placed without a collective (`placement.from_host`)."""
  t = time.perf_counter()
  outputs = jax.block_until_ready(outputs)
  log.debug("shared %d batches in %.2f s after the reads", len(outputs),
            time.perf_counter() - t)
  last = {value[0]: n for n, (kind, value) in enumerate(kinds)
          if kind == "packed"}  # Where each batch's packed slots are done.
  host, leaves = None, []
  for n, (kind, value) in enumerate(kinds):
    if kind == "own":
      leaves.append(value)
    elif kind == "shared":
      leaves.append(outputs[value[0]][0][value[1]])
    else:  # Cut out of the gathered slots, on the host.
      b, target, leaf, pieces = value
      if host is None or host[0] != b:
        flat = outputs[b][1]
        host = (b, np.asarray(flat.addressable_shards[0].data)
                if flat.addressable_shards else None)
      if host[1] is None:  # No device of this process in the mesh.
        data = np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
      else:
        data = np.concatenate([host[1][k, offset:offset + size]
                               for k, offset, size, *_ in pieces]).view(
                                   leaf.dtype).reshape(leaf.shape)
      leaves.append(placement.from_host(leaf, target, data))
      if last[b] == n:  # Free the batch's slots, here and on the devices.
        host, outputs[b] = None, (outputs[b][0], None)
  return jax.tree_util.tree_unflatten(treedef, leaves), nbytes, extra
