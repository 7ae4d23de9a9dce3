"""Restoring a step from the local tiers of peers, over JAX collectives.

A process that lacks a step in its local tier (a replaced host, a wiped
disk) gets what it needs from the processes that hold it, when they hold
replicas of its shards (data parallelism). No socket of our own: the bytes
move in one jitted program, as all-reduces over the target's own mesh.

For an array whose target sharding is a `NamedSharding`, each distinct
shard has a *source*: the first device, in the sharding's device order,
of a process that holds the step. Every device contributes a block of a
stacked array, `[replicas, *shape, itemsize]` bytes over the mesh axes the
array is replicated on: its shard's bytes on a source device, zeros
elsewhere. Summing the bytes over the replica axis then gives every device
its shard, bit for bit (one term is not zero), and a bitcast gives the
values back. Every other leaf (host values, PRNG keys, other shardings,
dtypes that XLA does not bitcast) travels as bytes in one buffer that the
lowest holder fills and every device receives.

Three phases, each agreed on by every process (`meetings.agree`), so
that a failure is known everywhere before anyone enters a collective: the
lowest holder shares its manifest through the key-value store; every
process checks it against the target and the holders read the bytes they
send (checksums verified); then all run the program.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, TYPE_CHECKING

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from flax_ckpt_plugin.multihost import meetings
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.restore import matching
from flax_ckpt_plugin.restore import replicas as replicas_lib
from flax_ckpt_plugin.restore import placement
from flax_ckpt_plugin.errors import CheckpointNotFoundError
from flax_ckpt_plugin.restore.data_files import ByteReader
from flax_ckpt_plugin.restore.reader import LeafReader
from flax_ckpt_plugin.arrays.copies import bits_dtype
from flax_ckpt_plugin.format.treepaths import leaf_paths
from flax_ckpt_plugin.format.treepaths import normalize_index
from flax_ckpt_plugin.multihost import keys

if TYPE_CHECKING:
  from flax_ckpt_plugin.backends import interface


def agree_all(meeting: meetings.Meeting, fn, where: str) -> Any:
  """`meetings.agree`; all raise together, this process its own error
  (also `rebuild`'s phases)."""
  outcome = meetings.agree(meeting, fn)
  if outcome.error is not None:
    raise outcome.error
  if outcome.failures:
    raise CheckpointNotFoundError(
        f"{where}: not restored from peers, since other processes failed:"
        f" {meetings.describe_failures(outcome.failures)}")
  return outcome.result


class _Stacked(NamedTuple):
  """How one `NamedSharding` leaf travels."""
  path: str
  sharding: NamedSharding  # The target's.
  stacked: NamedSharding  # Of the [replicas, *shape, itemsize] bytes.
  replicas: int
  sources: dict[Any, tuple[tuple[int, int], ...]]  # Source device: region.


def _stacked(path: str, leaf: manifest_lib.LeafRecord, sharding: Any,
             holders: set[int]) -> _Stacked | None:
  """The plan of a leaf that travels stacked, None if it cannot."""
  if (not isinstance(sharding, NamedSharding) or leaf.key_impl is not None
      or (leaf.dtype != np.bool_ and bits_dtype(leaf.dtype) is None)):
    return None
  _, stacked, replicas = replicas_lib.replica_axes(sharding, len(leaf.shape))
  sources: dict[Any, Any] = {}
  found: set[Any] = set()
  for device, index in sharding.devices_indices_map(leaf.shape).items():
    region = normalize_index(index, leaf.shape)
    if region not in found and device.process_index in holders:
      found.add(region)
      sources[device] = region
  regions = {normalize_index(i, leaf.shape) for i in
             sharding.devices_indices_map(leaf.shape).values()}
  if regions - found:
    raise CheckpointNotFoundError(
        f"leaf {path!r}: no process that holds the step has a copy of"
        f" region {[list(r) for r in sorted(regions - found)[0]]}")
  return _Stacked(path, sharding, stacked, replicas, sources)


def _sum_of_bytes(stacked: list[jax.Array], flat: jax.Array | None,
                  dtypes: tuple[np.dtype, ...]):
  """Every device's shard from the one source that sent it (a sum over the
  replicas with one nonzero term), and the flat buffer everywhere."""
  out = [replicas_lib.from_bytes(x.sum(axis=0, dtype=np.uint8), d)
         for x, d in zip(stacked, dtypes)]
  return out, None if flat is None else flat.sum(axis=0, dtype=np.uint8)


def restore(meeting: meetings.Meeting, step: int, holders: list[int],
            local: Any, target: Any, *, devices: list[Any] | None = None
            ) -> tuple[Any, Any]:
  """Restores `step` like `target`, from the local tiers of `holders`.

  Called on every process; see the module doc.

  Args:
    coord: the job's coordinator.
    key: a prefix of keys no earlier call used (same on every process).
    step: the step.
    holders: the processes whose local tier holds it (sorted).
    local: this process's local tier (`local_tier.LocalTier`).
    target: what to restore into, as for `CheckpointManager.restore`.
    timeout_ms: how long to wait for the others at each phase.
    devices: the devices that receive the leaves that travel whole, in
      order (all by default; `elastic` gives the group's new order).

  Returns:
    The restored tree, and the step's `extra`.

  Raises:
    CheckpointNotFoundError: the holders do not hold every shard (no
      replica of a lacking process's shard), or a phase failed somewhere.
    StructureMismatchError: the step does not fit the target.
  """
  coord = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  me, source = coord.process_index, holders[0]
  holding = me in holders
  where = f"step {step} from the local tiers of processes {holders}"
  step_dir = local.directory / str(step)
  backend = local.manager.backend

  def share():
    if me == source:
      meetings.share_text(coord, keys.child(key, "manifest"),
                        local_read(step_dir, backend).decode("utf-8"))

  agree_all(meeting.under("shared"), share, where)

  def prepare(storage: interface.Backend):
    saved = manifest_lib.parse(meetings.fetch_text(
        coord, keys.child(key, "manifest"), timeout_ms).encode("utf-8"), where)
    return _prepare(saved, target, step_dir if holding else None, storage,
                    me == source, set(holders), where,
                    devices or jax.devices())

  # The newest local step that this process saved comes from the snapshot
  # it still holds (`CheckpointManager.read_step`), not from its disk.
  prepared = agree_all(meeting.under("read"),
                       lambda: local.manager.read_step(step, prepare), where)
  return _run(*prepared)


def local_read(step_dir: Any, backend: interface.Backend) -> bytes:
  """The raw manifest of a local step (bounded, as every read of one)."""
  return backend.read_small(
      step_dir / manifest_lib.MANIFEST, within=step_dir,
      limit=manifest_lib.MAX_MANIFEST_BYTES)


def _prepare(saved: manifest_lib.Manifest, target: Any, step_dir: Any,
             backend: interface.Backend, is_source: bool,
             holders: set[int], where: str, devices: list[Any]):
  """Checks the target, plans every leaf, reads the bytes this process
  sends, and builds and compiles the program, so that anything that can
  fail here fails before any process enters a collective. Returns the
  arguments of `_run`."""
  targets, treedef = leaf_paths(target)
  records = saved.leaf_by_path
  matching.match_structure(records, [(p, t) for p, _, t in targets],
                              where)
  targets = [(p, placement.on_context_mesh(p, t)) for p, _, t in targets]
  mine = None
  if step_dir is not None:  # The bytes come from this process's own copy.
    mine = manifest_lib.read(step_dir, saved.step, backend)
    reader = ByteReader(step_dir, mine.files, backend)
  own = mine.leaf_by_path if mine is not None else {}

  def leaf_reader(path: str) -> LeafReader:
    if path not in own:
      raise CheckpointNotFoundError(f"{where}: leaf {path!r} is not in"
                                    f" {step_dir}")
    return LeafReader(reader=reader, leaf=own[path], where=where,
                      verify=True, block=mine.checksum_block_bytes)

  plans, flat, flat_parts = [], [], []
  try:
    for path, t in targets:
      leaf = records[path]
      if leaf.is_scalar:
        plans.append(("scalar", leaf, t))
        continue
      plan = (_stacked(path, leaf, t.sharding, holders)
              if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) else None)
      if plan is None:  # Whole, in the flat buffer, from the source.
        nbytes = leaf.nbytes
        if is_source:
          flat.append(replicas_lib.as_bytes(leaf_reader(path).read(
              tuple((0, d) for d in leaf.shape))).reshape(-1))
        flat_parts.append(nbytes)
        plans.append(("flat", leaf, t))
        continue
      blocks = []
      for device, index in t.sharding.addressable_devices_indices_map(
          leaf.shape).items():
        region = normalize_index(index, leaf.shape)
        shape = (1,) + tuple(hi - lo for lo, hi in region) + (
            leaf.dtype.itemsize,)
        if device in plan.sources:
          block = replicas_lib.as_bytes(leaf_reader(path).read(region))[None]
        else:
          block = np.zeros(shape, np.uint8)
        blocks.append(jax.device_put(block, device))
      plans.append(("stacked", leaf, plan, t, blocks))
  finally:
    if mine is not None:
      reader.close()
  return (treedef, plans,
          *_program(plans, flat, sum(flat_parts), devices), saved.extra)


