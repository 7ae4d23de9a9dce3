"""How each piece of a save travels to the host, worked out once per layout,
and each save's arrays along those routes (`Routes.arrays`).

A save's pieces (see `pieces`) go one of five ways, by their device, dtype
and the staging memory of the manager (see `snapshot.take_snapshot`):
onto pinned host memory (accelerators, within the pinned budget; or
copied on their devices at a save that finds their pinned memory not
ready, `PinnedStaging.choose`); the
plain transfer (other accelerator shards); a slice on the device (rows of
a CPU shard); threads (CPU shards whose dtype cannot travel as unsigned
bits, or every CPU shard where staging is an arena); or a compiled copy
program on the device (every other CPU shard, in `copies.groups`). All of
it depends on the layout alone, so a save of a layout seen before only
looks it up: the save call pays per leaf no more than gathering its
arrays.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TYPE_CHECKING

import jax

from flax_ckpt_plugin.format.treepaths import extents
from flax_ckpt_plugin.arrays import copies
from flax_ckpt_plugin.arrays import pinned
from flax_ckpt_plugin.save import pieces as pieces_lib
from flax_ckpt_plugin.save.pinned_staging import PinnedStaging
from flax_ckpt_plugin.save.pinned_staging import Size
from flax_ckpt_plugin.arrays.copies import bits_dtype

if TYPE_CHECKING:  # Annotations only: `snapshot` imports it anyway.
  from flax_ckpt_plugin.save.staging import HostStaging


def cut(data: jax.Array, rows: tuple[int, int] | None) -> jax.Array:
  """A piece as an array of its own: the shard `data`, or its `rows`.

  A part of a shard is cut on its device by a slice, which the runtime runs
  before the next step, into memory of its own: the donation of the
  state's buffers stays safe."""
  if rows is None:
    return data
  return jax.lax.slice_in_dim(data, *rows)


def _single_arrays(arr: jax.Array) -> list[jax.Array]:
  """The array's single-device arrays, in `addressable_shards` order."""
  arrays = getattr(arr, "_arrays", None)  # Without making Shard objects.
  if arrays is None:
    arrays = [s.data for s in arr.addressable_shards]
  return arrays


def _shards(plan: pieces_lib.Plan, where: tuple[Where, ...],
            fresh: bool = False) -> list[jax.Array]:
  """The shards of the pieces at `where`: single-device arrays (a leaf on
  one device is its own shard).

  `fresh`: each a new `jax.Array` object of the same buffer, for a caller
  that reads it with `np.asarray`, which JAX may cache on the object:
  cached on the state's own arrays, a host view would pin their buffers
  (and decline the next step's donation), a host copy would stay as long
  as they do.
  """
  out = []
  last, arrays = None, None
  for w in where:
    lay, value = plan.layout.leaves[w.leaf], plan.values[w.leaf]
    if lay.impl is not None:
      value = jax.random.key_data(value)
    if lay.single:
      shard = value
    else:
      if w.leaf != last:
        last, arrays = w.leaf, _single_arrays(value)
      shard = arrays[w.shard]
    out.append(jax.make_array_from_single_device_arrays(
        shard.shape, shard.sharding, [shard]) if fresh else shard)
  return out


class Where(NamedTuple):
  """One piece of a layout, as a route lists it.

  Attributes:
    leaf: the number of the piece's leaf, in flattening order.
    piece: its number among the leaf's pieces (`LeafLayout.specs`).
    shard: the place of its shard among the leaf's single-device arrays.
    rows: the [start, stop) of the shard's rows that the piece is, or None:
      all of the shard.
  """
  leaf: int
  piece: int
  shard: int
  rows: tuple[int, int] | None

  def spec(self, layout: pieces_lib.Layout) -> pieces_lib.PieceSpec:
    """The piece's `PieceSpec` in `layout`."""
    return layout.leaves[self.leaf].specs[self.piece]


