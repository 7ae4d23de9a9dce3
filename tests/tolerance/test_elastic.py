"""The survivors of a lost process go on training in place (`recover`).

Four real JAX processes (2 CPU devices each) train a data-parallel model
(`mp_workers/elastic.py`, callback made with `elastic=True`) with a local
tier every LOCAL_EVERY steps and the persistent tier every
PERSISTENT_EVERY; JAX's recoverability on, heartbeat HEARTBEAT s, CPU
collectives timing out after COLLECTIVE_TIMEOUT s (the launch settings that
docs/fault_tolerance.md recommends). A random non-zero process SIGKILLs
itself at a random step. The survivors must complete a step on the 6 live
devices within COLLECTIVE_TIMEOUT + 5 s of the kill, without exiting,
resuming from a state bit-identical to the snapshot they saved at that step,
at most LOCAL_EVERY steps before the kill; they run to the end, and every
persistent step of the run restores in a fresh one-process job as the state
the processes held when they saved it. `FLAX_CKPT_PLUGIN_ELASTIC_TRIALS`
sets how many random (victim, step) trials run (1 by default; the
acceptance run is 10).
"""

from __future__ import annotations

import json
import os
import random
import time
import types

import pytest

from flax_ckpt_plugin.tolerance import elastic
from flax_ckpt_plugin.tolerance import generations
from flax_ckpt_plugin.loop import tiers
from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
from launcher import run_workers
from launcher import WorkerGroup

N, HEARTBEAT, COLLECTIVE_TIMEOUT = 4, 3, 8
END, PERSISTENT_EVERY, LOCAL_EVERY = 30, 5, 3
TIMEOUT = 240
TRIALS = int(os.environ.get("FLAX_CKPT_PLUGIN_ELASTIC_TRIALS", "1"))
ENV = {"WORKER_XLA_FLAGS":
       f"--xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT}"}


def _trial(run, victim: int, kill_step: int, env=None,
           coordinator: int | None = None) -> list[dict]:
  """One run with a kill; the survivors' reports (asserted on).
  `coordinator`: the coordination service in a process of its own, with
  this heartbeat timeout (see `launcher.WorkerGroup`)."""
  with WorkerGroup("elastic", N, env=dict(ENV, **(env or {})), args=[
      run, END, PERSISTENT_EVERY, LOCAL_EVERY, victim, kill_step,
      HEARTBEAT], coordinator=coordinator) as g:
    results = g.wait(TIMEOUT, check=False)
  logs = "\n".join(r.log() for r in results)
  assert results[victim].returncode == -9, logs
  reports = []
  for r in results:
    if r.process_id == victim:
      continue
    assert r.returncode == 0, logs  # Never exited: ran to the end.
    reports.append(r.json)
  for report in reports:
    (recovery,) = report["recoveries"]
    assert recovery["devices"] == 2 * (N - 1), logs
    assert recovery["first_step_secs"] < COLLECTIVE_TIMEOUT + 5, (recovery,
                                                                 logs)
    step = recovery["step"]
    assert 0 <= kill_step - step <= LOCAL_EVERY, (kill_step, recovery)
    # The in-memory snapshot it saved at that step, before the kill.
    assert recovery["digest"] == report["saved"][f"0/{step}"], logs
    assert report["step"] == END
  assert len({json.dumps(r["recoveries"][0]["step"]) for r in reports}) == 1
  assert len({r["digest"] for r in reports}) == 1, logs
  for r in results:  # The whole log: the tails above are cut.
    if r.process_id != victim:
      assert "recovered in place at step" in r.stderr, logs
  return reports


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT * (2 * TRIALS + 1) + 60)
def test_survivors_recover_in_place_and_every_persistent_step_restores(
    tmp_path):
  rng = random.Random(22)
  table = []
  for trial in range(TRIALS):
    victim = rng.randrange(1, N)
    kill_step = rng.randrange(LOCAL_EVERY + 1, END - 1)
    run = tmp_path / f"trial{trial}"
    reports = _trial(run, victim, kill_step)
    (verified,) = [r.json for r in run_workers(
        "elastic", 1, args=["verify", run], timeout=TIMEOUT)]
    steps = sorted(int(s) for s in verified)
    assert steps and steps[-1] == END, steps
    assert any(s > kill_step for s in steps), steps  # Saved while degraded.
    for s in steps:  # The state held at that save, in either generation.
      held = {d for k, d in reports[0]["saved"].items()
              if k.endswith(f"/{s}")}
      assert verified[str(s)] in held, (s, verified, reports[0]["saved"])
    recovery = reports[0]["recoveries"][0]
    table.append((victim, kill_step, recovery["step"],
                  round(max(r["recoveries"][0]["first_step_secs"]
                            for r in reports), 2)))
  print("victim, killed at, resumed at, first step after the kill (s):",
        *table, sep="\n")


