"""An elastic job's generations: its running group, and each one's devices.

The running group (`elastic`) is recorded in the key-value store (`Group`,
under `group_key`; `joining` finds it for a relaunched process), and each
of its generations runs on its own order of the devices (`choose_order`,
`on_devices`), one in which no group of devices that a collective may use
repeats a device list of an earlier generation (`mesh_lists`, recorded
under `lists_key`). A relaunched process finds the group (`joining`),
waits for the survivors' group without it (`next_group_without`), asks
it to take it back (`ask_to_join`) and reads their plan (`read_plan`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
from typing import Any, Callable, Iterator, NamedTuple

import jax
import numpy as np

from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.tolerance import liveness


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


def job_name(directory: str) -> str:
  """The name of the job of a persistent `directory`: two jobs
  that share a local path never read each other's steps."""
  return hashlib.sha1(directory.encode()).hexdigest()[:12]


def group_key(job: str) -> str:
  """The key-value prefix of the elastic group of the job named `job`
  (`job_name` of its persistent directory)."""
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


def watch_key(key: str, gen: int) -> str:
  """The records of the watch of generation `gen` (after the first) of an
  elastic group: every member names it alike, a relaunched one too (its
  count of `liveness.watch`'s rounds differs from the survivors'), and
  one asks to join a degraded group under it (`liveness.join_record`).
  Each generation is recorded once in a job, so no record of an earlier
  watch is found there."""
  return f"{key}/{gen}/watch"


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


def show_restart(coord: coordinator_lib.Coordinator, key: str, group: Group,
                 poll_secs: float) -> None:
  """A process relaunched before the survivors dropped it: their watcher
  polls the live processes with it among them, and each poll waits for
  every live one of them (`liveness`), this new process too. One poll
  with them shows them its new incarnation (they then recover without
  it, see `next_group_without`); unless their watcher reported the loss
  already (they no longer poll that way, and a poll would wait for
  nobody)."""
  if f"{key}/{group.gen}/lost" in coord.kv_dir(f"{key}/{group.gen}"):
    return
  try:
    coord.live_processes(list(group.members), timeout_secs=poll_secs)
  except Exception as e:  # pylint: disable=broad-except
    log.warning("process %d: the survivors did not poll with it (%r)",
                coord.process_index, e)


def next_group_without(coord: coordinator_lib.Coordinator, key: str,
                       group: Group, timeout_ms: int) -> Group:
  """The first recorded group after `group` that this process is not a
  member of: the survivors' group once they recovered without it."""
  while coord.process_index in group.members:
    members, gen, primary = json.loads(coord.kv_get(
        f"{key}/groups/{group.gen + 1}", timeout_ms=timeout_ms))
    group = Group(tuple(members), gen, primary)
  return group


def ask_to_join(coord: coordinator_lib.Coordinator, key: str,
                group: Group) -> str:
  """A relaunched process asks the survivors' `group` (recorded without
  it) to take it back: their watcher reads the request
  (`liveness.Watcher.joining`). Returns the request's key."""
  asked = liveness.join_record(watch_key(key, group.gen), coord.process_index)
  coord.kv_set(asked, "1")
  return asked


def record_plan(coord: coordinator_lib.Coordinator, key: str, step: int,
                survivors: list[int], members: list[int]) -> None:
  """The survivors' first member records under `key` the step at which
  the `survivors` take back the others of `members`, for them to read
  (`read_plan`)."""
  coord.kv_set(f"{key}/plan", json.dumps([step, survivors, members]))


def read_plan(coord: coordinator_lib.Coordinator, key: str, asked: str,
              timeout_ms: int) -> tuple[int, list[int], list[int]]:
  """A relaunched process that asked to join (`asked`, `ask_to_join`):
  the survivors' plan recorded under `key` (`record_plan`), waited for up
  to `timeout_ms`. Where it does not come, the request is withdrawn: left
  behind, it would have the survivors plan to take back a process that
  gave up, wait out their barriers for it, and then refuse every request
  to their group."""
  try:
    step, survivors, members = json.loads(coord.kv_get(
        f"{key}/plan", timeout_ms=timeout_ms))
  except BaseException:
    with contextlib.suppress(Exception):  # The service may be what failed.
      coord.kv_delete(asked)
    raise
  return step, survivors, members


