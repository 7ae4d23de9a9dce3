"""An elastic job's generations: its running group, and each one's devices.

The running group (`elastic`) is recorded in the key-value store (`Group`,
under `group_key`; `joining` finds it for a relaunched process), and each
of its generations runs on its own order of the devices (`choose_order`,
`on_devices`), one in which no group of devices that a collective may use
repeats a device list of an earlier generation (`mesh_lists`, recorded
under `lists_key`), but for the lists of one survivor's devices alone
(`used_lists`), and in which, among such orders, the groups of the meshes'
inner axes stay inside one process where they can (`split_groups`). A relaunched process finds the group (`joining`),
waits for the survivors' group without it (`next_group_without`), asks
it to take it back (`ask_to_join`) and reads their plan (`read_plan`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import threading
from typing import Any, Callable, Iterator, NamedTuple

import jax
import numpy as np

from flax_ckpt_plugin.logs import log
from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost import meetings
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
  text = coord.kv_dir(key).get(keys.child(key, "group"))
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
  """The names of `device_lists(tree)`."""
  return set(device_lists(tree))


def _grids(tree: Any) -> list[np.ndarray]:
  """The device grids of `tree`'s meshes, each once."""
  grids: dict[bytes, np.ndarray] = {}
  for leaf in jax.tree.leaves(tree):
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    devices = getattr(mesh, "devices", None)  # (None: an abstract mesh.)
    if not isinstance(devices, np.ndarray):
      continue
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(devices)
    grids.setdefault(repr(ids.shape).encode() + ids.tobytes(), devices)
  return list(grids.values())


def device_lists(tree: Any) -> dict[str, int | None]:
  """The device lists that collectives of programs on `tree`'s meshes may
  run over, each named by a short hash of its device ids in order: for
  every mesh and every set of its axes, the devices that differ along those
  axes only, in the mesh's order (lists of two devices or more); each with
  the one process that holds all its devices (None: several do).

  The runtime keys a collective's rendezvous by its device list (on CPU,
  `gloo/<ids>/<rank>` in the key-value store). A list that took part in a
  collective with a process that was lost since is broken for good: its
  survivors keep its dead context, and the key-value store keeps the keys
  the dead incarnation set, which its relaunched process cannot set again.
  """
  out: dict[str, int | None] = {}
  for devices in _grids(tree):
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(devices)
    procs = np.vectorize(lambda d: d.process_index,
                         otypes=[np.int64])(devices)
    ndim = ids.ndim
    for r in range(1, ndim + 1):
      for axes in itertools.combinations(range(ndim), r):
        size = int(np.prod([ids.shape[a] for a in axes]))
        if size < 2:
          continue
        to_end = lambda a: np.moveaxis(  # pylint: disable=cell-var-from-loop
            a, axes, range(ndim - r, ndim)).reshape(-1, size)
        for row, held in zip(to_end(ids), to_end(procs)):
          out[_name(row)] = int(held[0]) if (held == held[0]).all() else None
  return out


def split_groups(tree: Any) -> int:
  """How many groups of the inner axes of `tree`'s meshes span several
  processes: the model pairs of a (data, model) mesh, say, whose
  collectives run at every step and should not cross the network. The
  inner axes of a mesh are its last ones whose groups fit in one process
  (the product of their sizes at most the devices each process has in
  it); a mesh whose last axis alone is larger has none."""
  split = 0
  for devices in _grids(tree):
    procs = np.vectorize(lambda d: d.process_index,
                         otypes=[np.int64])(devices)
    per_process = int(np.unique(procs, return_counts=True)[1].min())
    size, inner = 1, 0
    for n in reversed(procs.shape):
      if size * n > per_process:
        break
      size, inner = size * n, inner + 1
    if procs.ndim < 2 or size < 2:
      continue  # A 1-D mesh's one axis is the job's: it spans processes.
    rows = procs.reshape(-1, size)
    split += int((rows != rows[:, :1]).any(axis=1).sum())
  return split


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
  return keys.Generation(key, gen).watch


def lists_key(key: str, gen: int) -> str:
  """Where generation `gen` of the group of `key` records its
  `device_lists` (each with the process that holds it alone, if one)."""
  return keys.child(key, "lists", gen)


class Used(NamedTuple):
  """The device lists earlier generations used, as a new one sees them."""
  broken: set[str]  # Not to be used again.
  # One process's alone, that process a member ever since: to be used
  # again rather than another order of its devices, which is then still
  # new to a later incarnation of it (the next one may need it).
  kept: dict[str, int]


