"""A consistent host copy of a pytree: the only blocking part of a save.

Each process keeps only the parts it writes of every global `jax.Array`:
its share of the shards it holds, as `division` spreads them over the
processes that hold them (every byte once). Host-local values (numpy
arrays and Python scalars, and `jax.Array`s that are fully addressable
while several processes run) are the same on every process by contract, so
only the primary host writes their bytes.

The snapshot stays correct when the next train step donates the state's
buffers, because it never refers to them once the runtime has run what
`take_snapshot` enqueued:

* On accelerators with pinned host memory every shard is copied there in
  one batched call that is not awaited (see `pinned`); the writer waits
  for each shard before writing it. A shard whose pinned memory is not
  pinned yet (`PinnedStaging.choose`) is copied on its device instead,
  not awaited either, and the commit moves the copy to the host. Elsewhere
  off the CPU, every shard's
  `copy_to_host_async()` is started before the first one is awaited.
* On the CPU backend every shard is copied into reused staging buffers by
  a program the runtime runs before the next step that donates the state
  (large shards one for one, small ones packed together: see `staging`);
  `take_snapshot` does not wait for the copy.

Which way each piece goes depends on the tree's layout alone, and is
worked out at its first save (`routes`); a later save only gathers the
leaves' arrays and starts the copies. The records of the snapshot
(`leaves.LeafSnapshot`, `leaves.ShardData`) are made from the copies
when the commit
first reads them (`Snapshot`), on its own thread: their cost grows with
the count of leaves (with 1500 leaves, several times the rest of the save
call), and the loop does not wait for it.

Why not keep numpy views of the state's own buffers, which costs nothing?
A view pins the buffer, so the next step's donation is declined and that
step copies its whole input into newly allocated (so newly page-faulted)
memory: measured with a 0.98 GB state on 2 cores, the step after a save took
0.6-1.2 s longer. The enqueued copy costs the loop about 0.1 s per GB.
"""


from __future__ import annotations

import collections.abc
import functools
import threading
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from flax_ckpt_plugin.arrays import copies
from flax_ckpt_plugin.save import pieces as pieces_lib
from flax_ckpt_plugin.save.leaves import host_leaf
from flax_ckpt_plugin.save.leaves import LeafSnapshot
from flax_ckpt_plugin.save.leaves import ShardData
from flax_ckpt_plugin.save.pinned_staging import PinnedStaging
from flax_ckpt_plugin.save.pinned_staging import Size
from flax_ckpt_plugin.save import routes as routes_lib
from flax_ckpt_plugin.format.records import CHECKSUM_BLOCK
from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.save.staging import HostStaging


class Copy(NamedTuple):
  """A piece's copy, as the save call started it: what its `ShardData` is
  made of (the piece's index comes from its `PieceSpec`).

  Attributes:
    data: the copy: a host array, or a copy still being made (see
      `ShardData.data`).
    dtype: the values' dtype where `data` is not a host array (a
      `jax.Array` or a `copies.Packed`, which may hold the values' bits as
      unsigned integers); None for a host array.
    checksums: the CRC-32C of each `records.CHECKSUM_BLOCK` bytes, where
      the copy took them (`HostStaging.copy_summed`); else None.
  """
  data: Any
  dtype: np.dtype | None
  checksums: list[int] | None


def prepare(tree: Any, *, process_count: int, is_primary: bool,
            staging: HostStaging, own_copy: bool = False,
            pinned_staging: PinnedStaging | None = None
            ) -> list[Size]:
  """Queues the compiles of the programs that a save of `tree` copies its
  CPU shards with (see `copies.groups`: its first save then finds them
  ready, instead of having the runtime copy every shard), and returns the
  device and bytes of each piece that it copies onto pinned host memory
  (see `PinnedStaging.reserve`). Does not wait."""
  plan = pieces_lib.plan(tree, process_count, is_primary, own_copy)
  routes = routes_lib.of(plan, staging, pinned_staging)
  for group in routes.groups:
    copies.programs_of(group.key)
  return list(routes.pinned_sizes)


