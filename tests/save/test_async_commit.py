"""The commit thread: started when a manager opens, reused, restarted.

A writing manager starts its commit thread when it opens, and a save
starts it again before its snapshot if it exited while idle (`prepare`):
a save comes right after a train step, whose runtime threads still hold
the cores for a few milliseconds, and a thread started then waits for one. These tests run the real
`AsyncCommitter` with real threads and check what its users rely on.
"""

import threading
import time

import pytest

from flax_ckpt_plugin.save import async_commit
from flax_ckpt_plugin import CheckpointManager


def _workers(name):
  return [t for t in threading.enumerate() if t.name == name]


def test_prepare_starts_one_thread_that_runs_the_next_jobs():
  committer = async_commit.AsyncCommitter("test-commit-prepare")
  committer.prepare()
  (worker,) = _workers("test-commit-prepare")
  committer.prepare()  # Already running: no second thread.
  assert _workers("test-commit-prepare") == [worker]
  ran = []
  for n in range(3):
    committer.start(lambda n=n: ran.append(
        (n, threading.current_thread())), description=f"job {n}")
    committer.wait()
  assert ran == [(0, worker), (1, worker), (2, worker)]
  committer.close()
  worker.join(10)
  assert not worker.is_alive()


def test_an_idle_thread_exits_and_the_next_job_starts_another(monkeypatch):
  monkeypatch.setattr(async_commit.AsyncCommitter, "IDLE_EXIT_SECS", 0.05)
  committer = async_commit.AsyncCommitter("test-commit-idle")
  committer.prepare()
  (first,) = _workers("test-commit-idle")
  first.join(10)  # Exits after 0.05 s without work.
  assert not first.is_alive()
  ran = []
  committer.start(lambda: ran.append(threading.current_thread()),
                  description="after idle")
  committer.wait()
  assert ran and ran[0] is not first
  committer.close()


def test_a_save_refused_after_prepare_leaves_the_manager_usable(
    ckpt_dir, make_state, train_step):
  """A save whose snapshot raises (a donated leaf) has started the commit
  thread already; nothing runs on it, and the next save commits."""
  manager = CheckpointManager(ckpt_dir)
  state = make_state()
  train_step(state)  # Donates (deletes) `state`.
  with pytest.raises(ValueError, match="deleted"):
    manager.save(1, state)
  assert not manager._committer.is_running  # pylint: disable=protected-access
  fresh = make_state()
  manager.save(1, fresh)
  manager.wait_until_finished()
  assert manager.all_steps() == [1]
  manager.close()
  deadline = time.monotonic() + 10
  name = manager._committer._name  # pylint: disable=protected-access
  while _workers(name) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert not _workers(name)


def test_a_writing_manager_starts_its_commit_thread_when_it_opens(ckpt_dir):
  """So that its first save does not (a read-only manager starts none)."""
  manager = CheckpointManager(ckpt_dir)
  name = manager._committer._name  # pylint: disable=protected-access
  (worker,) = _workers(name)
  reader = CheckpointManager(ckpt_dir, read_only=True)
  assert _workers(reader._committer._name) == [worker]  # pylint: disable=protected-access
  manager.close()
  reader.close()
  worker.join(10)
  assert not worker.is_alive()
