"""Partner copies on the move: a state's shards sent to partner processes by
XLA's collective permute.

At a local-tier save with `FaultTolerance(replicas=r)`, every shard that
fewer than r + 1 processes hold goes to partners (`partners`: the plan).
`Exchange.send` does it on the devices, with JAX's own collectives (no
socket of ours): one jitted program in which, for each leaf that has
copies to make, a `shard_map` over the leaf's own mesh runs one
`jax.lax.ppermute` per step of the plan, from the device of a holder
that has the shard to a device of its partner (device j of the sender to
device j of the receiver). What arrives stays on the receiving device,
one block per step, and is handed to the local tier's save as more shards
of the same leaves (`ShardData`, the copy to the host started): the
receiver's local step holds them, and is final only once they are
durable with the rest (a step is never counted as recoverable from
partners before the partners hold it).

Two hazards, and how the design avoids them:
- Interleaving. A collective issued from a background thread can run
  before the train step's collectives on one process and after them on
  another (a deadlock, or wrong data). `send` is called from the loop's
  thread, inside the callback's save call, at the same step on every
  process: its program is queued between the same two train steps
  everywhere, and only the copies to the host and the writes happen in the
  background.
- Device memory. The copies received stay on the device until the local
  tier's writer has them on the host: per device, one block of each leaf
  that has copies per step of the plan that sends it one (with FSDP and a
  process per host: `replicas` blocks, so `replicas` times the device's
  share of those leaves), and the same again while the program runs. A
  model that cannot spare that needs `replicas=0`.

The plan is the same on every process (it follows from the shardings and
the processes' failure domains alone), worked out and compiled once per
layout of the state.
"""

from __future__ import annotations

import functools
import inspect
import socket
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from flax_ckpt_plugin.format.treepaths import leaf_paths
from flax_ckpt_plugin.format.treepaths import normalize_index
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.save.leaves import ShardData
from flax_ckpt_plugin.tolerance import partners


class _Leaf(NamedTuple):
  """How one leaf's copies travel."""
  at: int  # Its place among the state's leaves.
  path: str
  sharding: NamedSharding
  # Per step of the plan that moves some of its shards: the (source,
  # destination) positions in the mesh's flat device order.
  pairs: tuple[tuple[tuple[int, int], ...], ...]
  # Per step: what this process receives, (output row, region).
  mine: tuple[tuple[tuple[int, Any], ...], ...]


def _shard_map():
  """`jax.shard_map` where this JAX has it; its older home otherwise."""
  found = getattr(jax, "shard_map", None)
  if found is None:
    from jax.experimental.shard_map import shard_map as found  # pylint: disable=g-import-not-at-top
  return found


# The blocks received differ from device to device whatever the input's
# spec says: unchecked (the flag's name depends on JAX's version).
_UNCHECKED = {("check_vma" if "check_vma" in inspect.signature(
    _shard_map()).parameters else "check_rep"): False}


def _even(leaf: jax.Array, sharding: NamedSharding) -> bool:
  """Whether every shard of `leaf` has the same shape (`shard_map` needs
  it)."""
  for dim, names in zip(leaf.shape, sharding.spec):
    if names is None:
      continue
    names = names if isinstance(names, tuple) else (names,)
    size = 1
    for n in names:
      size *= sharding.mesh.shape[n]
    if dim % size:
      return False
  return True


def _is_array(x: Any) -> bool:
  """A global array, or its abstract value (`prepare`)."""
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and isinstance(
      getattr(x, "sharding", None), jax.sharding.Sharding)


