"""One process fails while writing its shards in the background.

    write_failure.py DIR

Saves every 2 steps. With FAIL_AT_STEP=S in its environment, this process's
`writer.write_process_files` raises OSError (ENOSPC) for step S: a full disk
cannot be produced on demand, so the fault is injected, in that process only.

With KV_LATENCY_SECS=T, this process's reads from the coordination service's
key-value store answer T seconds late, as with a coordinator far away or
under load (also injected: a local coordinator always answers at once).

Prints how the first call into the library after the failing save ended, the
steps the manager lists then, and digests of the newest step restored then.
"""

import errno
import os
import sys
import time

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import _train
import flax_ckpt_plugin
from flax_ckpt_plugin.multihost import coordinator
from flax_ckpt_plugin.format import files
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin import Processes

FAIL_AT_STEP = int(os.environ.get("FAIL_AT_STEP", "-1"))
KV_LATENCY_SECS = float(os.environ.get("KV_LATENCY_SECS", "0"))
# Long enough that a prompt error is clearly not a timeout, short enough that
# a process left waiting at a barrier fails the test in reasonable time.
BARRIER_TIMEOUT_SECS = 20


def _inject_fault() -> None:
  real = writer.write_process_files

  def failing(step_dir, leaves, process_index, **kwargs):
    # `step_dir` is "<step>.partial" (rename mode) or "<step>".
    if step_dir.name.split(".")[0] == str(FAIL_AT_STEP):
      raise OSError(errno.ENOSPC, "No space left on device (injected by the"
                    " test)", str(step_dir / files.data_file(process_index)))
    return real(step_dir, leaves, process_index, **kwargs)

  writer.write_process_files = failing


class _SlowReads(coordinator.JaxCoordinator):
  """The real coordinator, with key-value reads answered late."""

  def kv_dir(self, prefix: str) -> dict[str, str]:
    time.sleep(KV_LATENCY_SECS)
    return super().kv_dir(prefix)

  def kv_get(self, key: str, *, timeout_ms: int) -> str:
    time.sleep(KV_LATENCY_SECS)
    return super().kv_get(key, timeout_ms=timeout_ms)


def main(directory: str) -> dict:
  if FAIL_AT_STEP >= 0:
    _inject_fault()
  state = _train.init_state()
  train_step = _train.make_train_step()
  cb = flax_ckpt_plugin.CheckpointCallback(
      directory, every_steps=2, max_to_keep=None,
      processes=Processes(barrier_timeout_secs=BARRIER_TIMEOUT_SECS,
                          coordinator=_SlowReads() if KV_LATENCY_SECS > 0 else None))
  saved = {}
  for step in range(1, 5):
    state = train_step(state)
    if cb(step, state):
      saved[step] = _setup.leaf_digests(state)
  # The save of step 4 started; the next call into the library reports it.
  t0 = time.monotonic()
  error = None
  try:
    cb.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    error = {"type": type(e).__name__,
             "mro": [c.__name__ for c in type(e).__mro__],
             "message": str(e), "notes": getattr(e, "__notes__", [])}
  elapsed = time.monotonic() - t0
  result = {
      "saved_digests": saved,
      "error": error,
      "error_secs": elapsed,
      "barrier_timeout_secs": BARRIER_TIMEOUT_SECS,
      "latest_step": cb.manager.latest_step(),
      "all_steps": cb.manager.all_steps(),
  }
  # The error was raised once: the manager is usable again, and the newest
  # finalized step restores.
  restored = cb.manager.restore(_train.abstract_state())
  result["restored_digests"] = _setup.leaf_digests(restored)
  cb.close()
  return result


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1]))
