"""examples/train.py runs, resumes, and resumes exactly.

A run to step 20, then a second run to step 40 on the same workdir, must end
with the same bits as one uninterrupted run to step 40: parameters, optimizer
state and step all come back from the checkpoint, and the data position from
its `extra`.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess

EXAMPLE = (pathlib.Path(__file__).resolve().parent.parent / "examples" /
           "train.py")


def run_example(workdir: pathlib.Path, num_steps: int,
                final_params: pathlib.Path) -> list[str]:
  """Runs the example as a user would; returns its stdout lines."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # One CPU device, as on a user's laptop.
  result = subprocess.run(
      [sys.executable, os.fspath(EXAMPLE), "--workdir", os.fspath(workdir),
       "--num-steps", str(num_steps), "--every-steps", "5",
       "--final-params", os.fspath(final_params)],
      capture_output=True, text=True, env=env, timeout=240, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout.splitlines()


def load(path: pathlib.Path) -> dict[str, np.ndarray]:
  with np.load(path) as npz:
    return {k: npz[k] for k in npz.files}


@pytest.mark.timeout(600)
def test_resumed_run_matches_uninterrupted_run(tmp_path):
  workdir = tmp_path / "resumed"
  first = run_example(workdir, 20, tmp_path / "first.npz")
  assert first[0] == "no checkpoint, starting fresh"
  assert first[-1] == "done at step 20"
  assert sorted(int(p.name) for p in workdir.iterdir()
                if p.name != "_WRITER") == [10, 15, 20]

  second = run_example(workdir, 40, tmp_path / "resumed.npz")
  assert second[0] == "restored step 20"
  assert "step 10: loss" not in "\n".join(second)  # Did not start over.
  assert second[-1] == "done at step 40"
  assert sorted(int(p.name) for p in workdir.iterdir()
                if p.name != "_WRITER") == [30, 35, 40]

  fresh = run_example(tmp_path / "fresh", 40, tmp_path / "fresh.npz")
  assert fresh[0] == "no checkpoint, starting fresh"
  assert fresh[-1] == "done at step 40"

  # The logged losses of steps 30 and 40 and every final leaf are identical.
  assert [l for l in second if l.startswith("step ")] == [
      l for l in fresh if l.startswith("step ") and int(l.split()[1][:-1]) > 20]
  resumed, uninterrupted = load(tmp_path / "resumed.npz"), load(
      tmp_path / "fresh.npz")
  assert sorted(resumed) == sorted(uninterrupted)
  assert any("kernel" in k for k in resumed)
  for k, v in uninterrupted.items():
    assert resumed[k].dtype == v.dtype and resumed[k].shape == v.shape, k
    assert resumed[k].tobytes() == v.tobytes(), f"{k} differs after resume"
  assert int(resumed[".step"]) == 40
  first_params = load(tmp_path / "first.npz")
  assert not all(np.array_equal(first_params[k], v)
                 for k, v in uninterrupted.items())


# The relaunched process must start, import JAX and ask to join before the
# survivors reach the last step: with 60 steps of 0.3 s, once in CI (a
# loaded machine) they finished on 6 devices first.
ELASTIC_STEPS = 100


@pytest.mark.parametrize("victim,coordinator_process", [(2, False),
                                                       (0, True)])
def test_elastic_example_goes_on_without_a_killed_process_and_takes_it_back(
    tmp_path, victim, coordinator_process):
  """examples/elastic.py with 4 local processes, process 2 killed at step
  12 and relaunched at once: the other three recover in place, take the
  new process 2 back, and all four end with code 0 at the last step, on 8
  devices. With `--coordinator-process` (the coordination service in a
  process of its own), the same with process 0."""
  elastic = EXAMPLE.parent / "elastic.py"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  for attempt in range(2):
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
    shutil.rmtree(tmp_path / "local", ignore_errors=True)
    result = subprocess.run(
        [sys.executable, os.fspath(elastic), "--launch", "4", "--workdir",
         os.fspath(tmp_path / "ckpt"), "--local-dir",
         os.fspath(tmp_path / "local"), "--num-steps", str(ELASTIC_STEPS),
         "--kill-process", str(victim), "--kill-step", "12", "--relaunch",
         "--step-secs", "0.3"]
        + (["--coordinator-process"] if coordinator_process else []),
        capture_output=True, text=True, env=env, timeout=300, check=False)
    out = result.stdout + result.stderr
    # Once in CI (1 run of many), gloo, JAX's CPU collectives, aborted a
    # survivor in the killed process's step ("gloo::EnforceNotMet ...
    # Received data size doesn't match expected size"): a C++ abort inside
    # the collective library, before any of this package's code runs, that
    # NCCL on GPUs does not have. Only that abort earns a second run.
    if attempt or "gloo::EnforceNotMet" not in out:
      break
    print("gloo aborted a survivor; running the example again:\n" + out)
  assert f"process {victim} exited with code 137" in out, out
  for p in range(4):
    assert f"process {p} exited with code 0" in out, out
  assert "recovered in place at step" in out, out
  assert "rejoined at step" in out, out
  assert f"done at step {ELASTIC_STEPS} on 8 devices" in out, out