PARTNER_TRIALS = int(os.environ.get("FLAX_CKPT_PLUGIN_PARTNER_TRIALS", "1"))


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT * (2 * PARTNER_TRIALS) + 60)
@pytest.mark.parametrize("mesh", [
    "data",
    # The 2-D mesh runs in the two-loss test below (CI's time); the
    # acceptance run sets FLAX_CKPT_PLUGIN_PARTNER_MESHES=data,model_procs.
    *[m for m in os.environ.get("FLAX_CKPT_PLUGIN_PARTNER_MESHES",
                                "").split(",") if m and m != "data"]])
def test_survivors_recover_a_sharded_state_from_partner_copies(tmp_path,
                                                               mesh):
  """Parameters and Adam's moments split over every device (FSDP over
  "data"; or over a "model" axis across the processes of a 2-D mesh whose
  "data" axis stays inside each), so that the lost process held the only
  copy of its shards, with `replicas=1`: the survivors rebuild its shards
  from the partner copies in their local tiers and go on, on 6 devices,
  from the whole state they saved at that step, bit for bit, within the
  collective timeout + 5 s; every persistent step restores as the state
  they held. FLAX_CKPT_PLUGIN_PARTNER_TRIALS sets the trials per mesh (1
  by default; the acceptance run is 10, with both meshes)."""
  rng = random.Random(52 if mesh == "data" else 53)
  table = []
  env = {"ELASTIC_LAYOUT": "fsdp", "ELASTIC_MESH": mesh,
         "ELASTIC_REPLICAS": "1", "DIE_DELAY_SECS": "1"}
  for trial in range(PARTNER_TRIALS):
    victim = rng.randrange(1, N)
    kill_step = rng.randrange(LOCAL_EVERY + 1, END - 1)
    run = tmp_path / f"trial{trial}"
    reports = _trial(run, victim, kill_step, env)
    (verified,) = [r.json for r in run_workers(
        "elastic", 1, args=["verify", run], env=env, timeout=TIMEOUT)]
    steps = sorted(int(s) for s in verified)
    assert steps and steps[-1] == END, steps
    for s in steps:
      held = {d for k, d in reports[0]["saved"].items()
              if k.endswith(f"/{s}")}
      assert verified[str(s)] in held, (s, verified, reports[0]["saved"])
    recovery = reports[0]["recoveries"][0]
    table.append((victim, kill_step, recovery["step"],
                  round(max(r["recoveries"][0]["first_step_secs"]
                            for r in reports), 2)))
  print("victim, killed at, resumed at, first step after the kill (s):",
        *table, sep="\n")


TWO_LOST_END = 16


