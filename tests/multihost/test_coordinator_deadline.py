"""The coordination service's process 0 hung or dead, as process 1 sees it.

The service enforces a call's timeout inside process 0; these check that
`JaxCoordinator` keeps its own deadline and tells the truth about how a call
ended. Fast checks run on a fake service client; one runs two real
processes and stops process 0.
"""

import signal
import statistics
import threading
import time

import pytest

from flax_ckpt_plugin.multihost import coordinator as coordinator_lib
from launcher import WorkerGroup

BARRIER_TIMEOUT_SECS = 3.0  # As in mp_workers/stopped_primary.py.
TIMEOUT_EXIT = 3  # stopped_primary.py's exit status after a TimeoutError.
RUN_TIMEOUT = 60.0


class _Client:
  """A coordination-service client whose calls hang or fail as told."""

  def __init__(self, *, hang: threading.Event | None = None,
               error: Exception | None = None, delay: float = 0.0):
    self._hang, self._error, self._delay = hang, error, delay

  def _answer(self, value=None):
    if self._hang is not None:
      self._hang.wait()  # As a stopped process 0: no answer.
    time.sleep(self._delay)
    if self._error is not None:
      raise self._error
    return value

  def wait_at_barrier(self, key, timeout_ms, process_ids=None):
    return self._answer()

  def blocking_key_value_get(self, key, timeout_ms):
    return self._answer("v")

  def key_value_set(self, key, value, allow_overwrite=False):
    return self._answer()

  def key_value_dir_get(self, prefix):
    return self._answer([(f"{prefix}/a", "1")])

  def key_value_delete(self, key):
    return self._answer()


class _Coordinator(coordinator_lib.JaxCoordinator):
  """Process 1 of 2, talking to `client` instead of JAX's service."""

  process_index = 1
  process_count = 2
  MIN_MARGIN_SECS = 0.2

  def __init__(self, client):
    self._fake = client

  def _client(self):
    return self._fake


_CALLS = {
    "barrier": lambda c: c.barrier("k", timeout_ms=100),
    "kv_get": lambda c: c.kv_get("k", timeout_ms=100),
    "kv_set": lambda c: c.kv_set("k", "v"),
    "kv_dir": lambda c: c.kv_dir("k"),
    "kv_delete": lambda c: c.kv_delete("k"),
}


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_a_call_the_service_never_answers_is_a_timeout_error(call):
  """The call raises after its own timeout, rather than blocking until JAX
  ends the process (100 s)."""
  hang = threading.Event()
  coord = _Coordinator(_Client(hang=hang))
  coord.CALL_TIMEOUT_SECS = 0.1
  t0 = time.monotonic()
  try:
    with pytest.raises(TimeoutError) as info:
      _CALLS[call](coord)
  finally:
    hang.set()  # Lets the abandoned helper thread exit.
  secs = time.monotonic() - t0
  assert 0.3 <= secs < 2.0, secs  # 0.1 s timeout + 0.2 s margin.
  message = str(info.value)
  assert "coordination service (process 0) did not answer" in message
  assert "'k'" in message and "within 0.3s" in message
  assert "process 1 of 2" in message
  assert "process 0 may be hung or gone" in message


@pytest.mark.parametrize("call", ["barrier", "kv_get"])
def test_a_failure_before_the_timeout_says_how_long_it_took(call):
  """A call that fails at once (the service's process killed: the
  connection broken) says how long it took, not "timed out after 0.1s"."""
  error = RuntimeError("UNAVAILABLE: Failed to send RPC to coordination"
                       " service: Connection reset by peer")
  coord = _Coordinator(_Client(error=error))
  with pytest.raises(TimeoutError) as info:
    _CALLS[call](coord)
  message = str(info.value)
  assert "timed out" not in message
  assert "failed after 0.0s (of a 0.1s timeout)" in message
  assert "Connection reset by peer" in message  # JAX's error.
  assert "'k'" in message


@pytest.mark.parametrize("call", ["barrier", "kv_get"])
def test_a_call_that_ran_out_its_timeout_says_timed_out(call):
  error = RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")
  coord = _Coordinator(_Client(error=error, delay=0.1))
  with pytest.raises(TimeoutError, match=r"timed out after 0\.1s"):
    _CALLS[call](coord)


def test_the_deadline_costs_little_per_call():
  """Each call goes through a reused helper thread, not a new one."""
  coord = _Coordinator(_Client())
  threads = threading.active_count()
  secs = []
  for _ in range(200):
    t0 = time.perf_counter()
    coord.kv_set("k", "v")
    secs.append(time.perf_counter() - t0)
  # Timing is printed, not asserted (shared machines); the helper's reuse is.
  print(f"median per call: {statistics.median(secs) * 1e6:.0f} us")
  assert threading.active_count() <= threads + 1


def _wait_for_line(group: WorkerGroup, i: int, text: str, secs: float):
  deadline = time.monotonic() + secs
  while text not in group.results()[i].stdout:
    if time.monotonic() > deadline or group.results()[i].returncode is not None:
      pytest.fail(f"process {i} never printed {text!r}\n"
                  + "\n".join(r.log() for r in group.results()))
    time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_stopped_primary_is_a_timeout_error_soon_after_the_barrier_timeout(
    tmp_path):
  """Process 1 gets a TimeoutError soon after the 3 s barrier timeout,
  rather than no error and its end by JAX after the 100 s heartbeat
  timeout."""
  with WorkerGroup("stopped_primary", 2, args=[tmp_path]) as group:
    _wait_for_line(group, 0, "primary idle", RUN_TIMEOUT)
    group.send_signal(0, signal.SIGSTOP)  # Hung: alive, answering nothing.
    (tmp_path / "go").touch()
    deadline = time.monotonic() + 20  # Far less than 100 s.
    while group.results()[1].returncode is None:
      if time.monotonic() > deadline:
        pytest.fail("process 1 still waits for the stopped process 0\n"
                    + "\n".join(r.log() for r in group.results()))
      time.sleep(0.05)
    p1 = group.results()[1]
    group.kill(0)  # SIGKILL ends a stopped process too.
  assert p1.returncode == TIMEOUT_EXIT, p1.log()
  out = p1.json
  print(f"process 1: TimeoutError after {out['secs']:.2f}s:"
        f" {out['error']['message']}")
  assert "did not answer barrier" in out["error"]["message"], out
  assert "process 0 may be hung or gone" in out["error"]["message"], out
  # The barrier timeout plus the margin (2 s), plus room for a busy machine;
  # far from the 100 s of JAX's heartbeat.
  assert BARRIER_TIMEOUT_SECS <= out["secs"] < BARRIER_TIMEOUT_SECS + 10, out