class Routes(NamedTuple):
  """How each piece of one layout travels to the host.

  Attributes:
    first: per leaf, the number of its first piece (pieces are numbered
      across the layout, leaf by leaf).
    count: the pieces in all.
    pinned: the pieces copied onto pinned host memory,
    pinned_bytes: their bytes in all,
    pinned_sizes: and each one's `Size`, in the same order.
    transfers: the pieces off the CPU that go by the plain transfer.
    cuts: rows of CPU shards, cut by a slice.
    threads: CPU shards copied by threads (`HostStaging.copy`).
    programs: CPU shards copied on their devices,
    groups: in these `copies.Group`s (whose shard numbers count in
      `programs`).
  """
  first: tuple[int, ...]
  count: int
  pinned: tuple[Where, ...]
  pinned_bytes: int
  pinned_sizes: tuple[Size, ...]
  transfers: tuple[Where, ...]
  cuts: tuple[Where, ...]
  threads: tuple[Where, ...]
  programs: tuple[Where, ...]
  groups: tuple[copies.Group, ...]

  def pinned_arrays(self, plan: pieces_lib.Plan) -> list[jax.Array]:
    """The arrays that go onto pinned host memory, their rows cut."""
    return [cut(shard, w.rows) for shard, w in zip(
        _shards(plan, self.pinned), self.pinned)]

  def arrays(self, plan: pieces_lib.Plan) -> Arrays:
    """The arrays of this save's pieces that go another way than onto
    pinned host memory (`pinned_arrays`), by route."""
    return Arrays(
        [cut(shard, w.rows) for shard, w in zip(
            _shards(plan, self.transfers, fresh=True), self.transfers)],
        [cut(shard, w.rows) for shard, w in zip(
            _shards(plan, self.cuts), self.cuts)],
        _shards(plan, self.threads, fresh=True),
        _shards(plan, self.programs))


class Arrays(NamedTuple):
  """One save's pieces as single-device arrays, by route (see `Routes`),
  each cut to its rows (`cut`: a slice the runtime runs before the
  next step). Those the snapshot reads with `np.asarray` (transfers,
  threads) are objects of their own (`_shards`' `fresh`)."""
  transfers: list[jax.Array]
  cuts: list[jax.Array]
  threads: list[jax.Array]
  programs: list[jax.Array]


def _routes(layout: pieces_lib.Layout, arena: bool,
            budget: PinnedStaging | None, takes: dict[Any, bool]
            ) -> Routes:
  first, count = [], 0
  pinned_todo, rest = [], []
  for i, lay in enumerate(layout.leaves):
    first.append(count)
    if lay is None:
      continue
    count += len(lay.specs)
    for j, spec in enumerate(lay.specs):
      where = Where(i, j, spec.shard, spec.rows)
      if (budget is not None and takes[spec.device]
          and pinned.fits(lay.dtype)):
        pinned_todo.append(where)
      else:
        rest.append(where)
  if pinned_todo:
    nbytes = [math.prod(extents(w.spec(layout).index))
              * layout.leaves[w.leaf].dtype.itemsize for w in pinned_todo]
    fit = budget.split(nbytes)
    rest += pinned_todo[fit:]
    pinned_todo = pinned_todo[:fit]
    pinned_bytes = sum(nbytes[:fit])
    pinned_sizes = tuple(Size(w.spec(layout).device, n)
                         for w, n in zip(pinned_todo, nbytes))
  else:
    pinned_bytes, pinned_sizes = 0, ()
  transfers, cuts, threads, programs = [], [], [], []
  for where in rest:
    lay = layout.leaves[where.leaf]
    if lay.specs[where.piece].device.platform != "cpu":
      transfers.append(where)
    elif where.rows is not None:
      cuts.append(where)
    elif bits_dtype(lay.dtype) is not None and not arena:
      programs.append(where)
    else:
      threads.append(where)
  groups = copies.groups(
      tuple((extents(w.spec(layout).index), layout.leaves[w.leaf].dtype,
             layout.leaves[w.leaf].weak_type) for w in programs),
      tuple(w.spec(layout).device for w in programs))
  return Routes(tuple(first), count, tuple(pinned_todo), pinned_bytes,
                pinned_sizes, tuple(transfers), tuple(cuts), tuple(threads),
                tuple(programs), groups)


def of(plan: pieces_lib.Plan, staging: HostStaging,
       pinned_staging: PinnedStaging | None) -> Routes:
  """The routes of `plan`'s layout for this staging (worked out at the
  first save of the layout that asks)."""
  layout = plan.layout
  devices = layout.remember("devices", lambda: frozenset(
      spec.device for lay in layout.leaves if lay is not None
      for spec in lay.specs))
  takes = {d: pinned_staging is not None and pinned.takes(d)
           for d in devices}
  budget = None if pinned_staging is None else pinned_staging.budget
  key = ("routes", staging.arena is not None, budget,
         tuple(sorted(d.id for d, t in takes.items() if t)),
         copies.REUSE_BYTES, copies.PACK_COUNT, copies.PACK_BYTES)
  return layout.remember(key, lambda: _routes(
      layout, staging.arena is not None,
      pinned_staging if any(takes.values()) else None, takes))
