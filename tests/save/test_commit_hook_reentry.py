"""A commit hook that calls back into its own manager, in one process.

Hooks run on the commit thread. A call that waits for the commit (`save`,
`wait_until_finished`, `close`) made there would wait for itself; it must
raise instead, and the user sees that as the usual `CommitHookError`.
Every scenario runs on a thread with a deadline, so a deadlock fails the
test instead of hanging it.
"""


import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import CommitHookError
from helpers import call_on_thread

DEADLOCK_SECS = 30.0


def _state(step: int) -> dict:
  return {"w": np.full((4,), step, np.float32)}


def _within_deadline(fn):
  """`fn()` on a daemon thread; fails the test if it has not returned."""
  thread, box = call_on_thread(fn, DEADLOCK_SECS)
  if thread.is_alive():
    pytest.fail(f"deadlock: still waiting after {DEADLOCK_SECS:.0f}s")
  if "error" in box:
    raise box["error"]
  return box.get("result")


_CALLS = {
    "manager.wait_until_finished": lambda mgr, cb: mgr.wait_until_finished(),
    "manager.save": lambda mgr, cb: mgr.save(99, _state(99)),
    "manager.close": lambda mgr, cb: mgr.close(),
    "callback.wait_until_finished": lambda mgr, cb: cb.wait_until_finished(),
    "callback.save": lambda mgr, cb: cb.save(99, _state(99)),
    "callback.close": lambda mgr, cb: cb.close(),
}


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_a_hook_that_waits_for_its_commit_gets_an_error_not_a_deadlock(
    ckpt_dir, call):
  """The hook gets an error, rather than waiting forever for the commit it
  runs in."""
  def scenario():
    holder = {}

    def hook(stats):
      _CALLS[call](holder["cb"].manager, holder["cb"])

    cb = holder["cb"] = CheckpointCallback(ckpt_dir)
    cb.add_commit_hook(hook)
    cb.save(1, _state(1))
    with pytest.raises(CommitHookError) as info:
      cb.wait_until_finished()
    # The manager is still open and the hook's step durable: the loop can go
    # on (the hook runs, and fails, again at the next save).
    assert cb.manager.all_steps() == [1]
    cb.manager.save(2, _state(2))
    with pytest.raises(CommitHookError, match="after step 2"):
      cb.manager.wait_until_finished()
    cb.close()
    return str(info.value), sorted(p.name for p in ckpt_dir.iterdir())

  message, entries = _within_deadline(scenario)
  assert "commit hook" in message and "after step 1 was finalized" in message
  assert "RuntimeError" in message
  assert "called from a commit hook, on the commit thread" in message
  assert "would wait for itself" in message
  assert "step 1 in" in message  # Which commit.
  assert {"1", "2"} <= set(entries)


def test_a_hook_may_still_read_its_manager(ckpt_dir):
  """Calls that do not wait for the commit stay allowed in a hook."""
  def scenario():
    seen = []
    mgr = CheckpointManager(ckpt_dir, hooks=[lambda stats: seen.append(
        (mgr.all_steps(), mgr.save_in_progress, mgr.check_for_errors()))])
    mgr.save(1, _state(1))
    mgr.wait_until_finished()
    mgr.close()
    return seen

  assert _within_deadline(scenario) == [([1], True, None)]
