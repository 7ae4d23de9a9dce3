"""Exact resume with real Grain pipelines, as a user runs examples/grain_train.py.

Each case trains once without interruption, then again with a SIGTERM at a
random step (to one process of two), which saves and exits with 75, then
resumes: every batch each process draws after the resume is the batch the
uninterrupted run drew at that step, and the final state is bit-identical.
Pipelines: a `grain.MapDataset` (shuffle, map, batch, sliced per process)
and a `grain.DataLoader` (sampler sharded per process) with 0 and 2
worker processes; one process and two.
"""

import os
import pathlib
import random
import re
import signal
import sys

import pytest

from test_preemption import Child
from test_preemption import load_npz
from test_preemption import run_to_end

pytest.importorskip("grain")  # The [grain] extra; CI installs it.

GRAIN = pathlib.Path(__file__).resolve().parents[2] / "examples" / (
    "grain_train.py")
NUM_STEPS, EVERY_STEPS = 16, 6
BATCH_LINE = re.compile(r"process (\d) step (\d+) batch (\w+)")


def _argv(workdir, loader, workers, processes, *extra):
  return [sys.executable, os.fspath(GRAIN), "--loader", loader,
          "--worker-count", str(workers), "--workdir", os.fspath(workdir),
          "--num-steps", str(NUM_STEPS), "--every-steps", str(EVERY_STEPS),
          "--log-batches", "--log-every", "1",
          *(["--launch", str(processes)] if processes > 1 else []), *extra]


def _batches(child) -> dict[tuple[int, int], str]:
  """(process, step) -> digest of the batch that process drew there."""
  out = {}
  for line in child.lines:
    for p, step, digest in BATCH_LINE.findall(line):
      out[(int(p), int(step))] = digest
  return out


@pytest.mark.timeout(900)
@pytest.mark.multiprocess
# Each loader once, the two that users run on several hosts with 2
# processes: a dataset iterator, a DataLoader without workers on one
# process, and a DataLoader whose worker processes are themselves in a job
# of 2 (the other three corners of the grid add 100 s to CI and no path).
@pytest.mark.parametrize("loader,workers,processes", [("dataset", 0, 2),
                                                      ("data_loader", 0, 1),
                                                      ("data_loader", 2, 2)])
def test_sigterm_at_a_random_step_then_every_batch_and_bit_is_the_same(
    tmp_path, request, loader, workers, processes):
  after = random.Random(request.node.name).choice(
      [s for s in range(2, 12) if (s + 1) % EVERY_STEPS])
  whole = run_to_end(_argv(tmp_path / "whole", loader, workers, processes,
                           "--final-params", os.fspath(tmp_path / "a.npz")))
  expected = _batches(whole)
  assert len(expected) == processes * NUM_STEPS, whole.output()

  workdir = tmp_path / "preempted"
  argv = _argv(workdir, loader, workers, processes, "--step-secs", "0.3")
  with Child(argv) as child:
    target = processes - 1  # The last process alone gets the notice.
    pid = child.proc.pid if processes == 1 else int(
        child.wait_for_line(rf"process {target}: pid (\d+)")[1])
    child.wait_for_line(rf"step {after}: loss \S+")
    os.kill(pid, signal.SIGTERM)
    if child.wait() != 75:
      child.fail(f"SIGTERM after step {after}: expected exit code 75")
  stops = {int(m[1]) for m in child.find_lines(
      r"process \d: preempted: checkpoint of step (\d+) is durable.*")}
  assert len(stops) == 1, child.output()
  stopped = stops.pop()
  assert after <= stopped < NUM_STEPS
  before = _batches(child)
  resumed = run_to_end(_argv(workdir, loader, workers, processes,
                             "--final-params", os.fspath(tmp_path / "b.npz")))
  assert resumed.find_lines(rf".*restored step {stopped}"), resumed.output()
  after_resume = _batches(resumed)
  assert sorted(after_resume) == [(p, s) for p in range(processes)
                                  for s in range(stopped + 1, NUM_STEPS + 1)]
  for key, digest in {**before, **after_resume}.items():
    assert digest == expected[key], f"process {key[0]}, step {key[1]}"
  a, b = load_npz(tmp_path / "a.npz"), load_npz(tmp_path / "b.npz")
  assert sorted(a) == sorted(b)
  for k, v in a.items():
    assert b[k].tobytes() == v.tobytes(), f"{k} differs after the resume"


@pytest.mark.timeout(600)
@pytest.mark.multiprocess
def test_resuming_two_processes_data_on_one_names_both_counts(tmp_path):
  """Each process's position belongs to its shard of two: one process
  cannot take them over (the train state alone could be restored)."""
  run_to_end(_argv(tmp_path / "w", "dataset", 0, 2))
  with Child(_argv(tmp_path / "w", "dataset", 0, 1)) as child:
    code = child.wait()
    out = child.output()
  assert code == 1, out
  assert "DataStateMismatchError" in out and (
      "saved by 2 processes, and this job has 1") in out, out
