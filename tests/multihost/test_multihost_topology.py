"""Multi-process checkpoints across topologies, managers and failures.

Real JAX processes on 127.0.0.1, started by `launcher.run_workers` with a
per-run number of CPU devices per process (`devices_per_process`); the
workers live in `tests/mp_workers/` (`_topology.py` holds their model,
meshes and PartitionSpecs) and print their results as JSON. Every run has a
deadline: a hung worker fails the test with every worker's output.

Values are compared by sha256 of each leaf's full global array, taken by the
writer right after it saved.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal

import pytest

from helpers import assert_only_finalized_steps
from helpers import sorted_entries
from launcher import format_logs
from launcher import run_workers

pytestmark = pytest.mark.multiprocess

# Deadline of one run: each process imports jax (~3 s) and 4 processes share
# this machine's 2 cores; the states are tiny.
RUN_TIMEOUT = 120
STEP = 2  # The step that `topology_write.py` saves.


def _data_file(p: int) -> str:
  return f"data/process_{p:05d}.bin"


def _write(ckpt: pathlib.Path, num_processes: int, mesh: str) -> list[dict]:
  return [r.json for r in run_workers(
      "topology_write", num_processes, args=[ckpt, mesh],
      timeout=RUN_TIMEOUT, devices_per_process=2)]


@pytest.fixture(scope="module")
def written_4x2(tmp_path_factory) -> tuple[pathlib.Path, list[dict]]:
  """Step 2 saved by 4 processes x 2 devices on a (2, 4) mesh.

  In that mesh the 'model' axis spans processes 0-1 (data row 0) and 2-3
  (data row 1), so each shard of a leaf split on 'model' only is held by
  two processes, and one of them writes it (`division`).
  """
  ckpt = tmp_path_factory.mktemp("written_4x2") / "ckpt"
  return ckpt, _write(ckpt, 4, "2x4")


# --- 1. Every byte is written once, by the process the plan gives it. ------


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("num_processes,mesh", [(4, "2x4"), (2, "2x2")],
                         ids=["4x2_devices", "2x2_devices"])
def test_each_byte_is_written_once_by_its_writer(request, tmp_path,
                                                 num_processes, mesh):
  """Data files hold exactly the global arrays, each byte once.

  A TrainState (3 Dense layers, adam) trained 2 steps on a ('data', 'model')
  mesh, with kernels split on both axes, on one, and replicated leaves
  (biases, step, count), is saved by every process. Each process writes one
  file whose size is its `last_save_stats.process_bytes`; the files add up to the
  bytes of all global arrays, and per leaf the manifest places each process's
  bytes in its own file as `division` assigns them (these shards are
  small, so each is written whole by one of its holders).
  """
  if num_processes == 4:
    ckpt, out = request.getfixturevalue("written_4x2")
  else:
    ckpt = tmp_path / "ckpt"
    out = _write(ckpt, num_processes, mesh)

  digests = out[0]["digests"]
  array_bytes = out[0]["array_bytes"]
  total = sum(array_bytes.values())
  for p, o in enumerate(out):
    assert o["step"] == STEP and o["all_steps"] == [STEP], p
    assert o["digests"] == digests, p  # Every process sees the same values.

  assert_only_finalized_steps(ckpt, [STEP])
  step_dir = ckpt / str(STEP)
  files = [_data_file(p) for p in range(num_processes)]
  # One data file per process; the per-process shard tables were merged.
  assert sorted_entries(step_dir / "data") == [f.split("/")[1] for f in files]
  sizes = [(step_dir / f).stat().st_size for f in files]
  assert sizes == [o["saved_nbytes"] for o in out]
  assert sizes == [sum(o["owned_bytes"].values()) for o in out]
  assert all(sizes), sizes  # Every process owns a shard of some kernel.
  assert sum(sizes) == total, (sizes, total)  # No byte written twice.

  manifest = json.loads((step_dir / "manifest.json").read_text())
  assert manifest["process_count"] == num_processes
  assert manifest["files"] == dict(zip(files, sizes))
  leaves = {l["path"]: l for l in manifest["leaves"]}
  assert set(leaves) == set(array_bytes)
  for path, leaf in leaves.items():
    by_file = {}
    for shard in leaf["shards"]:
      by_file[shard["file"]] = by_file.get(shard["file"], 0) + shard["nbytes"]
    owners = {files[p]: o["owned_bytes"][path] for p, o in enumerate(out)
              if o["owned_bytes"][path]}
    assert by_file == owners, path
    assert sum(by_file.values()) == array_bytes[path], path
  for path in ("step", "opt_state/0/count", "params/Dense_1/bias",
               "params/Dense_2/bias"):  # Replicated everywhere.
    assert len({s["file"] for s in leaves[path]["shards"]}) == 1, path

  # Restored by the writer itself: bit-identical, on the writer's shardings;
  # a region that both local devices hold (replicated leaves) is read once.
  for p, o in enumerate(out):
    assert o["restored"] == digests, p
    assert o["restored_on_target_shardings"], p
    assert o["nbytes_read"] == sum(o["needed_bytes"].values()), p
    assert o["needed_bytes"]["params/Dense_2/bias"] == (
        array_bytes["params/Dense_2/bias"]), p
    assert o["nbytes_read"] < total, p


# --- 2. Restored into other topologies, in fresh processes. ----------------

# Leaves that a layout on the (1, 2) mesh of 2 x 1 devices splits between the
# two processes (params and their adam moments alike); the others are
# replicated. 'data' has size 1 there, so P('data', None) is replicated.
_SPLIT_ON_2X1 = {
    "same": {"Dense_0/kernel", "Dense_0/bias", "Dense_1/kernel"},
    "alt": {"Dense_0/kernel", "Dense_1/kernel", "Dense_1/bias",
            "Dense_2/kernel", "Dense_2/bias"},
}


def _is_split(path: str, layout: str) -> bool:
  return "/".join(path.split("/")[-2:]) in _SPLIT_ON_2X1.get(layout, ())


@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
@pytest.mark.parametrize(
    "num_processes,mesh,layouts",
    [(2, "1x2", ["same", "alt"]), (1, "1", ["plain"])],
    ids=["2x1_devices", "1x1_device"])
def test_restore_into_another_topology_reads_only_what_it_needs(
    written_4x2, num_processes, mesh, layouts):
  """A 4 x 2-device checkpoint restores into 2 x 1 and 1 x 1 devices.

  2 x 1: into the writer's PartitionSpecs on a (1, 2) mesh ('same'), and
  into specs the writer never used ('alt': transposed kernels, a kernel cut
  along its last axis, halves of replicated biases). 1 x 1: a plain
  `jax.eval_shape` target without shardings, in one process that never
  starts `jax.distributed`. Each process reads exactly the bytes of the
  distinct regions its target shards need, so two processes each read less
  than the whole checkpoint.
  """
  ckpt, written = written_4x2
  digests = written[0]["digests"]
  array_bytes = written[0]["array_bytes"]
  total = sum(array_bytes.values())
  out = [r.json for r in run_workers(
      "topology_restore", num_processes, args=[ckpt, mesh, ",".join(layouts)],
      timeout=RUN_TIMEOUT, devices_per_process=1)]

  for p, o in enumerate(out):
    assert (o["process_count"], o["local_devices"]) == (num_processes, 1)
    for layout in layouts:
      r = o[layout]
      where = (p, layout)
      assert r["step"] == STEP, where
      assert r["is_train_state"], where
      assert r["on_target_shardings"], where
      assert r["digests"] == digests, where
      assert r["unverified_digests"] == digests, where
      assert r["array_bytes"] == array_bytes, where
      # Unverified: exactly the needed bytes. Verified: whole checksum
      # blocks around them, each read once, never more than the checkpoint.
      assert r["nbytes_read"] == sum(r["needed_bytes"].values()), where
      assert (r["nbytes_read"] <= r["verified_nbytes_read"] <= total), where
      for path, need in r["needed_bytes"].items():
        split = num_processes == 2 and _is_split(path, layout)
        assert need == array_bytes[path] // (2 if split else 1), (where, path)
      if num_processes == 1:
        assert r["nbytes_read"] == total, where  # Every byte, once.
      else:
        assert r["nbytes_read"] < total, where

  if num_processes == 2:
    # The split leaves' halves are disjoint: together, each byte once.
    for layout in layouts:
      split = [k for k in array_bytes if _is_split(k, layout)]
      assert split, layout
      for path in split:
        assert sum(o[layout]["needed_bytes"][path] for o in out) == (
            array_bytes[path]), (layout, path)


# --- 3. Two managers in one program. ---------------------------------------


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_two_managers_interleave_saves_without_sharing_barriers(tmp_path):
  """A "train" and an "ema" manager save at the same steps, concurrently.

  2 processes x 2 devices; both managers commit every step in the
  background at the same time, with default names (from their directories).
  Every barrier key either one used is recorded through `coordinator=`.
  """
  train_dir, ema_dir = tmp_path / "train", tmp_path / "ema"
  out = [r.json for r in run_workers(
      "two_managers", 2, args=[train_dir, ema_dir], timeout=RUN_TIMEOUT)]
  steps = [1, 2, 3, 4]
  p0 = out[0]
  for p, o in enumerate(out):
    assert o["names"] == p0["names"], p  # Same prefixes on every process.
    assert o["saved"] == p0["saved"], p
    for m in ("train", "ema"):
      assert o["all_steps"][m] == steps, (p, m)
      for s in map(str, steps):
        assert o["restored"][m][s] == o["saved"][m][s], (p, m, s)
  assert_only_finalized_steps(train_dir, steps)
  assert_only_finalized_steps(ema_dir, steps)

  # Two different trees, and every step's values differ from the last.
  train4, ema4 = p0["saved"]["train"]["4"], p0["saved"]["ema"]["4"]
  for leaf, digest in ema4.items():
    assert train4[".params" + leaf] != digest, leaf
  for m in ("train", "ema"):
    assert p0["saved"][m]["3"] != p0["saved"][m]["4"], m

  names = p0["names"]
  assert names["train"] != names["ema"]
  for p, o in enumerate(out):
    keys = o["barrier_keys"]
    for m in ("train", "ema"):
      # Opening meets at the directory's key; everything after it at keys
      # named by the writer's identity too.
      opening = names[m].rsplit("/", 1)[0] + "/open"
      assert keys[m][0] == opening, (p, m)
      assert all(k.startswith(names[m] + "/") for k in keys[m][1:]), (p, m)
      for s in steps:
        assert any(f"step{s}/committed" in k for k in keys[m]), (p, m, s)
      assert len(set(keys[m])) == len(keys[m]), (p, m)  # Each used once.
    assert not set(keys["train"]) & set(keys["ema"]), p


# --- 4. A primary host other than process 0. -------------------------------


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_primary_host_1_does_the_primary_duties(tmp_path):
  """With `primary_host=1`, process 1 cleans up, finalizes and prunes.

  The test leaves a stale `7.partial` and an unfinalized `9` in the
  directory before the workers open it; `max_to_keep=2` over steps 1..4
  deletes steps 1 and 2. The library's log lines, prefixed `[process=N]`,
  show which process did what.
  """
  ckpt = tmp_path / "ckpt"
  (ckpt / "7.partial" / "data").mkdir(parents=True)
  (ckpt / "7.partial" / _data_file(0)).write_bytes(b"stale")
  (ckpt / "9").mkdir()
  results = run_workers("primary_host", 2, args=[ckpt], timeout=RUN_TIMEOUT)
  p0, p1 = (r.json for r in results)
  logs = "\n" + format_logs(results)

  assert (p0["is_primary"], p1["is_primary"]) == (False, True)
  for o in (p0, p1):
    assert o["all_steps"] == [3, 4] and o["latest_step"] == 4
    assert o["restored"] == o["saved"]["4"]
    assert o["table_type"] == "ndarray"
  assert p0["saved"] == p1["saved"]
  assert_only_finalized_steps(ckpt, [3, 4])
  # A host numpy value is written by the primary host only.
  manifest = json.loads((ckpt / "4" / "manifest.json").read_text())
  table = next(l for l in manifest["leaves"] if l["path"] == "table")
  assert [s["file"] for s in table["shards"]] == [_data_file(1)]

  err0, err1 = results[0].stderr, results[1].stderr
  for name in ("7.partial", "9"):
    assert re.search(
        r"WARNING flax_ckpt_plugin: \[process=1\]\[thread=MainThread\]"
        rf" removed unfinished checkpoint \S*/{re.escape(name)}\n",
        err1), f"{name}{logs}"
  for step in (1, 2):
    assert re.search(
        r"INFO flax_ckpt_plugin: \[process=1\]\[thread=[^\]]+\] retention"
        rf" deleted step {step} from ", err1), f"{step}{logs}"
  assert "removed unfinished checkpoint" not in err0, logs
  assert "retention deleted step" not in err0, logs


# --- 5. A process killed while it writes. ----------------------------------


@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
@pytest.mark.parametrize("primary_host", [0, 1],
                         ids=["survivor_is_primary", "killed_is_primary"])
def test_kill_during_save_times_out_then_restart_resumes(tmp_path,
                                                         primary_host):
  """SIGKILL in the middle of a save: the survivor fails fast; restart works.

  Injected fault: process 1 sends SIGKILL to itself from inside
  `writer.write_process_files` for step 4 (step 2 was finalized before).
  Process 0 (`barrier_timeout_secs=5`) must get a TimeoutError naming the
  barrier key from its next call into the library, soon after the timeout.
  Step 4 is never finalized. A fresh pair of processes on the same directory
  then resumes from step 2, bit for bit, and the unfinished `4.partial` is
  gone once the manager is open. With `killed_is_primary` the dead process
  was the one that created `4.partial`, so it is left behind until the
  restart; otherwise the surviving primary removes it at once.
  """
  ckpt = tmp_path / "ckpt"
  env = {"PRIMARY_HOST": str(primary_host)}
  results = run_workers(
      "kill_during_save", 2, args=["crash", ckpt], timeout=RUN_TIMEOUT,
      env=env, process_env={1: {"KILL_AT_STEP": "4"}}, check=False)
  logs = "\n" + format_logs(results)
  assert results[1].returncode == -signal.SIGKILL, logs
  assert "SIGKILL while writing" in results[1].stdout, logs
  assert results[0].returncode == 0, logs
  p0 = results[0].json

  error = p0["error"]
  assert error is not None and error["is_timeout"], f"{error}{logs}"
  match = re.search(r"barrier '([^']+)'", error["message"])
  assert match, error["message"]
  key = match.group(1)
  assert key.startswith(p0["manager_name"] + "/") and "step4" in key, key
  timeout = p0["barrier_timeout_secs"]
  assert p0["error_secs"] < timeout + 10, f"{p0['error_secs']}{logs}"
  assert p0["all_steps"] == [2]
  assert "4" not in sorted_entries(ckpt)  # Never finalized.
  assert ("4.partial" in sorted_entries(ckpt)) == (primary_host == 1), logs

  restarted = run_workers("kill_during_save", 2, args=["restart", ckpt],
                          timeout=RUN_TIMEOUT, env=env)
  for p, o in enumerate(r.json for r in restarted):
    assert o["latest_step"] == 2 and o["all_steps"] == [2], p
    assert o["entries_after_open"] == ["2"], p
    assert o["restored_step"] == 2, p
    assert o["restored"] == p0["saved"]["2"], p
  if primary_host == 1:
    assert re.search(r"\[process=1\]\[thread=MainThread\] removed unfinished"
                     r" checkpoint \S*/4\.partial",
                     restarted[1].stderr), format_logs(restarted)
  assert_only_finalized_steps(ckpt, [2])


# --- 6. Replicated state: every process writes its share. -----------------


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("layout", ["data_parallel", "hsdp",
                                    "data_parallel/explicit"])
def test_replicated_state_is_written_in_even_shares(tmp_path, layout):
  """4 processes x 2 devices; a replicated (data-parallel) or HSDP state,
  on a mesh of Auto axes or of Explicit ones (`jax.make_mesh`'s default).

  Replica 0 of every shard of a replicated array lives on process 0, which
  would write everything; the plan cuts the large shards among their
  holders instead. Every byte is written once, the process that writes most
  writes at most 1.25x an even share, and the step restores bit for bit:
  by each process alone (reading all it needs), and by all together, whose
  reads add up to at most 1.25x the checkpoint (`shared_read`).
  """
  out = [r.json for r in run_workers(
      "balanced_write", 4, args=[tmp_path / "ckpt", layout],
      timeout=RUN_TIMEOUT, devices_per_process=2)]
  total = out[0]["total"]
  written = [o["written"] for o in out]
  assert sum(written) == total, written
  assert max(written) <= 1.25 * total / 4, written
  sizes = [(tmp_path / "ckpt" / "1" / _data_file(p)).stat().st_size
           for p in range(4)]
  # The data files hold those bytes, and at most a few KiB of alignment
  # (a piece's file offset follows its buffer's address, see `datafile`).
  assert all(0 <= s - w < 64 << 10 for s, w in zip(sizes, written)), (
      sizes, written)
  for p, o in enumerate(out):
    assert o["restored"] == o["saved"] == out[0]["saved"], p
    assert o["restored_together"] == o["saved"], p
    assert o["step_together"] == 1 and o["on_target_shardings"], p
    assert o["read_alone"] >= total / 2, p  # Its own copy of the state.
  # Restored together, storage serves each byte once.
  read = [o["read_together"] for o in out]
  assert sum(read) <= 1.25 * total, (read, total)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_64_bit_leaf_restores_together_without_x64(tmp_path):
  """An int64 leaf (saved from numpy), restored by 2 processes together
  into an int64 target replicated on every device, with jax_enable_x64 off.

  JAX holds such an array as int32, so the bytes cannot travel through a
  shared read's program; each process reads the leaf alone, as `restore`
  does, rather than fail.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top
  with CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(3, {"w": np.arange(4, dtype=np.int64)})
  out = [r.json for r in run_workers(
      "open_restore", 2, args=[tmp_path / "ckpt", "int64", 4],
      timeout=RUN_TIMEOUT)]
  assert all((o["step"], o["dtype"], o["head"]) == (3, "int64", [0, 1, 2, 3])
             for o in out), out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_64_bit_leaf_restores_together_inside_enable_x64(tmp_path):
  """The same inside `jax.enable_x64(True)`, a per-thread setting, for a
  1.1 MB leaf of values past 2^31: the leaf is shared as int64, and its
  program, compiled on a thread while the process reads, is traced with
  the caller's setting."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top
  w = np.arange(140_000, dtype=np.int64) << 40
  with CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(3, {"w": w})
  out = [r.json for r in run_workers(
      "open_restore", 2, args=[tmp_path / "ckpt", "int64", len(w), "x64"],
      timeout=RUN_TIMEOUT)]
  for o in out:
    assert (o["step"], o["dtype"], o["head"], o["sum"]) == (
        3, "int64", w[:4].tolist(), int(w.sum())), o


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_damage_one_process_meets_in_a_shared_read_falls_back_for_all(
    tmp_path):
  """2 processes restore together two replicated 20 MB leaves, shared in
  two batches (one program each, started as soon as its batch is read).
  Step 2's `a` is damaged in the half that process 1 reads: process 1
  finds it, goes on with zeros through both programs, so that process 0
  does not wait in a collective for it, and then both drop step 2 and
  restore step 1, each reading about half of it. A typed PRNG key after
  `a`, which each process reads alone, is placed without a collective:
  process 1 skips it after the damage, and process 0 must not wait for it
  there either."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin.format import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  length = 5_000_000
  base = np.arange(length, dtype=np.float32)
  with CheckpointManager(tmp_path / "ckpt", max_to_keep=None) as manager:
    for step in (1, 2):
      manager.save(step, {"a": base + step, "b": base * step,
                          "key": jax.random.key(step)})
      manager.wait_until_finished()
  step_dir = tmp_path / "ckpt" / "2"
  (shard,) = manifest_lib.read(step_dir, 2).leaf_by_path["a"].shards
  with open(step_dir / shard.file, "r+b") as f:  # In process 1's half.
    f.seek(shard.offset + shard.nbytes * 3 // 4)
    f.write(b"\xff\xff\xff\xff")
  results = run_workers("shared_damage", 2,
                        args=[tmp_path / "ckpt", str(length)],
                        timeout=RUN_TIMEOUT)
  want = {"a": float((base + 1).sum(dtype=np.float64)),
          "b": float(base.sum(dtype=np.float64))}
  nbytes = 2 * 4 * length
  for r in results:
    o = r.json
    assert (o["step"], o["sums"]) == (1, want), o
    assert o["key"] == jax.random.key_data(jax.random.key(1)).tolist(), o
    # Its half of each leaf, in whole 4 MiB checksum blocks.
    assert o["read"] <= nbytes / 2 + 2 * (4 << 20), o
  assert re.search(r"checksum mismatch", results[1].stderr), format_logs(
      results)
  assert re.search(r"skipping damaged steps \[2\]|after skipping damaged"
                   r" steps \[2\]", results[0].stderr), format_logs(results)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_many_small_replicated_leaves_are_read_once_and_shared(tmp_path):
  """300 replicated leaves of 2-24 KiB (float32, bfloat16, int8, bool,
  int32), restored by 2 processes together: each leaf is read by one
  process, and the leaves travel packed, one collective per batch; every
  device gets every leaf bit for bit. Storage serves the state once, not
  twice."""
  run_workers("many_leaves", 2, args=["save", tmp_path / "ckpt"],
              timeout=RUN_TIMEOUT)
  out = [r.json for r in run_workers("many_leaves", 2,
                                     args=["restore", tmp_path / "ckpt"],
                                     timeout=RUN_TIMEOUT)]
  for o in out:
    assert (o["step"], o["wrong"]) == (4, []), o
  total = out[0]["total"]
  assert sum(o["read"] for o in out) <= 1.1 * total, out
  assert min(o["read"] for o in out) >= 0.3 * total, out  # Both read.
