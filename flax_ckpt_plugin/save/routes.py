"""How each piece of a save travels to the host, worked out once per layout.

A save's pieces (see `pieces`) go one of five ways, by their device, dtype
and the staging memory of the manager (see `snapshot.take_snapshot`):
onto pinned host memory (accelerators, within the pinned budget); the
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

from flax_ckpt_plugin.format.treepaths import extents
from flax_ckpt_plugin.arrays import copies
from flax_ckpt_plugin.arrays import pinned
from flax_ckpt_plugin.save.pinned_staging import PinnedStaging
from flax_ckpt_plugin.arrays.copies import bits_dtype

if TYPE_CHECKING:  # Annotations only: `snapshot` imports both anyway.
  from flax_ckpt_plugin.save import pieces as pieces_lib
  from flax_ckpt_plugin.save.staging import HostStaging


# A piece, by its leaf's number, its number among the leaf's pieces, its
# shard's place among the leaf's single-device arrays, and its rows (or
# None: all of the shard).
_Where = tuple[int, int, int, "tuple[int, int] | None"]


class Routes(NamedTuple):
  """How each piece of one layout travels to the host."""
  first: tuple[int, ...]  # Per leaf: the number of its first piece.
  count: int  # Pieces in all.
  pinned: tuple[_Where, ...]  # Onto pinned host memory,
  pinned_bytes: int  # that many bytes.
  transfers: tuple[_Where, ...]  # Off the CPU, the plain transfer.
  cuts: tuple[_Where, ...]  # Rows of a CPU shard, cut by a slice.
  threads: tuple[_Where, ...]  # CPU shards copied by threads (`copy`).
  programs: tuple[_Where, ...]  # CPU shards copied on their devices,
  groups: Any  # in these `copies.groups`.


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
    for j, (k, _, device, rows) in enumerate(lay.specs):
      where = (i, j, k, rows)
      if budget is not None and takes[device] and pinned.fits(lay.dtype):
        pinned_todo.append(where)
      else:
        rest.append(where)
  if pinned_todo:
    nbytes = [math.prod(extents(layout.leaves[i].specs[j][1]))
              * layout.leaves[i].dtype.itemsize for i, j, _, _ in pinned_todo]
    fit = budget.split(nbytes)
    rest += pinned_todo[fit:]
    pinned_todo = pinned_todo[:fit]
    pinned_bytes = sum(nbytes[:fit])
  else:
    pinned_bytes = 0
  transfers, cuts, threads, programs = [], [], [], []
  for where in rest:
    i, j, _, rows = where
    lay = layout.leaves[i]
    if lay.specs[j][2].platform != "cpu":
      transfers.append(where)
    elif rows is not None:
      cuts.append(where)
    elif bits_dtype(lay.dtype) is not None and not arena:
      programs.append(where)
    else:
      threads.append(where)
  groups = copies.groups(
      tuple((extents(layout.leaves[i].specs[j][1]), layout.leaves[i].dtype,
             layout.leaves[i].weak_type) for i, j, _, _ in programs),
      tuple(layout.leaves[i].specs[j][2] for i, j, _, _ in programs))
  return Routes(tuple(first), count, tuple(pinned_todo), pinned_bytes,
                tuple(transfers), tuple(cuts), tuple(threads),
                tuple(programs), groups)


def of(plan: pieces_lib.Plan, staging: HostStaging,
       pinned_staging: PinnedStaging | None) -> Routes:
  """The routes of `plan`'s layout for this staging (worked out at the
  first save of the layout that asks)."""
  layout = plan.layout
  devices = layout.remember("devices", lambda: frozenset(
      spec[2] for lay in layout.leaves if lay is not None
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