def used_lists(coord: coordinator_lib.Coordinator, key: str, before: int,
               members: Any, first: dict[str, int | None] | None = None
               ) -> Used:
  """The device lists that generation `before`, of `members`, must not use
  (`broken`): every list an earlier generation recorded (and those of
  `first`, the job's first meshes), but a list of one process's devices
  alone when that process was a member of every generation since (the
  same incarnation, never lost): its collectives never waited for another
  process, and the rendezvous keys it left are its own (`kept`). Any other
  list may have taken part in a collective with a process lost since, or
  may meet the keys a dead incarnation left (see `mesh_lists`)."""
  history: dict[int, set[int]] = {}
  for k, text in coord.kv_dir(keys.child(key, "groups")).items():
    history[keys.index(k)] = set(json.loads(text)[0])
  records = [(0, first or {})]
  for k, text in coord.kv_dir(keys.child(key, "lists")).items():
    gen, lists = keys.index(k), json.loads(text)
    if gen < before:
      records.append((gen, lists if isinstance(lists, dict)
                      else dict.fromkeys(lists)))
  members = set(members)
  broken: set[str] = set()
  kept: dict[str, int] = {}
  for gen, lists in records:
    # Processes that stayed from generation `gen` to this one.
    stayed = set(members)
    for g in range(gen, before):
      stayed &= history.get(g, set(range(coord.process_count))
                            if g == 0 else set())
    for n, p in lists.items():
      if p is None or p not in stayed:
        broken.add(n)
      else:
        kept[n] = p
  for n in broken:
    kept.pop(n, None)
  return Used(broken, kept)


def _orders(members: list[int], gen: int, devices: list[Any] | None
            ) -> Iterator[list[Any]]:
  """`device_order`'s order first, then every rotation forwards and
  reversed in turn with orders drawn with `gen` and a count as the seed
  that keep each process's devices side by side (the processes in a drawn
  order, each one's devices in a drawn order: a mesh's inner axes then
  stay inside processes), then any permutation so drawn; each once."""
  if devices is None:
    devices = jax.devices()
  seen = set()
  ours = [d for d in devices if d.process_index in members]
  n = len(ours)
  firsts = [device_order(members, gen, devices)]
  firsts += [(ours[::-1] if rev else ours)[k:] + (ours[::-1] if rev
                                                  else ours)[:k]
             for rev in (False, True) for k in range(n)]
  by_process: dict[int, list[Any]] = {}
  for d in ours:
    by_process.setdefault(d.process_index, []).append(d)
  blocks = list(by_process.values())

  def side_by_side(rng: np.random.Generator) -> list[Any]:
    return [block[i] for b in rng.permutation(len(blocks))
            for block in [blocks[b]] for i in rng.permutation(len(block))]

  together = (side_by_side(np.random.default_rng([gen, c, 1]))
              for c in range(4 * n))
  drawn = ([ours[i] for i in np.random.default_rng([gen, c]).permutation(n)]
           for c in itertools.count())
  # `device_order`'s first, then the rotations and the orders side by side
  # in turn: with many devices, the rotations alone would fill the tries.
  turns = itertools.chain.from_iterable(itertools.zip_longest(
      firsts[1:], together))
  for order in itertools.chain(firsts[:1], (o for o in turns if o),
                               drawn):
    ids = tuple(d.id for d in order)
    if ids not in seen:
      seen.add(ids)
      yield order


def choose_order(members: list[int], gen: int,
                 build: Callable[[list[Any]], Any], used: set[str] | Used,
                 *, devices: list[Any] | None = None, tries: int = 64
                 ) -> tuple[list[Any], Any, dict[str, int | None]]:
  """The devices of `members` in an order for generation `gen` whose
  target, `build(order)`, uses none of the device lists `used` (a set, or
  `Used.broken`; see `mesh_lists`), splits the fewest groups of its
  meshes' inner axes over processes (`split_groups`), and then uses the
  fewest new lists of one process's devices where that process has lists
  it may use again (`Used.kept`). The first of `_orders` that does none
  of these (so that a 1-D mesh gets `device_order`'s), else the best of
  the first `tries`. Returns (order, target, its `device_lists`); the
  target is built last from the order returned (`build` may keep what it
  built, a jitted step, say). If none of the orders avoids the broken
  lists, the one that reuses fewest, with a warning.
  """
  broken, kept = (used.broken, used.kept) if isinstance(used, Used) else (
      used, {})
  keepers = set(kept.values())
  best = None  # (clash, split, new, order)
  for order in itertools.islice(_orders(members, gen, devices), tries):
    target = build(order)
    lists = device_lists(target)
    score = (len(broken.intersection(lists)), split_groups(target),
             sum(p in keepers and n not in kept for n, p in lists.items()))
    if score == (0, 0, 0):
      return order, target, lists
    if best is None or score < best[:3]:
      best = (*score, order)
  clash, split, _, order = best
  if clash:
    log.warning("no order of the group's devices avoids every device list"
                " an earlier generation used: %d of this one's were used"
                " before, and their collectives may fail", clash)
  elif split:
    log.info("%d groups of the meshes' inner axes span processes in this"
             " generation's device order (every order that keeps them"
             " inside one would reuse a broken device list)", split)
  target = build(order)
  return order, target, device_lists(target)


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
                 poll_secs: float, *, look_secs: float = 0.25) -> None:
  """Shows a relaunched process to the survivors of its loss.

  The process came back before the survivors dropped it: their watcher
  polls the live processes with it among them, and each poll waits for
  every live one of them (`liveness`), this new process too. One poll
  with them shows them its new incarnation (they then recover without
  it, see `next_group_without`). Once their watcher reported the loss,
  they no longer poll that way, and a poll would wait for nobody: it is
  not made where the loss is recorded already, and stops being waited
  for as soon as it is (the survivors may record it while this process
  polls; the poll, left to its deadline, would keep this process from
  asking to join for all of `poll_secs`, while the survivors train on).

  Args:
    coord: the relaunched process's coordinator.
    key: the elastic group's key.
    group: the newest recorded group (this process among its members).
    poll_secs: how long the poll may wait for the survivors.
    look_secs: how often the loss's record is looked for meanwhile.
  """
  at = keys.Generation(key, group.gen)

  def lost() -> bool:
    return at.lost in coord.kv_dir(at.key)

  if lost():
    return
  done, failed = threading.Event(), []

  def poll() -> None:
    try:
      coord.live_processes(list(group.members), timeout_secs=poll_secs)
    except Exception as e:  # pylint: disable=broad-except
      failed.append(e)
    finally:
      done.set()

  # (A poll that is no longer waited for ends at its own deadline.)
  threading.Thread(target=poll, name="flax_ckpt_plugin-show-restart",
                   daemon=True).start()
  while not done.wait(look_secs):
    if lost():
      return
  if failed:
    log.warning("process %d: the survivors did not poll with it (%r)",
                coord.process_index, failed[0])


