"""The option records, one per decision: `Retention` (what to keep),
`Storage` (where and how the bytes are written), `Processes` (how the
processes agree on a save), `FaultTolerance` (what to do when a process or
its machine goes away).

The everyday choices are keywords of their own; the rest live in typed,
immutable records that the callback, the manager and the clu action share.
"""

import dataclasses
import inspect
import signal

import pytest

from flax_ckpt_plugin import AutoInterval
from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import Storage
from flax_ckpt_plugin import FaultTolerance
from flax_ckpt_plugin import Retention
from flax_ckpt_plugin.backends import registry as backend_lib

from helpers import tiny


def test_the_callback_takes_ten_keywords_at_most():
  params = inspect.signature(CheckpointCallback).parameters
  keywords = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
  assert len(keywords) <= 10, keywords
  assert {"retention", "tolerance", "storage", "processes"} <= set(keywords)


def test_records_are_immutable_and_check_their_values():
  processes = Processes()
  with pytest.raises(dataclasses.FrozenInstanceError):
    processes.primary_host = 1  # type: ignore[misc]
  with pytest.raises(ValueError, match="primary_host must be a process"):
    Processes(primary_host=-1)
  with pytest.raises(ValueError, match="barrier_timeout_secs must be > 0"):
    Processes(barrier_timeout_secs=0)
  with pytest.raises(ValueError, match="max_to_keep must be an int"):
    Retention(max_to_keep=0)
  with pytest.raises(ValueError, match="keep_best=2 needs best_metric"):
    Retention(keep_best=2)
  with pytest.raises(ValueError, match="watch_poll_secs must be > 0"):
    FaultTolerance(watch_poll_secs=0)
  with pytest.raises(ValueError, match="elastic_wait_secs must be > 0"):
    FaultTolerance(elastic_wait_secs=-1)
  with pytest.raises(ValueError, match="local_every_steps must be an int"):
    FaultTolerance(local_directory="/tmp/x", local_every_steps=2.5)
  with pytest.raises(ValueError, match="replicas must be an int >= 0"):
    FaultTolerance(local_directory="/tmp/x", local_every_steps=2,
                   replicas=-1)
  with pytest.raises(ValueError, match="replicas .* live in the local tier"):
    FaultTolerance(replicas=1)
  with pytest.raises(ValueError, match="failure_domain must be a non-empty"):
    FaultTolerance(failure_domain="")
  with pytest.raises(ValueError, match="pinned_host_bytes must be an int"):
    Storage(pinned_host_bytes=-1)
  with pytest.raises(ValueError, match="pinned_host_bytes must be an int"):
    Storage(pinned_host_bytes=1.5e9)
  assert FaultTolerance(preemption_signals=[signal.SIGUSR1]) == (
      FaultTolerance(preemption_signals=(signal.SIGUSR1,)))


def test_the_records_reach_the_manager(tmp_path):
  """Each record's fields take effect: the backend of `Storage`, the name
  of `Processes`, the rules of `Retention` (`max_to_keep` given there),
  the local tier of `FaultTolerance`; and a commit hook."""
  finalized = []
  backend = backend_lib.LocalBackend(cache_saved=False)
  cb = CheckpointCallback(
      tmp_path / "ckpt", every_steps=1,
      retention=Retention(max_to_keep=1, keep_every_n_steps=2),
      tolerance=FaultTolerance(save_on_preemption=False,
                               local_directory=tmp_path / "local",
                               local_every_steps=3),
      storage=Storage(backend=backend),
      processes=Processes(name="options-test"))
  cb.add_commit_hook(lambda stats: finalized.append(stats.step))
  for step in range(1, 6):
    cb(step, tiny(step))
  cb.close()
  assert cb.manager.backend is backend
  assert cb.manager.name.startswith("flax_ckpt_plugin/options-test/")
  assert finalized == [1, 2, 3, 4, 5]
  assert cb.manager.all_steps() == [2, 4, 5]  # Every 2nd, and the newest.
  assert cb.local.manager.all_steps() == [3]
  assert not cb.save_on_preemption
  restored = CheckpointManager(tmp_path / "ckpt").restore(tiny(0))
  assert restored["w"].tolist() == [5, 5, 5]


def test_max_to_keep_given_two_ways_must_agree(tmp_path):
  with pytest.raises(ValueError, match="disagree: give it one way"):
    CheckpointManager(tmp_path, max_to_keep=2,
                      retention=Retention(max_to_keep=3))


@pytest.mark.parametrize("kwargs, message", [
    ({"local_directory": "/tmp/x", "local_every_steps": "auto"},
     'local_every_steps="auto" is not offered'),
    ({"mtbf_secs": 0}, "mtbf_secs must be a number of seconds > 0, got 0"),
    ({"mtbf_secs": float("inf")},
     "mtbf_secs must be a number of seconds > 0, got inf"),
    ({"min_every_steps": 0}, "min_every_steps must be an int >= 1, got 0"),
    ({"min_every_steps": 10, "max_every_steps": 5},
     "min_every_steps=10 is above max_every_steps=5"),
], ids=["local_auto", "mtbf_zero", "mtbf_inf", "min_zero", "min_above_max"])
def test_fault_tolerance_refuses_bad_interval_options(kwargs, message):
  with pytest.raises(ValueError) as e:
    FaultTolerance(**kwargs)
  assert message in str(e.value)



@pytest.mark.parametrize("make, message", [
    (lambda: Retention(max_to_keep=0),
     "max_to_keep must be an int >= 1 or None, got 0"),
    (lambda: Retention(keep_for_secs=True),
     "keep_for_secs must be a number of seconds > 0 or None, got True"),
    (lambda: Storage(pinned_host_bytes=1.5),
     "pinned_host_bytes must be an int >= 0 or None, got 1.5"),
    (lambda: Storage(io_timeout_secs=float("nan")),
     "io_timeout_secs must be a number of seconds > 0, got nan"),
    (lambda: FaultTolerance(replicas=True),
     "replicas must be an int >= 0, got True"),
    (lambda: FaultTolerance(local_directory="/tmp/x", local_every_steps=0),
     "local_every_steps must be an int >= 1, got 0"),
    (lambda: AutoInterval(mtbf_secs=-1.0),
     "mtbf_secs must be a number of seconds > 0, got -1.0"),
    (lambda: AutoInterval(mtbf_secs=60, max_every_steps=False),
     "max_every_steps must be an int >= 1, got False"),
], ids=["retention_count", "retention_secs", "storage_count", "storage_secs",
        "tolerance_replicas", "tolerance_local", "interval_secs",
        "interval_count"])
def test_the_records_check_counts_and_durations_alike(make, message):
  """One check of counts and one of durations serve every record: the same
  rule, in the same words."""
  with pytest.raises(ValueError) as e:
    make()
  assert str(e.value) == message


def test_an_io_timeout_may_be_infinite():
  assert Storage(io_timeout_secs=float("inf")).io_timeout_secs == float("inf")
