"""Starts real JAX processes on 127.0.0.1 for multi-process tests.

    results = run_workers("save_restore", 2, args=["save", str(tmp_path)])
    out = [r.json for r in results]

Each worker is a Python script in `tests/mp_workers/` (or a path, or a code
string). It learns who it is from the environment: `PORT` (a free TCP port of
the coordinator on 127.0.0.1), `NUM_PROCESSES` and `PROCESS_ID`, and prints
its result as one JSON line last. `tests/mp_workers/_setup.py` does the
`jax.distributed` start-up.

A hang never blocks the test run: every run has a deadline, after which all
workers are killed and the test fails with every worker's output. A worker
that exits non-zero fails the test too, again with everyone's output, since
the cause often shows in a peer's log. `WorkerGroup` is the lower-level
handle for tests that signal or kill one worker while the others run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Mapping, Sequence

import pytest

MP_WORKERS = pathlib.Path(__file__).resolve().parent / "mp_workers"
REPO_ROOT = MP_WORKERS.parent.parent
_TAIL_CHARS = 6000


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nobody listens on right now.

  Another program may take it before the coordinator binds it; on this test
  machine that race has not been seen, and a bind failure shows in the logs.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class WorkerResult:
  """How one worker process ended and what it printed."""
  process_id: int
  returncode: int | None  # None: still running; -N: killed by signal N.
  stdout: str
  stderr: str

  @property
  def json(self) -> Any:
    """The JSON value of the last non-empty stdout line."""
    lines = [l for l in self.stdout.splitlines() if l.strip()]
    if not lines:
      raise AssertionError(
          f"process {self.process_id} printed no result line\n{self.log()}")
    try:
      return json.loads(lines[-1])
    except json.JSONDecodeError as e:
      raise AssertionError(
          f"process {self.process_id}: last stdout line is not JSON ({e})\n"
          f"{self.log()}") from e

  def log(self, tail: int = _TAIL_CHARS) -> str:
    """The tail of this worker's stdout and stderr, labelled."""
    def cut(text):
      return text if len(text) <= tail else "[...]" + text[-tail:]
    return (f"===== process {self.process_id}: returncode {self.returncode}"
            f" =====\n--- stdout ---\n{cut(self.stdout)}\n"
            f"--- stderr ---\n{cut(self.stderr)}")


def format_logs(results: Sequence[WorkerResult]) -> str:
  return "\n".join(r.log() for r in results)


def _command(worker: str | os.PathLike, args: Sequence[str]) -> list[str]:
  """argv for a worker given as a path, a name in mp_workers/, or code."""
  path = pathlib.Path(worker)
  if isinstance(worker, os.PathLike) or path.suffix == ".py":
    return [sys.executable, "-u", str(path), *args]
  named = MP_WORKERS / f"{worker}.py"
  if "\n" not in str(worker) and named.exists():
    return [sys.executable, "-u", str(named), *args]
  return [sys.executable, "-u", "-c", str(worker), *args]