def vote(coord: coordinator_lib.Coordinator, key: str, group: Group,
         step: int, propose: int | None, joining: Any
         ) -> tuple[int, list[int]] | None:
  """The survivors' vote on the step at which the group takes back the
  processes that asked to join: this survivor votes for `propose` (given
  once, recorded under `key`). The group's first member counts the votes
  at each call; once every member voted, it records the highest vote, the
  step, and who is taken back (`key`/result), which every member reads at
  its calls. Returns (that step, the processes taken back) at that step,
  else None.

  So each call costs a member one read of one small key, and the first
  member one listing of the votes, whatever the group's size (each member
  listing every vote at every call was O(members) per member). A vote is
  for two steps after the voter's: the first member counts at the latest
  one step after the last vote (see `Peers.rebuild_due`), so the result is
  there before any member reaches the agreed step.

  Raises:
    RuntimeError: this survivor is past the agreed step (the loop skipped
      a call of the callback).
  """
  me = coord.process_index
  if propose is not None:
    coord.kv_set(f"{key}/by/{me}", json.dumps([propose, sorted(joining)]))
  found = coord.kv_dir(f"{key}/result")
  if not found and me == group.members[0]:
    votes = [json.loads(v) for v in coord.kv_dir(f"{key}/by").values()]
    if len(votes) == len(group.members):
      result = json.dumps([max(v[0] for v in votes),
                           sorted(set().union(*(v[1] for v in votes)))])
      coord.kv_set(f"{key}/result/0", result)
      found = {f"{key}/result/0": result}
  if not found:
    return None
  at, joined = json.loads(next(iter(found.values())))
  if step < at:
    return None
  if step > at:
    raise RuntimeError(f"the survivors agreed to take processes back at"
                       f" step {at}, but this one is at step {step}: the"
                       " loop must call the callback at every step")
  return at, joined


def record_first_lists(coord: coordinator_lib.Coordinator, key: str,
                       group: Group, state: Any, *, record: bool) -> set[str]:
  """The device lists of the meshes of the state a job starts from (no
  later generation reuses one); the group's first member records them
  (if `record`), where a relaunched process reads them."""
  lists = mesh_lists(state)
  name = lists_key(key, 0)
  if (record and lists and coord.process_index == group.members[0]
      and name not in coord.kv_dir(f"{key}/lists")):
    coord.kv_set(name, json.dumps(sorted(lists)))
  return lists


def choose(group: Any, key: str, gen: int, build: Callable[[list[Any]], Any],
           first_lists: set[str]) -> tuple[list[Any], Any, set[str]]:
  """The devices of generation `gen` of the group (a `groups.Survivors`)
  in the order its meshes take (see `choose_order`), the target `build`
  makes on them, and its meshes' device lists; every member chooses the
  same. Lists used before: those recorded, the first state's, and those
  of `build` on the job's devices in their first order (the meshes a job
  that did not hand its first state would have)."""
  used = (used_lists(group, key, gen) | first_lists
          | mesh_lists(build(jax.devices())))
  return choose_order(group.members, gen, build, used)


def record(coord: coordinator_lib.Coordinator, key: str, group: Group,
           lists: set[str] | None) -> None:
  """The group's first member records it (see `Group`), after the device
  lists of its meshes, so that whoever sees the group sees them."""
  if coord.process_index == group.members[0]:
    if lists:
      coord.kv_set(lists_key(key, group.gen), json.dumps(sorted(lists)))
    text = json.dumps(list(group))
    coord.kv_set(f"{key}/groups/{group.gen}", text)
    coord.kv_set(f"{key}/group", text)