def _two_lost(run, replicas: int, victims: tuple[int, int], kill_step: int,
              mesh: str = "data"):
  env = dict(ENV, ELASTIC_LAYOUT="fsdp", ELASTIC_REPLICAS=str(replicas),
             ELASTIC_ALSO=str(victims[1]), ELASTIC_MESH=mesh,
             DIE_DELAY_SECS="1")
  with WorkerGroup("elastic", N, env=env, args=[
      run, TWO_LOST_END, PERSISTENT_EVERY, LOCAL_EVERY, victims[0],
      kill_step, HEARTBEAT]) as g:
    results = g.wait(TIMEOUT, check=False)
  logs = "\n".join(r.log() for r in results)
  assert [results[v].returncode for v in victims] == [-9, -9], logs
  return [r for r in results if r.process_id not in victims], logs


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_two_processes_lost_at_once_are_recovered_with_two_replicas(
    tmp_path):
  """A 2-D (data, model) mesh whose model axis spans the processes (each
  model shard held by one process only) with `replicas=2`: processes 1
  and 3 die at the same step; the two survivors rebuild every shard from
  their own and their partner copies and go on, on 4 devices, from the
  state they saved at that step, bit for bit."""
  survivors, logs = _two_lost(tmp_path, 2, (1, 3), 11, mesh="model_procs")
  for r in survivors:
    assert r.returncode == 0, logs
    (recovery,) = r.json["recoveries"]
    assert recovery["devices"] == 4, logs
    assert 0 <= 11 - recovery["step"] <= LOCAL_EVERY, recovery
    assert recovery["digest"] == r.json["saved"][f"0/{recovery['step']}"]
    assert r.json["step"] == TWO_LOST_END
  assert len({r.json["digest"] for r in survivors}) == 1, logs


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_a_process_lost_with_its_partner_is_a_clear_error(tmp_path):
  """FSDP over 8 devices with `replicas=1` (one failure domain: process
  p's partner is p + 1): processes 1 and 2 die together, and with them
  both copies of process 1's shards. The survivors restore nothing partial:
  `recover` raises the loop's error with a note that names both processes
  and the step the persistent tier resumes from, and they exit for a
  relaunch."""
  survivors, logs = _two_lost(tmp_path, 1, (1, 2), 11)
  persistent = max(int(p.name) for p in (tmp_path / "ckpt").iterdir()
                   if p.name.isdigit())
  for r in survivors:
    assert r.returncode == PREEMPTED_EXIT_CODE, logs
    assert "processes [1, 2] were lost together" in r.stderr, logs
    assert (f"the job resumes from step {persistent} of the persistent"
            " tier") in r.stderr, logs
    assert "recovered in place" not in r.stderr, logs


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_survivors_that_lack_a_shard_do_not_recover_and_exit_to_relaunch(
    tmp_path):
  """The first kernel's columns are split over all 8 devices: the lost
  process held the only copy of its columns, so the survivors cannot
  restore on their 6 devices. `recover` raises the loop's error again (a
  note says why), the loop ends, and the survivors end with
  PREEMPTED_EXIT_CODE for a relaunch (nothing to save: they do not hold
  every shard either)."""
  victim, kill_step = 2, 11
  with WorkerGroup("elastic", N, env=dict(ENV, ELASTIC_LAYOUT="sharded"),
                   args=[tmp_path, END, PERSISTENT_EVERY, LOCAL_EVERY,
                         victim, kill_step, HEARTBEAT]) as g:
    results = g.wait(TIMEOUT, check=False)
  logs = "\n".join(r.log() for r in results)
  assert results[victim].returncode == -9, logs
  for r in results:
    if r.process_id != victim:
      assert r.returncode == PREEMPTED_EXIT_CODE, logs
      assert "recover() could not go on without [2]" in r.stderr, logs
      assert "recovered in place" not in r.stderr, logs


REJOIN_END = 60


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT + 60)
@pytest.mark.parametrize("when,primary,mesh,victim,coordinator", [
    ("at_once", 2, "model_in", 2, None),
    ("after_recovery", 0, "model_across", 2, None),
    ("after_recovery", 0, "fsdp", 2, None),
    # Process 0 itself, with the coordination service in a process of its
    # own (`flax-ckpt coordinator`): it rejoins like any other.
    ("after_recovery", 0, "model_in", 0, HEARTBEAT),
    ("after_recovery", 0, "fsdp", 0, HEARTBEAT)])
def test_a_relaunched_process_rejoins_from_its_peers(tmp_path, when,
                                                     primary, mesh, victim,
                                                     coordinator):
  """Process 2 (or 0) dies at step 9; the test relaunches it, as a launcher
  replacing a machine would: at once (it connects before the survivors
  noticed the loss, and their watcher must see its new incarnation), or
  once they recovered in place. In the first case process 2 is the
  persistent tier's primary: the survivors' lowest process writes and
  finalizes while it is gone, and the relaunched one must not claim the
  directory before it rejoins. The survivors take the new process back
  at a step they agree on: it receives their state over collectives (no
  persistent restore), all four then hold bit-identical replicas at every
  step, and every persistent step of the run restores as the state held
  when it was saved. "fsdp": the state split over every device with
  partner copies (`replicas=1`): the survivors recover from the copies on
  6 devices, and the newcomer gets the state split over 8 again from
  what the survivors hold, own shards and partner copies."""
  kill_step = 9
  layout = dict(ELASTIC_LAYOUT="fsdp", ELASTIC_REPLICAS="1",
                DIE_DELAY_SECS="1") if mesh == "fsdp" else dict(
                    ELASTIC_MESH=mesh)
  with WorkerGroup("elastic", N, env=dict(
      ENV, ELASTIC_REJOIN="1", ELASTIC_PRIMARY=str(primary),
      **layout), args=[
      tmp_path, REJOIN_END, PERSISTENT_EVERY, LOCAL_EVERY, victim,
      kill_step, HEARTBEAT], coordinator=coordinator) as g:
    end = time.monotonic() + TIMEOUT
    while g.running(victim) and time.monotonic() < end:
      time.sleep(0.05)
    while when == "after_recovery" and time.monotonic() < end and not all(
        "recovered in place" in r.stderr for r in g.results()
        if r.process_id != victim):
      time.sleep(0.05)
    relaunched_at = time.time()
    g.relaunch(victim)
    results = g.wait(TIMEOUT, check=False)
  logs = "\n".join(r.log() for r in g.earlier[victim] + results)
  assert g.earlier[victim][0].returncode == -9, logs
  assert all(r.returncode == 0 for r in results), logs
  reports = [r.json for r in results]
  newcomer = reports[victim]
  assert newcomer["tier"] == "peer", logs
  assert not newcomer["read_persistent"], logs
  (joined,) = newcomer["rejoins"]
  for p, report in enumerate(reports):
    assert report["step"] == REJOIN_END and report["devices"] == 2 * N, logs
    if p != victim:
      (recovery,) = report["recoveries"]
      (rejoin,) = report["rejoins"]
      assert recovery["step"] <= kill_step, report
      assert recovery["step"] < rejoin["step"], report
      assert rejoin["step"] == joined["step"], (rejoin, joined)
      assert rejoin["devices"] == 2 * N, logs
      assert "rejoined at step" in results[p].stderr, logs
  # Bit-identical replicas at every step from the rejoin to the end.
  steps = range(joined["step"], REJOIN_END + 1)
  for s in steps:
    assert len({r["digests"][str(s)] for r in reports}) == 1, (s, logs)
  survivor = reports[1 if victim == 0 else 0]  # Saved every step.
  assert joined["digest"] == survivor["digests"][str(joined["step"])]
  (verified,) = [r.json for r in run_workers(
      "elastic", 1, args=["verify", tmp_path], env=layout, timeout=TIMEOUT)]
  persisted = sorted(int(s) for s in verified)
  assert persisted[-1] == REJOIN_END, persisted
  for s in persisted:
    held = {d for k, d in survivor["saved"].items() if k.endswith(f"/{s}")}
    assert verified[str(s)] in held, (s, verified, survivor["saved"])
  print(f"relaunch to the newcomer's first step:"
        f" {joined['first_step_at'] - relaunched_at:.2f}s; rejoined at step"
        f" {joined['step']}")