class WorkerGroup:
  """N worker processes of one multi-controller JAX run.

  Args:
    worker: a script path, a script name in `tests/mp_workers/` (without
      `.py`), or Python code.
    num_processes: how many processes; `PROCESS_ID` runs from 0.
    args: command-line arguments, the same for every process.
    env: extra environment for every process.
    process_env: extra environment per process id, applied after `env`.
    devices_per_process: CPU devices each process gets (the default 2 makes
      N processes a 2N-device mesh); passed as XLA_FLAGS and as
      `DEVICES_PER_PROCESS`, for workers whose start-up fixes its own flags.
    coordinator: run the coordination service in a process of its own
      (`flax-ckpt coordinator`, with this heartbeat timeout in seconds),
      started first; the workers then join it with
      `flax_ckpt_plugin.initialize` (`_setup.init` reads `COORDINATOR`).
      None: process 0 runs it, as `jax.distributed.initialize` does.
  """

  def __init__(self, worker: str | os.PathLike, num_processes: int, *,
               args: Sequence[str] = (),
               env: Mapping[str, str] | None = None,
               process_env: Mapping[int, Mapping[str, str]] | None = None,
               devices_per_process: int = 2,
               coordinator: int | None = None):
    self.num_processes = num_processes
    self.devices_per_process = devices_per_process
    self.port = free_port()
    self._coordinator_heartbeat = coordinator
    self.coordinator: subprocess.Popen | None = None
    self._argv = _command(worker, [str(a) for a in args])
    self._env = dict(env or {})
    self._process_env = {i: dict(e) for i, e in (process_env or {}).items()}
    # Output goes to files, not pipes: a chatty worker can never block on a
    # full pipe while the test waits for it.
    self._log_dir = tempfile.mkdtemp(prefix="mp_workers_")
    self._procs: list[subprocess.Popen] = []
    # Per worker, the wall-clock time `wait` saw it end (within 0.05 s).
    self.ended_at: dict[int, float] = {}
    self.earlier: dict[int, list[WorkerResult]] = {}  # See `relaunch`.
    self._log_names: dict[int, str] = {}

  def _worker_env(self, i: int) -> dict[str, str]:
    env = dict(os.environ)
    # The pytest process may carry its own XLA_FLAGS; each worker gets exactly
    # `devices_per_process` CPU devices (2 unless asked otherwise), so N
    # processes form a mesh of known size.
    k = self.devices_per_process
    env.update({
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={k}",
        "DEVICES_PER_PROCESS": str(k),
        "JAX_PLATFORMS": "cpu",
        "PORT": str(self.port),
        "NUM_PROCESSES": str(self.num_processes),
        "PROCESS_ID": str(i),
        "COORDINATOR": ("process 0" if self._coordinator_heartbeat is None
                        else "external"),
        # The trainers' heartbeat timeout must not exceed the service's:
        # a client beats at a pace of its own timeout, and a slower beat
        # than the service expects reads as a lost process.
        "COORDINATOR_HEARTBEAT": str(self._coordinator_heartbeat or ""),
        "PYTHONPATH": os.pathsep.join(
            [str(MP_WORKERS), str(MP_WORKERS.parent), str(REPO_ROOT)]
            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    })
    env.update(self._env)
    env.update(self._process_env.get(i, {}))
    return env

  def _log_path(self, i: int, stream: str) -> str:
    return os.path.join(self._log_dir,
                        f"{self._log_names.get(i, i)}.{stream}")

  def start_coordinator(self) -> None:
    """Starts `flax-ckpt coordinator` on this group's port; returns once
    it listens (it says so), failing the test if it does not in 60 s."""
    path = os.path.join(self._log_dir, "coordinator.out")
    with open(path, "wb") as out:
      self.coordinator = subprocess.Popen(
          [sys.executable, "-m", "flax_ckpt_plugin", "coordinator",
           "--port", str(self.port), "--num-processes",
           str(self.num_processes), "--heartbeat-timeout",
           str(self._coordinator_heartbeat)],
          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT,
          stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
      with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
      if "listens on" in text:
        return
      if self.coordinator.poll() is not None or time.monotonic() > deadline:
        self.coordinator.kill()
        pytest.fail(f"the coordinator did not start:\n{text}",
                    pytrace=False)
      time.sleep(0.05)

  def kill_coordinator(self) -> float:
    """SIGKILLs the coordinator, as a lost node; returns the time."""
    self.coordinator.kill()
    self.coordinator.wait()
    return time.time()

  def start(self) -> "WorkerGroup":
    if self._coordinator_heartbeat is not None:
      self.start_coordinator()
    for i in range(self.num_processes):
      with open(self._log_path(i, "out"), "wb") as out, \
           open(self._log_path(i, "err"), "wb") as err:
        # A session of its own: a signal sent to one worker reaches only that
        # worker, never pytest or the other workers.
        self._procs.append(subprocess.Popen(
            self._argv, env=self._worker_env(i), cwd=REPO_ROOT, stdout=out,
            stderr=err, stdin=subprocess.DEVNULL, start_new_session=True))
    return self

  def relaunch(self, i: int) -> None:
    """Starts worker `i` again (after it died), as a replaced machine: the
    same process id and arguments. `earlier[i]` keeps the dead one's
    result; its logs go to files of their own."""
    old = self.results()[i]
    self.earlier.setdefault(i, []).append(old)
    self.ended_at.pop(i, None)
    n = len(self.earlier[i])
    self._log_names[i] = f"{i}.{n}"
    with open(self._log_path(i, "out"), "wb") as out, \
         open(self._log_path(i, "err"), "wb") as err:
      self._procs[i] = subprocess.Popen(
          self._argv, env=self._worker_env(i), cwd=REPO_ROOT, stdout=out,
          stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)

  def running(self, i: int) -> bool:
    return self._procs[i].poll() is None

  def pid(self, i: int) -> int:
    return self._procs[i].pid

  def send_signal(self, i: int, sig: int = signal.SIGTERM) -> None:
    """Sends `sig` to worker `i` alone (e.g. SIGTERM for a preemption)."""
    if self._procs[i].poll() is None:
      self._procs[i].send_signal(sig)

  def kill(self, i: int) -> None:
    """Kills worker `i` at once, as a machine failure would."""
    self.send_signal(i, signal.SIGKILL)

  def kill_all(self) -> None:
    procs = self._procs + ([self.coordinator] if self.coordinator else [])
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()

  def results(self) -> list[WorkerResult]:
    """Exit codes and output so far (also while workers still run)."""
    out = []
    for i, p in enumerate(self._procs):
      texts = []
      for stream in ("out", "err"):
        # A fresh handle: the worker's own file offset stays untouched.
        with open(self._log_path(i, stream), "rb") as f:
          texts.append(f.read().decode("utf-8", errors="replace"))
      out.append(WorkerResult(i, p.poll(), *texts))
    return out

  def wait(self, timeout: float, *, check: bool = True) -> list[WorkerResult]:
    """Waits for all workers until `timeout` seconds from now.

    Args:
      timeout: the deadline; then every worker still running is killed and
        the test fails with all logs.
      check: fail the test if any worker exited non-zero.

    Returns:
      One `WorkerResult` per process, by process id.
    """
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in self._procs):
      for i, p in enumerate(self._procs):
        if i not in self.ended_at and p.poll() is not None:
          self.ended_at[i] = time.time()
      if time.monotonic() > deadline:
        hung = [i for i, p in enumerate(self._procs) if p.poll() is None]
        self.kill_all()
        results = self.results()
        self.close()
        pytest.fail(f"workers {hung} still running after {timeout:.0f}s;"
                    f" killed all {self.num_processes}\n"
                    + format_logs(results), pytrace=False)
      time.sleep(0.05)
    for i in range(len(self._procs)):
      self.ended_at.setdefault(i, time.time())
    results = self.results()
    if self.coordinator is not None and self.coordinator.poll() is None:
      self.coordinator.terminate()  # The job ended: so does its service.
      try:
        self.coordinator.wait(30)
      except subprocess.TimeoutExpired:
        self.coordinator.kill()
        pytest.fail("the coordinator did not end within 30 s of SIGTERM",
                    pytrace=False)
    self.close()
    if check and any(r.returncode != 0 for r in results):
      bad = [r.process_id for r in results if r.returncode != 0]
      pytest.fail(f"workers {bad} exited non-zero\n" + format_logs(results),
                  pytrace=False)
    return results

  def close(self) -> None:
    """Removes the log files; call `results` first."""
    shutil.rmtree(self._log_dir, ignore_errors=True)

  def __enter__(self) -> "WorkerGroup":
    return self.start()

  def __exit__(self, *exc) -> None:
    # Never leave a worker behind, whatever the test did.
    self.kill_all()
    self.close()


def run_workers(worker: str | os.PathLike, num_processes: int, *,
                args: Sequence[str] = (), timeout: float = 60.0,
                env: Mapping[str, str] | None = None,
                process_env: Mapping[int, Mapping[str, str]] | None = None,
                check: bool = True,
                devices_per_process: int = 2,
                coordinator: int | None = None) -> list[WorkerResult]:
  """Runs `num_processes` workers to the end; see `WorkerGroup`.

  Fails the test (with every worker's output) when they are not done within
  `timeout` seconds, or when `check` and any exits non-zero.
  """
  with WorkerGroup(worker, num_processes, args=args, env=env,
                   process_env=process_env,
                   devices_per_process=devices_per_process,
                   coordinator=coordinator) as group:
    return group.wait(timeout, check=check)


class StdoutLines:
  """A child's stdout, collected line by line on a thread as it comes.

  For tests that act on what a child prints while it runs (send a signal at
  a step, wait for a report), with a deadline rather than a sleep.
  """

  def __init__(self, stream: IO[str]):
    self._lines: list[str] = []
    self._closed = False
    self._cond = threading.Condition()
    self._thread = threading.Thread(target=self._read, args=(stream,),
                                    daemon=True)
    self._thread.start()

  def _read(self, stream: IO[str]) -> None:
    for line in stream:
      with self._cond:
        self._lines.append(line.rstrip("\n"))
        self._cond.notify_all()
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  @property
  def lines(self) -> list[str]:
    """The lines so far."""
    with self._cond:
      return list(self._lines)

  @property
  def closed(self) -> bool:
    """Whether the child closed its stdout (it exited, usually)."""
    with self._cond:
      return self._closed

  def wait_match(self, pattern: str, deadline: float) -> re.Match | None:
    """The first line that fully matches `pattern`, waiting for it.

    Returns None when stdout closed, or `deadline` (time.monotonic) passed,
    without such a line; `closed` tells which.
    """
    with self._cond:
      seen = 0
      while True:
        for line in self._lines[seen:]:
          if m := re.fullmatch(pattern, line):
            return m
        seen = len(self._lines)
        left = deadline - time.monotonic()
        if self._closed or left <= 0:
          return None
        self._cond.wait(left)

  def wait_closed(self, timeout: float) -> bool:
    """Whether stdout closed within `timeout` seconds."""
    self._thread.join(timeout)
    return not self._thread.is_alive()