class Snapshot(collections.abc.Sequence):
  """One save's snapshot on this process: a `LeafSnapshot` per leaf, in
  flattening order, on every process (so every process knows the whole
  tree's metadata).

  The save call only starts the copies; the records are made from them
  when first read, by the commit, so that the call pays nothing per leaf
  for them.
  """

  def __init__(self, layout: pieces_lib.Layout, routes: routes_lib.Routes,
               made: list[Copy | None], copied: list[Any],
               host: dict[int, LeafSnapshot], *,
               pinned_fallback_bytes: int = 0, unpinned_bytes: int = 0,
               partner_shards: dict[str, list[ShardData]] | None = None):
    """`made[n]`: the `Copy` of piece n, or None for those
    `routes.programs` copied, in that order, into `copied`.
    `pinned_fallback_bytes`: what went the plain way, pinned memory
    refused (`SaveStats.pinned_fallback_bytes`); `unpinned_bytes`, what
    went that way, its pinned memory not ready (`SaveStats.unpinned_bytes`).
    `partner_shards`: see `take_snapshot`."""
    self.pinned_fallback_bytes = pinned_fallback_bytes
    self.unpinned_bytes = unpinned_bytes
    self._layout, self._routes = layout, routes
    self._made, self._copied, self._host = made, copied, host
    self._partner_shards = partner_shards or {}
    self._records: list[LeafSnapshot] | None = None
    self._lock = threading.Lock()

  def _all(self) -> list[LeafSnapshot]:
    with self._lock:
      if self._records is None:
        self._records = self._make()
        self._made = self._copied = []
      return self._records

  def _make(self) -> list[LeafSnapshot]:
    leaves, first = self._layout.leaves, self._routes.first
    for w, copy in zip(self._routes.programs, self._copied):
      self._made[first[w.leaf] + w.piece] = Copy(copy, leaves[w.leaf].dtype,
                                                 None)
    out = []
    for i, lay in enumerate(self._layout.leaves):
      if lay is None:
        out.append(self._host[i])
        continue
      at = self._routes.first[i]
      shards = []
      for spec, made in zip(lay.specs, self._made[at:at + len(lay.specs)]):
        shards.append(ShardData(spec.index, made.data, made.dtype,
                                made.checksums))
      shards.extend(self._partner_shards.get(lay.path, ()))
      out.append(LeafSnapshot(lay.path, lay.keys, "array",
                              _dtype_name(lay.dtype), lay.shape, shards,
                              key_impl=lay.impl))
    return out

  def __getitem__(self, i):
    return self._all()[i]

  def __iter__(self):
    return iter(self._all())

  def __len__(self) -> int:
    return len(self._layout.leaves)


def take_snapshot(tree: Any, *, process_count: int, is_primary: bool,
                  staging: HostStaging, own_copy: bool = False,
                  pinned_staging: PinnedStaging | None = None,
                  partner_shards: Callable[[], dict[str, list[ShardData]]]
                  | None = None) -> Snapshot:
  """Starts copying the shards this process writes to host memory.

  Args:
    tree: the state to save (e.g. a Flax `TrainState`).
    process_count: number of JAX processes.
    is_primary: whether this process writes host-local values.
    staging: the buffers CPU shards are copied into (reused by the next
      call, so the previous snapshot must no longer be in use).
    own_copy: take every distinct shard this process holds, replicas
      included (a copy that restores this process alone: the local tier).
    pinned_staging: where shards of devices with pinned host memory go
      (see `pinned`); None: the plain transfer.
    partner_shards: gives more shards of the tree's leaves, by path,
      that this process holds for other processes (`tolerance.exchange`:
      the local tier's partner copies), written with its own; called once
      this process's own copies have started, last.

  Returns:
    The snapshot: one `LeafSnapshot` per leaf, in flattening order.

  Raises:
    ValueError: an array leaf was deleted (donated before the call).
    TypeError: a leaf's type or dtype cannot be saved.
  """
  plan = pieces_lib.plan(tree, process_count, is_primary, own_copy)
  layout = plan.layout
  host = {i: host_leaf(*layout.names[i], plan.values[i], is_primary)
          for i in layout.host}
  routes = routes_lib.of(plan, staging, pinned_staging)
  # What each piece's ShardData is made of, filled in by the steps below.
  made: list[Copy | None] = [None] * routes.count
  fallback_bytes, unpinned_bytes = (
      _start_pinned(plan, routes, pinned_staging, made) if routes.pinned
      else (0, 0))
  arrays = routes.arrays(plan)
  # Off the CPU, the rest: every device-to-host transfer is started before
  # the first is waited for.
  for data in arrays.transfers:
    data.copy_to_host_async()
  _take_cpu_shards(plan.layout, routes, arrays, staging, made)
  first = routes.first
  for w, data in zip(routes.transfers, arrays.transfers):
    made[first[w.leaf] + w.piece] = Copy(_c_order(np.asarray(data)), None,
                                         None)
  # The staging copies last: the runtime's threads start copying at once,
  # on every core, and the call should be over by then; all that is left
  # to do after them is worked out before.
  copied = staging.copy_on_devices(
      arrays.programs, groups=routes.groups) if routes.programs else []
  return Snapshot(layout, routes, made, copied, host,
                  pinned_fallback_bytes=fallback_bytes,
                  unpinned_bytes=unpinned_bytes,
                  partner_shards=partner_shards and partner_shards())