class _Watcher:
  """A watcher that saw no loss (a fake: the real one needs a dead peer)."""
  lost: dict = {}
  members = [0, 1]
  closed = False


def _peers(watcher, local) -> elastic.Peers:
  """Peers of a process that rejoins (so that it starts no watcher of its
  own), given a fake `watcher`."""
  coord = types.SimpleNamespace(process_count=2, process_index=1)
  peers = elastic.Peers(
      types.SimpleNamespace(coordinator=coord), local, "/tmp/x",
      poll_secs=0.5, exit_code=75, elastic_secs=1.0, primary_host=0,
      group=generations.Group((0,), 1, 0), watch=None)
  peers.watcher, peers.rescue = watcher, object()
  return peers


def test_recover_raises_an_error_no_lost_peer_explains_at_once():
  error = ValueError("a bug in the loop")
  with pytest.raises(ValueError, match="a bug in the loop") as info:
    _peers(_Watcher(), object()).recover(None, error, None)
  assert info.value is error
  assert "no process was lost" in " ".join(info.value.__notes__)


def test_recover_needs_an_elastic_callback_with_a_local_tier():
  error = RuntimeError("collective failed")
  with pytest.raises(RuntimeError) as info:
    _peers(_Watcher(), None).recover(None, error, None)
  assert "elastic=True" in " ".join(info.value.__notes__)


def test_a_relaunched_process_is_placed_on_the_groups_device_order():
  """`on_devices` moves a state's mesh onto the new order position for
  position; a leaf without a NamedSharding is named."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  order = generations.device_order([0], 1)
  assert order == devices[1:] + devices[:1]
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = {"w": jax.device_put(np.ones((4,), np.float32), sharding)}
  moved = generations.on_devices(state, order)
  assert list(moved["w"].sharding.mesh.devices.flat) == order
  assert moved["w"].shape == (4,)
  with pytest.raises(ValueError, match="'w'"):
    generations.on_devices({"w": jax.device_put(np.ones(2), devices[0])}, order)
  # Each generation of a group runs on a device list none before used
  # (8 devices of 4 processes, as the tests' jobs).
  job = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(8)]
  orders = [tuple(d.id for d in generations.device_order([0, 1, 2, 3], g, job))
            for g in range(40)]
  assert orders[0] == tuple(range(8)) and len(set(orders)) == len(orders)
  assert [d.id for d in generations.device_order([0, 1, 3], 1, job)] == [
      1, 2, 3, 6, 7, 0]


def _fake_state(layout: str):
  """A make_target over fake devices: a (data, model) mesh whose model
  pairs are adjacent in the order ("model_in": one process's two devices
  in the first order) or half the order apart ("model_across")."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  def make(devices):
    grid = np.empty(len(devices), object)
    grid[:] = devices
    grid = grid.reshape(-1, 2) if layout == "model_in" else grid.reshape(
        2, -1).T
    mesh = types.SimpleNamespace(devices=grid)
    return {"w": types.SimpleNamespace(
        sharding=types.SimpleNamespace(mesh=mesh))}
  return make