def next_group_without(meeting: meetings.Meeting, group: Group) -> Group:
  """The first recorded group after `group` that this process is not a
  member of: the survivors' group once they recovered without it."""
  coord = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  while coord.process_index in group.members:
    members, gen, primary = json.loads(coord.kv_get(
        keys.child(key, "groups", group.gen + 1), timeout_ms=timeout_ms))
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
  coord.kv_set(keys.child(key, "plan"), json.dumps([step, survivors, members]))


def read_plan(meeting: meetings.Meeting, asked: str
              ) -> tuple[int, list[int], list[int]]:
  """A relaunched process that asked to join (`asked`, `ask_to_join`):
  the survivors' plan recorded under `key` (`record_plan`), waited for up
  to `timeout_ms`. Where it does not come, the request is withdrawn: left
  behind, it would have the survivors plan to take back a process that
  gave up, wait out their barriers for it, and then refuse every request
  to their group."""
  coord = meeting.coordinator
  key = meeting.key
  timeout_ms = meeting.timeout_ms
  try:
    step, survivors, members = json.loads(coord.kv_get(
        keys.child(key, "plan"), timeout_ms=timeout_ms))
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
    coord.kv_set(keys.of_process(keys.child(key, "by"), me),
                 json.dumps([propose, sorted(joining)]))
  found = coord.kv_dir(keys.child(key, "result"))
  if not found and me == group.members[0]:
    votes = [json.loads(v)
             for v in coord.kv_dir(keys.child(key, "by")).values()]
    if len(votes) == len(group.members):
      result = json.dumps([max(v[0] for v in votes),
                           sorted(set().union(*(v[1] for v in votes)))])
      coord.kv_set(keys.child(key, "result", "0"), result)
      found = {keys.child(key, "result", "0"): result}
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
                       group: Group, state: Any, *, record: bool
                       ) -> dict[str, int | None]:
  """The device lists of the meshes of the state a job starts from (see
  `used_lists`); the group's first member records them (if `record`),
  where a relaunched process reads them."""
  lists = device_lists(state)
  name = lists_key(key, 0)
  if (record and lists and coord.process_index == group.members[0]
      and name not in coord.kv_dir(keys.child(key, "lists"))):
    coord.kv_set(name, json.dumps(lists, sort_keys=True))
  return lists


def choose(group: Any, key: str, gen: int, build: Callable[[list[Any]], Any],
           first_lists: dict[str, int | None]
           ) -> tuple[list[Any], Any, dict[str, int | None]]:
  """The devices of generation `gen` of the group (a `groups.Survivors`)
  in the order its meshes take (see `choose_order`), the target `build`
  makes on them, and its meshes' device lists; every member chooses the
  same. Lists used before (`used_lists`): those recorded, the first
  state's, and those of `build` on the job's devices in their first order
  (the meshes a job that did not hand its first state would have)."""
  used = used_lists(group, key, gen, group.members,
                    {**device_lists(build(jax.devices())), **first_lists})
  return choose_order(group.members, gen, build, used)


def record(coord: coordinator_lib.Coordinator, key: str, group: Group,
           lists: dict[str, int | None] | None) -> None:
  """The group's first member records it (see `Group`), after the device
  lists of its meshes, so that whoever sees the group sees them."""
  if coord.process_index == group.members[0]:
    if lists:
      coord.kv_set(lists_key(key, group.gen),
                   json.dumps(lists, sort_keys=True))
    text = json.dumps(list(group))
    coord.kv_set(keys.child(key, "groups", group.gen), text)
    coord.kv_set(keys.child(key, "group"), text)