def _start_pinned(plan: pieces_lib.Plan, routes: routes_lib.Routes,
                  pinned_staging: PinnedStaging, made: list[Copy | None]
                  ) -> tuple[int, int]:
  """Starts the copies of the pieces routed onto pinned host memory: one
  batched call, not awaited (see `pinned`); the pieces whose pinned memory
  is not ready are copied on their devices instead. Puts each piece's
  `Copy` in `made`.

  Returns:
    The bytes that went the plain way because pinning was refused, and
    those whose pinned memory was not ready yet.
  """
  layout = plan.layout
  srcs = routes.pinned_arrays(plan)
  now = pinned_staging.choose(routes.pinned_sizes)
  go = [k for k, ok in enumerate(now or ()) if ok]
  copied = pinned_staging.copy([srcs[k] for k in go]) if go else []
  fallback_bytes = 0
  if now is None or copied is None:  # Refused, now or lately.
    fallback_bytes = sum(srcs[k].nbytes for k in (
        go if now is not None else range(len(srcs))))
    go, copied = [], []
  rest = sorted(set(range(len(srcs))) - set(go))
  unpinned_bytes = sum(srcs[k].nbytes for k in rest) - fallback_bytes
  rest_copies = _on_devices(
      [srcs[k] for k in rest],
      [routes.pinned[k].rows is not None for k in rest])
  for k, copy in [*zip(go, copied), *zip(rest, rest_copies)]:
    w = routes.pinned[k]
    made[routes.first[w.leaf] + w.piece] = Copy(
        copy, layout.leaves[w.leaf].dtype, None)
  return fallback_bytes, unpinned_bytes


def _take_cpu_shards(layout: pieces_lib.Layout, routes: routes_lib.Routes,
                     arrays: routes_lib.Arrays, staging: HostStaging,
                     made: list[Copy | None]) -> None:
  """Takes the CPU shards that are not copied on their devices; puts each
  piece's `Copy` in `made`.

  A part of a shard is cut by a slice into memory of its own
  (`arrays.cuts`), which the writer waits for; dtypes that cannot travel
  as unsigned bits, and every dtype where the staging memory is an arena
  (`memfile`), are copied by threads from views of the runtime's buffers
  right here (the rest go on their devices, last: `take_snapshot`).
  """
  first = routes.first
  for w, data in zip(routes.cuts, arrays.cuts):
    made[first[w.leaf] + w.piece] = Copy(data, layout.leaves[w.leaf].dtype,
                                         None)
  if not routes.threads:
    return
  srcs = [np.asarray(shard) for shard in arrays.threads]
  summed = None if staging.arena is None else staging.copy_summed(
      srcs, CHECKSUM_BLOCK)
  if summed is None:
    keys = [(layout.leaves[w.leaf].path, w.spec(layout).index)
            for w in routes.threads]
    for w, copy in zip(routes.threads, staging.copy(list(zip(keys, srcs)))):
      made[first[w.leaf] + w.piece] = Copy(copy, None, None)
  else:
    for w, copy, sums in zip(routes.threads, *summed):
      made[first[w.leaf] + w.piece] = Copy(copy, None, sums)
  # No view of a runtime buffer outlives this call, nor the objects that
  # numpy's views are cached on.
  del srcs
  arrays.threads.clear()


def _on_devices(srcs: list[jax.Array], cut: list[bool]) -> list[Any]:
  """A copy of each single-device array in new memory on its device (the
  runtime's copy, not awaited: the commit moves it to the host), except
  those `cut` (a slice made them in memory of their own already). A copy
  lives until the commit ends, so a device takes only as many as fit
  beside the most it has held so far (`_room`: the train step's peak);
  the rest, and all of them where the copies fail, the call copies to the
  host itself and waits for (logged at warning)."""
  whole = [k for k, c in enumerate(cut) if not c]
  out: list[Any] = list(srcs)
  if not srcs:
    return out
  room: dict[Any, int | None] = {}
  there, host = [], []
  for k in whole:
    device = next(iter(srcs[k].devices()))
    if device not in room:
      room[device] = _room(device)
    if room[device] is None or room[device] >= srcs[k].nbytes:
      if room[device] is not None:
        room[device] -= srcs[k].nbytes
      there.append(k)
    else:
      host.append(k)
  try:
    for k, c in zip(there, copies.fresh_copies([srcs[k] for k in there])):
      out[k] = c
    # Each to the host now, once: the writer and the checksums then wait
    # for the same transfer.
    for k in there + [k for k, c in enumerate(cut) if c]:
      out[k].copy_to_host_async()
  except Exception as e:  # pylint: disable=broad-except
    log.warning("copying %d bytes on their devices failed (%r)",
                sum(srcs[k].nbytes for k in there), e)
    host = sorted(host + there)
  if host:
    log.warning("the save call copies %d bytes to the host itself and waits"
                " for it: neither pinned memory nor room on their devices"
                " was there for them", sum(srcs[k].nbytes for k in host))
  for k in host:
    out[k] = _c_order(np.asarray(jax.make_array_from_single_device_arrays(
        srcs[k].shape, srcs[k].sharding, [srcs[k]])))
  return out


def _room(device: Any) -> int | None:
  """Bytes that copies may take on `device` while a train step runs: its
  limit less the most it has held (the step's peak so far); None where
  the runtime does not say (the CPU's memory is the host's)."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  if not stats or "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - max(stats.get("peak_bytes_in_use", 0),
                                    stats.get("bytes_in_use", 0))


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: np.dtype) -> str:
  return str(dtype)  # Slow in numpy; called per leaf per save.


def _c_order(arr: np.ndarray) -> np.ndarray:
  # Not np.ascontiguousarray: it turns 0-d arrays into shape (1,).
  return arr if arr.flags.c_contiguous else np.array(arr, order="C")
