"""Coordinators for other groups of processes than the whole job.

`SoloCoordinator` is one process by itself: what a process keeps for
itself alone (the local tier) meets nobody. `Survivors` is the processes
left after a peer was lost: their barriers name them (`process_ids=`), and
their calls ignore the watcher that ended every wait of the job's
coordinator (see `rescue`). `share_text` and `fetch_text` pass a text of
any size through the key-value store, in chunks.

An elastic job's running group (`elastic`) is recorded in the key-value
store (`Group`, `joining`), and each of its generations runs on its own
order of the devices (`choose_order`, `on_devices`), one in which no group
of devices that a collective may use repeats a device list of an earlier
generation (`mesh_lists`, recorded under `lists_key`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost.coordinator import Rounds
from flax_ckpt_plugin.logs import log

_CHUNK = 1 << 20  # Characters per key-value entry of a shared text.


class SoloCoordinator(Rounds):
  """One process by itself, whatever the job: barriers pass at once and the
  key-value store is its own."""

  process_index = 0
  process_count = 1

  def __init__(self):
    super().__init__()
    self._kv: dict[str, str] = {}

  def barrier(self, key: str, *, timeout_ms: int,
              process_ids: Sequence[int] | None = None) -> None:
    del key, timeout_ms, process_ids

  def kv_set(self, key: str, value: str) -> None:
    self._kv[key] = value

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    if key not in self._kv:
      raise TimeoutError(f"key {key!r} was never set")
    return self._kv[key]

  def kv_dir(self, prefix: str) -> dict[str, str]:
    return {k: v for k, v in self._kv.items() if k.startswith(prefix + "/")}

  def kv_delete(self, key: str) -> None:
    for k in [k for k in self._kv if k == key or k.startswith(key + "/")]:
      del self._kv[k]

  def live_processes(self, process_ids=None, timeout_secs=None
                     ) -> dict[int, int]:
    del process_ids, timeout_secs
    return {0: 0}

  def reached_preemption_sync_point(self, step: int) -> bool:
    return False

  def preemption_notifier_installed(self) -> bool:
    return False


class Survivors:
  """The job's coordinator, for `members` only (the survivors of a loss).

  Process indices stay the job's; every barrier names `members`. Calls
  ignore the job coordinator's abort (`JaxCoordinator.unguarded`).
  """

  def __init__(self, coord: coordinator_lib.Coordinator,
               members: Sequence[int]):
    if isinstance(coord, Survivors):  # Survivors of survivors: the job's.
      coord = coord._coord  # pylint: disable=protected-access
    unguarded = getattr(coord, "unguarded", None)
    self._coord = unguarded() if unguarded is not None else coord
    self.members = sorted(members)

  @property
  def process_index(self) -> int:
    return self._coord.process_index

  @property
  def process_count(self) -> int:
    return self._coord.process_count

  def barrier(self, key: str, *, timeout_ms: int,
              process_ids: Sequence[int] | None = None) -> None:
    del process_ids
    if self.members == [self.process_index]:
      return  # A group of one meets nobody (and reuses no key of the job's).
    self._coord.barrier(key, timeout_ms=timeout_ms, process_ids=self.members)

  def kv_set(self, key: str, value: str) -> None:
    self._coord.kv_set(key, value)

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    return self._coord.kv_get(key, timeout_ms=timeout_ms)

  def kv_dir(self, prefix: str) -> dict[str, str]:
    return self._coord.kv_dir(prefix)

  def kv_delete(self, key: str) -> None:
    self._coord.kv_delete(key)

  def next_round(self, name: str) -> int:
    return self._coord.next_round(name)

  def live_processes(self, *args, **kwargs) -> dict[int, int]:
    return self._coord.live_processes(*args, **kwargs)

  def abort_when(self, check, *, replacing=None) -> None:
    """See `JaxCoordinator.abort_when`: a watcher of the survivors (see
    `elastic`) ends their waits, not the job's first watcher."""
    set_abort = getattr(self._coord, "abort_when", None)
    if set_abort is not None:
      set_abort(check, replacing=replacing)

  def reached_preemption_sync_point(self, step: int) -> bool:
    return self._coord.reached_preemption_sync_point(step)

  def preemption_notifier_installed(self) -> bool:
    return self._coord.preemption_notifier_installed()