def plan_leaf(at: int, path: str, leaf: jax.Array, ring: partners.Ring,
              members: tuple[int, ...], replicas: int, me: int
              ) -> _Leaf | None:
  """The copies of one leaf's shards; None if it needs none.

  `members`: the processes of the ring, in its order of indices (the
  ring's process i is process `members[i]`)."""
  sharding = leaf.sharding
  flat = list(sharding.mesh.devices.flat)
  position = {d: i for i, d in enumerate(flat)}
  rank = {p: i for i, p in enumerate(members)}
  local_rank: dict[Any, int] = {}
  by_process: dict[int, list[Any]] = {}
  for d in flat:
    by_process.setdefault(d.process_index, []).append(d)
  for devices in by_process.values():
    for j, d in enumerate(devices):
      local_rank[d] = j
  holders: dict[Any, list[Any]] = {}  # Region: its devices, in mesh order.
  for device, index in sharding.devices_indices_map(leaf.shape).items():
    holders.setdefault(normalize_index(index, leaf.shape), []).append(device)
  steps: dict[int, list[tuple[int, int]]] = {}
  mine: dict[int, list[tuple[int, Any]]] = {}
  for region, devices in holders.items():
    devices = sorted(devices, key=position.__getitem__)
    held = tuple(sorted({rank[d.process_index] for d in devices}))
    for c in ring.copies(held, replicas):
      sender = members[c.sender]
      source = next(d for d in devices if d.process_index == sender)
      j = local_rank[source]
      dest = by_process[members[c.receiver]][j]
      steps.setdefault(c.step, []).append((position[source], position[dest]))
      if dest.process_index == me:
        mine.setdefault(c.step, []).append((position[dest], region))
  if not steps:
    return None
  order = sorted(steps)
  return _Leaf(at, path, sharding, tuple(tuple(steps[s]) for s in order),
               tuple(tuple(mine.get(s, ())) for s in order))


def _program(layout: tuple[tuple[NamedSharding, tuple], ...]):
  """One jitted program over one mesh: per leaf, its blocks permuted once
  per step, each step's blocks stacked over the mesh's devices."""
  shard_map = _shard_map()

  def moved(sharding: NamedSharding, pairs: tuple):
    axes = tuple(sharding.mesh.axis_names)

    def body(block):
      return tuple(jax.lax.ppermute(block, axes, list(p))[None]
                   for p in pairs)

    return shard_map(body, mesh=sharding.mesh, in_specs=sharding.spec,
                     out_specs=tuple(PartitionSpec(axes) for _ in pairs),
                     **_UNCHECKED)

  fns = [moved(s, p) for s, p in layout]

  def run(*leaves):
    return tuple(f(x) for f, x in zip(fns, leaves))

  return jax.jit(run)


def share_domains(coord: Any, job: str, domain: str | None,
                  timeout_ms: int) -> dict[int, str]:
  """Every process's failure domain, by process index: each process sets
  its own (`domain`, or its host's name) in the key-value store, and reads
  all of them after a barrier. Called by every process together."""
  key = f"flax_ckpt_plugin/{job}/domains"
  coord.kv_set(keys.of_process(key, coord.process_index),
               domain if domain is not None else socket.gethostname())
  coord.barrier(keys.fresh(coord, key), timeout_ms=timeout_ms)
  return keys.by_index(coord.kv_dir(key))