@pytest.mark.parametrize("layout", ["model_in", "model_across"])
def test_no_generation_reuses_a_device_list_of_an_earlier_ones_meshes(layout):
  """A (data, model) mesh: the order `device_order` gives a rejoin (a
  rotation by 2) puts the model pairs back on the lists of the first
  generation, whose rendezvous keys the dead process left behind; the
  order chosen reuses no list of any earlier generation's meshes (every
  model pair, data column and the whole mesh), through losses and
  rejoins."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  job = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(8)]
  make = _fake_state(layout)
  used = generations.mesh_lists(make(job))
  assert len(used) == 4 + 2 + 1  # Model pairs, data columns, all.
  naive = generations.mesh_lists(make(generations.device_order([0, 1, 2, 3], 2, job)))
  if layout == "model_in":
    assert naive & used  # What failed before.
  history = [[0, 1, 3], [0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3], [0, 2, 3],
             [0, 1, 2, 3]]
  for gen, members in enumerate(history, 1):
    order, target, lists = generations.choose_order(members, gen, make, used,
                                               devices=job)
    assert lists == generations.device_lists(target), gen
    assert not set(lists) & used, gen
    assert sorted(d.id for d in order) == [
        d.id for d in job if d.process_index in members]
    used |= set(lists)
  # A 1-D mesh keeps device_order's order: its one list is always new.
  one_d = lambda devices: {"w": types.SimpleNamespace(  # pylint: disable=g-long-lambda
      sharding=types.SimpleNamespace(mesh=types.SimpleNamespace(
          devices=np.array(devices, object))))}
  order, _, _ = generations.choose_order([0, 1, 2, 3], 2, one_d,
                                    generations.mesh_lists(one_d(job)), devices=job)
  assert order == generations.device_order([0, 1, 2, 3], 2, job)


def test_six_generations_keep_every_model_pair_inside_a_process():
  """A (data, model) mesh of 4 processes x 2 devices, through 3 losses and
  3 rejoins: every generation's model pairs stay inside one process (their
  collectives run at every step; across processes they would cross the
  network), and no generation uses a list that may be broken: a list used
  before is used again only if it is one process's alone and that process
  was a member of every generation since (never lost, so the same
  incarnation, whose own communicator and rendezvous keys they are)."""
  from fake_coordinator import FakeCluster  # pylint: disable=g-import-not-at-top
  job = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(8)]
  make = _fake_state("model_in")
  coord = FakeCluster(4).coordinators()[0]
  key = generations.group_key("six")
  first = generations.device_lists(make(job))
  assert generations.split_groups(make(job)) == 0
  generations.record(coord, key, generations.Group((0, 1, 2, 3), 0, 0), first)
  groups, seen = {0: {0, 1, 2, 3}}, {n: [(0, p)] for n, p in first.items()}
  history = [[0, 1, 3], [0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3], [0, 2, 3],
             [0, 1, 2, 3]]
  for gen, members in enumerate(history, 1):
    used = generations.used_lists(coord, key, gen, members)
    order, target, lists = generations.choose_order(members, gen, make, used,
                                                    devices=job)
    assert generations.split_groups(target) == 0, (gen, order)
    pairs = [tuple(d.process_index for d in row)
             for row in target["w"].sharding.mesh.devices]
    assert all(a == b for a, b in pairs), (gen, pairs)
    for name, holder in lists.items():
      for earlier, _ in seen.get(name, []):
        assert holder is not None and all(
            holder in groups[g] for g in range(earlier, gen)), (gen, name)
      seen.setdefault(name, []).append((gen, holder))
    groups[gen] = set(members)
    generations.record(coord, key,
                       generations.Group(tuple(members), gen, members[0]),
                       lists)


def test_a_relaunched_primary_opens_its_tiers_as_another_process():
  """The relaunched process must not claim the directory the survivors
  write to, even when the user made it the primary."""
  assert generations.Group((0, 1, 2, 3), 0, 2).opening_primary(2) == 0
  assert generations.Group((0, 1, 3), 1, 0).opening_primary(2) == 0
  assert generations.Group((1, 3), 2, 1).opening_primary(1) == 3


def test_recover_outside_an_except_block_says_how_to_call_it():
  with pytest.raises(RuntimeError, match="except"):
    tiers.caught_error()