def share_text(coord: coordinator_lib.Coordinator, key: str,
               text: str) -> None:
  """Sets `text` under `key` for `fetch_text`, in chunks."""
  chunks = [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)] or [""]
  for n, chunk in enumerate(chunks):
    coord.kv_set(f"{key}/{n}", chunk)
  coord.kv_set(f"{key}/count", str(len(chunks)))


def fetch_text(coord: coordinator_lib.Coordinator, key: str,
               timeout_ms: int) -> str:
  """The text another process shared under `key` (waits for it)."""
  count = int(coord.kv_get(f"{key}/count", timeout_ms=timeout_ms))
  return "".join(coord.kv_get(f"{key}/{n}", timeout_ms=timeout_ms)
                 for n in range(count))


class Group(NamedTuple):
  """The running group of an elastic job, as the key-value store records it
  (under `group_key`): its processes, how often it changed (0: the whole
  job as launched), and its primary."""
  members: tuple[int, ...]
  gen: int
  primary: int

  def opening_primary(self, me: int) -> int:
    """The primary a relaunched process `me` opens its tiers with: never
    itself (it must not claim the directory the survivors write to)."""
    return next(p for p in (self.primary, *self.members) if p != me)


def group_key(job: str) -> str:
  """The key-value prefix of the elastic group of the job named `job`
  (`local_tier.job_name` of its persistent directory)."""
  return f"flax_ckpt_plugin/elastic/{job}"


# The elastic groups this process opened (`elastic.Peers`): one it opens
# again is no rejoin.
_OPENED: set[str] = set()


def mark_opened(key: str) -> None:
  """This process opened the group of `key` (it is no rejoin if it opens
  it again)."""
  _OPENED.add(key)


def joining(coord: coordinator_lib.Coordinator, key: str) -> Group | None:
  """The running group, if this process was relaunched into it (its
  record exists: the job ran before this process started), else None.
  Does not wait.

  At the job's start no process sees a record: the first member writes it
  after every process opened the persistent tier.
  """
  if coord.process_count < 2 or key in _OPENED:
    return None
  text = coord.kv_dir(key).get(f"{key}/group")
  if text is None:
    return None
  members, gen, primary = json.loads(text)
  return Group(tuple(members), gen, primary)


def device_order(members: list[int], gen: int,
                 devices: list[Any] | None = None) -> list[Any]:
  """The devices of `members`, in the order of generation `gen`, so that
  no group uses a device list of an earlier one (on CPU, a list that took
  part in a collective with a dead process stays broken): rotated by
  `gen` (neighbours stay neighbours), then reversed and rotated, then a
  permutation drawn with `gen` as the seed. `devices`: all of the job's
  (`jax.devices()` by default)."""
  if devices is None:
    import jax  # pylint: disable=g-import-not-at-top
    devices = jax.devices()
  devices = [d for d in devices if d.process_index in members]
  n = len(devices)
  if gen >= 2 * n:
    return [devices[i] for i in np.random.default_rng(gen).permutation(n)]
  if gen >= n:
    devices = devices[::-1]
  k = gen % n
  return devices[k:] + devices[:k]


def mesh_lists(tree: Any) -> set[str]:
  """The device lists that collectives of programs on `tree`'s meshes may
  run over, each named by a short hash of its device ids in order: for
  every mesh and every set of its axes, the devices that differ along those
  axes only, in the mesh's order (lists of two devices or more).

  The runtime keys a collective's rendezvous by its device list (on CPU,
  `gloo/<ids>/<rank>` in the key-value store). A list that took part in a
  collective with a process that was lost since is broken for good: its
  survivors keep its dead context, and the key-value store keeps the keys
  the dead incarnation set, which its relaunched process cannot set again.
  """
  grids: dict[bytes, np.ndarray] = {}
  import jax  # pylint: disable=g-import-not-at-top
  for leaf in jax.tree.leaves(tree):
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    devices = getattr(mesh, "devices", None)  # (None: an abstract mesh.)
    if not isinstance(devices, np.ndarray):
      continue
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(devices)
    grids.setdefault(repr(ids.shape).encode() + ids.tobytes(), ids)
  out = set()
  for ids in grids.values():
    ndim = ids.ndim
    for r in range(1, ndim + 1):
      for axes in itertools.combinations(range(ndim), r):
        size = int(np.prod([ids.shape[a] for a in axes]))
        if size < 2:
          continue
        rows = np.moveaxis(ids, axes, range(ndim - r, ndim)).reshape(-1, size)
        out.update(_name(row) for row in rows)
  return out