class Exchange:
  """The partner copies of a callback's local tier; see the module doc.

  Args:
    domains: each process's failure domain, by process index
      (`share_domains`).
    replicas: see `FaultTolerance.replicas`.
  """

  def __init__(self, domains: dict[int, str], replicas: int):
    self.domains, self.replicas = dict(domains), replicas
    self._plans: dict[Any, tuple[_Leaf, ...]] = {}
    self._compiled: dict[Any, Any] = {}
    self._warned: set[str] = set()

  @functools.lru_cache(maxsize=8)
  def ring(self, members: tuple[int, ...]) -> partners.Ring:
    """The ring of `members` (the processes a state is on)."""
    return partners.Ring([self.domains.get(p, f"process {p}")
                          for p in members])

  def _plan(self, state: Any) -> tuple[list[Any], tuple[_Leaf, ...]]:
    named, _ = leaf_paths(state)
    leaves = [(path, x) for path, _, x in named]
    key = tuple((path, x.shape, x.dtype, x.sharding) if _is_array(x)
                else (path, type(x)) for path, x in leaves)
    found = self._plans.get(key)
    if found is None:
      found = self._plans[key] = self._make(leaves)
      if len(self._plans) > 8:  # A layout that changes at every save.
        self._plans.pop(next(iter(self._plans)))
    return [x for _, x in leaves], found

  def _make(self, leaves: list[tuple[str, Any]]) -> tuple[_Leaf, ...]:
    members = tuple(sorted({d.process_index for _, x in leaves
                            if _is_array(x) for d in x.sharding.device_set}))
    if len(members) < 2:
      return ()
    ring, me = self.ring(members), jax.process_index()
    out, left = [], []
    for at, (path, x) in enumerate(leaves):
      if not _is_array(x) or x.sharding.is_fully_addressable:
        continue  # Host values, and a process's own arrays: held by it.
      if (not isinstance(x.sharding, NamedSharding)
          or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
          or not _even(x, x.sharding)):
        left.append(path)
        continue
      plan = plan_leaf(at, path, x, ring, members, self.replicas, me)
      if plan is not None:
        out.append(plan)
    fresh = [p for p in left if p not in self._warned]
    if fresh:
      self._warned.update(fresh)
      log.error("no partner copies of %d leaves (%s): only evenly divided"
                " leaves with a NamedSharding and no PRNG key dtype travel;"
                " a loss of their only holder ends in a restart from the"
                " persistent tier", len(fresh), ", ".join(fresh[:5]))
    return tuple(out)

  def _by_mesh(self, plan: tuple[_Leaf, ...], values: list[Any]
               ) -> list[tuple[list[_Leaf], Any]]:
    """The plan's leaves by mesh, in the order the tree first names the
    meshes (the same on every process), each mesh's compiled program (jit
    takes one device order per program)."""
    meshes: dict[Any, list[_Leaf]] = {}
    for p in plan:
      meshes.setdefault(p.sharding.mesh, []).append(p)
    out = []
    for leaves in meshes.values():
      layout = tuple((p.sharding, p.pairs) for p in leaves)
      compiled = self._compiled.get(layout)
      if compiled is None:
        compiled = _program(layout).lower(*[
            jax.ShapeDtypeStruct(values[p.at].shape, values[p.at].dtype,
                                 sharding=p.sharding)
            for p in leaves]).compile()
        self._compiled[layout] = compiled
        if len(self._compiled) > 8:
          self._compiled.pop(next(iter(self._compiled)))
      out.append((leaves, compiled))
    return out

  def prepare(self, state: Any) -> None:
    """Works out the plan of `state` (concrete or abstract) and compiles
    its programs, so that the first save only dispatches them."""
    values, plan = self._plan(state)
    self._by_mesh(plan, values)

  def send(self, state: Any) -> dict[str, list[ShardData]]:
    """Sends every partner copy of `state`'s shards; returns, per leaf
    path, the shards this process receives, their copies to the host
    started. Called by every process of the state at the same point of
    the loop (see the module doc); does not wait for the transfers."""
    values, plan = self._plan(state)
    if not plan:
      return {}
    moved, order = [], []
    for leaves, compiled in self._by_mesh(plan, values):
      moved.extend(compiled(*[values[p.at] for p in leaves]))
      order.extend(leaves)
    plan = order
    out: dict[str, list[ShardData]] = {}
    for p, outputs in zip(plan, moved):
      for step_mine, array in zip(p.mine, outputs):
        if not step_mine:
          continue
        on = {s.device: s.data for s in array.addressable_shards}
        flat = list(p.sharding.mesh.devices.flat)
        for position, region in step_mine:
          data = on[flat[position]]
          data.copy_to_host_async()
          out.setdefault(p.path, []).append(
              ShardData(region, data, np.dtype(array.dtype)))
    return out
