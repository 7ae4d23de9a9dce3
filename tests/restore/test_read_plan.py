"""The plan of a restore made together (`read_plan`), on a mesh of fake
devices: which process reads a small region, into which device's slot.

The plan is computed by each process alone from the shardings, so it can
be checked without JAX processes: fake devices carry the `id` and
`process_index` that the plan looks at (a real run needs two hosts with
four devices each for this layout). The multi-process restores themselves
are tested in test_multihost_topology.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flax_ckpt_plugin.restore import read_plan


@dataclasses.dataclass(frozen=True)
class _Device:
  id: int
  process_index: int


class _Mesh:
  """What the plan reads of a mesh: its axis names and device array."""

  def __init__(self):
    # data=4 x model=2 over 2 processes: each holds 2 x 2 devices.
    self.axis_names = ("data", "model")
    self.devices = np.array([[_Device(2 * d + m, d // 2) for m in range(2)]
                             for d in range(4)], dtype=object)


def _regions(mesh: _Mesh, halves: bool, rows: int) -> dict:
  """Region -> the devices holding it: whole, or halves along 'model'."""
  out: dict = {}
  for (_, m), device in np.ndenumerate(mesh.devices):
    lo, hi = ((m * rows // 2, (m + 1) * rows // 2) if halves
              else (0, rows))
    out.setdefault(((lo, hi), (0, 256)), []).append(device)
  return out


def _plan(by_region, mesh, spare, shape, replicas, load):
  static = read_plan._analyzed(  # pylint: disable=protected-access
      by_region, mesh, spare, shape, np.dtype(np.float32), None, replicas)
  return read_plan._planned(static, load)  # pylint: disable=protected-access


def test_small_regions_stay_shared_and_balanced_on_several_devices_a_process():
  """A replicated 32 KiB leaf, then leaves split over 'model' whose halves
  (32 KiB) each live on two devices of each process: every leaf is
  shared, each half goes whole to one device at one replica position for
  both halves (or the slot layouts would differ), and the reads alternate
  between the processes."""
  mesh, load = _Mesh(), {}
  plans = [_plan(_regions(mesh, False, 32), mesh, ("data", "model"),
                 (32, 256), 8, load)]
  for _ in range(4):
    plans.append(_plan(_regions(mesh, True, 64), mesh, ("data",), (64, 256), 4,
                       load))
  assert all(p is not None for p in plans), plans
  readers = []
  for plan in plans:
    reading = {d: rows for d, (_, rows) in plan.parts.items()
               if rows[0][1] > rows[0][0]}
    procs = {d.process_index for d in reading}
    assert len(procs) == 1, reading  # Read whole by one process...
    readers.append(procs.pop())
  assert readers == [0, 1, 0, 1, 0], readers  # ...the least loaded one.
  assert load[0] == load[1] + 32 * 256 * 4, load


def test_regions_held_at_no_common_place_are_read_by_their_own_processes():
  """A process that holds every region, but at different replica places
  (process 0: region 0 at place 0, region 1 at place 1), cannot read them
  whole into one place's slots: no process can here, so each reads its own
  (before, choosing among such processes raised ValueError)."""
  mesh = _Mesh()
  d = [_Device(0, 0), _Device(1, 1), _Device(2, 1), _Device(3, 0)]
  mesh.axis_names = ("data", "model")
  mesh.devices = np.array([[d[0], d[1]], [d[2], d[3]]], dtype=object)
  by_region = {((0, 16), (0, 256)): [d[0], d[2]],  # Model column 0.
               ((16, 32), (0, 256)): [d[1], d[3]]}  # Model column 1.
  load = {}
  assert _plan(by_region, mesh, ("data",), (32, 256), 2, load) is None
  assert not load