def _program(plans: list[tuple], flat: list[np.ndarray], flat_bytes: int,
             devices: list[Any]) -> tuple[Any, tuple[Any, Any]]:
  """The compiled gather, and its inputs."""
  stacked = [p for p in plans if p[0] == "stacked"]
  arrays = [jax.make_array_from_single_device_arrays(
      (plan.replicas,) + leaf.shape + (leaf.dtype.itemsize,), plan.stacked,
      blocks) for _, leaf, plan, _, blocks in stacked]
  flat_in, flat_out_sharding = None, None
  if flat_bytes:
    devices = np.array(devices)
    mesh = jax.sharding.Mesh(devices, ("all",))
    sharding = NamedSharding(mesh, PartitionSpec("all", None))
    flat_out_sharding = NamedSharding(mesh, PartitionSpec())
    first = jax.local_devices()[0]
    data = np.concatenate(flat) if flat else None
    pieces = [jax.device_put(
        (data if data is not None and d == first
         else np.zeros(flat_bytes, np.uint8))[None], d)
              for d in sharding.addressable_devices]
    flat_in = jax.make_array_from_single_device_arrays(
        (len(devices), flat_bytes), sharding, pieces)
  dtypes = tuple(leaf.dtype for _, leaf, *_ in stacked)
  gather = jax.jit(
      functools.partial(_sum_of_bytes, dtypes=dtypes),
      out_shardings=([plan.sharding for _, _, plan, *_ in stacked],
                     flat_out_sharding))
  return gather.lower(arrays, flat_in).compile(), (arrays, flat_in)


def _run(treedef: Any, plans: list[tuple], compiled: Any,
         inputs: tuple[Any, Any], extra: Any) -> tuple[Any, Any]:
  """The collective part: every process, the same program."""
  out, flat_out = compiled(*inputs)
  del inputs
  host = None if flat_out is None else np.asarray(
      flat_out.addressable_shards[0].data)
  leaves, gathered, offset = [], iter(out), 0
  for kind, leaf, *rest in plans:
    if kind == "stacked":
      leaves.append(next(gathered))
    elif kind == "scalar":
      leaves.append(placement.restore_leaf(leaf, rest[0], None))
    else:
      value = host[offset:offset + leaf.nbytes].view(leaf.dtype).reshape(
          leaf.shape)
      offset += leaf.nbytes
      leaves.append(placement.from_host(leaf, rest[0], value.copy()))
  return jax.tree_util.tree_unflatten(treedef, leaves), extra