def _name(ids: np.ndarray) -> str:
  return hashlib.sha1(",".join(map(str, ids.tolist())).encode()
                      ).hexdigest()[:16]


def lists_key(key: str, gen: int) -> str:
  """Where generation `gen` of the group of `key` records its `mesh_lists`."""
  return f"{key}/lists/{gen}"


def used_lists(coord: coordinator_lib.Coordinator, key: str,
               before: int) -> set[str]:
  """The `mesh_lists` that the generations before `before` recorded."""
  out: set[str] = set()
  for k, text in coord.kv_dir(f"{key}/lists").items():
    if int(k.rsplit("/", 1)[1]) < before:
      out.update(json.loads(text))
  return out


def _orders(members: list[int], gen: int, devices: list[Any] | None
            ) -> Iterator[list[Any]]:
  """`device_order`'s order first, then every rotation forwards and
  reversed, then permutations drawn with `gen` and a count as the seed;
  each once."""
  if devices is None:
    import jax  # pylint: disable=g-import-not-at-top
    devices = jax.devices()
  seen = set()
  ours = [d for d in devices if d.process_index in members]
  n = len(ours)
  firsts = [device_order(members, gen, devices)]
  firsts += [(ours[::-1] if rev else ours)[k:] + (ours[::-1] if rev
                                                  else ours)[:k]
             for rev in (False, True) for k in range(n)]
  drawn = ([ours[i] for i in np.random.default_rng([gen, c]).permutation(n)]
           for c in itertools.count())
  for order in itertools.chain(firsts, drawn):
    ids = tuple(d.id for d in order)
    if ids not in seen:
      seen.add(ids)
      yield order


def choose_order(members: list[int], gen: int,
                 build: Callable[[list[Any]], Any], used: set[str], *,
                 devices: list[Any] | None = None, tries: int = 64
                 ) -> tuple[list[Any], Any, set[str]]:
  """The devices of `members` in an order for generation `gen` whose
  target, `build(order)`, uses none of the device lists in `used` (see
  `mesh_lists`): the first of `_orders` that does, so that a 1-D mesh
  gets `device_order`'s. Returns (order, target, its lists); the target
  is built last from the order returned (`build` may keep what it built,
  a jitted step, say). If none of `tries` orders avoids them all, the one
  that reuses fewest, with a warning.
  """
  best = None
  for order in itertools.islice(_orders(members, gen, devices), tries):
    target = build(order)
    lists = mesh_lists(target)
    clash = len(lists & used)
    if not clash:
      return order, target, lists
    if best is None or clash < best[0]:
      best = (clash, order)
  clash, order = best
  log.warning("no order of the group's devices avoids every device list"
              " an earlier generation used: %d of this one's were used"
              " before, and their collectives may fail", clash)
  target = build(order)
  return order, target, mesh_lists(target)


def on_devices(tree: Any, devices: list[Any]) -> Any:
  """The abstract `tree`, its meshes moved onto `devices` position for
  position (`jax.devices()[i]` becomes `devices[i]`): the target of a
  process that rejoins without a `make_target`.

  Raises:
    ValueError: a leaf's sharding is on other devices than a mesh of all.
  """
  import jax  # pylint: disable=g-import-not-at-top
  moved = dict(zip(jax.devices(), devices))
  if len(devices) != len(jax.devices()):
    raise ValueError(f"rejoining needs every device; the group has"
                     f" {len(devices)} of {len(jax.devices())}")

  def one(path, x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
      raise ValueError(
          f"leaf {jax.tree_util.keystr(path)!r}: rejoining places the state"
          f" on a mesh in the group's device order, which needs a"
          f" NamedSharding (got {sharding!r}); pass"
          " make_target= to restore_or_initialize")
    mesh = sharding.mesh
    new = jax.sharding.Mesh(
        np.vectorize(moved.__getitem__, otypes=[object])(mesh.devices),
        mesh.axis_names)
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
            new, sharding.spec))

  return jax.tree_util.tree_map_with_path(one, tree)
