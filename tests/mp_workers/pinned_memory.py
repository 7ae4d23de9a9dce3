"""The host memory of saves and restores on the accelerator path.

    pinned_memory.py DIR

One process, its CPU devices taking the accelerator path (the suite's
switch, `FLAX_CKPT_PLUGIN_PINNED_CPU=1`, set by the test). On the CPU a
device's memory is the host's too, so the process's anonymous memory is
sampled (every 2 ms, on a thread) and each phase reports its peak over
what it started from. The state: 4 leaves of 64 MiB (larger than the C
allocator's largest mmap threshold, so their memory goes back to the
system when freed). Phases:

* warm-up: the saves' pinned memory, pinned by the reservation (waited for);
* save: 2 saves, each waited for until durable;
* restore_after_save: the newest step, from the snapshot the manager holds;
* fresh_restore: everything freed, a new manager restores the step.

Prints the state's bytes, the restore window's, and per phase its peak
growth and what it ended at, in bytes.
"""

import sys
import threading

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp

import flax_ckpt_plugin
from flax_ckpt_plugin.restore import window


def _anon() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
  """The highest anonymous memory while the `with` block runs, over the
  memory at its start."""

  def __enter__(self):
    self.start = self.peak = _anon()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.002):
      self.peak = max(self.peak, _anon())

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.end = _anon()
    self.peak = max(self.peak, self.end)
    self.growth = self.peak - self.start


def main(directory: str) -> dict:
  device = jax.devices()[0]
  state = {f"w{i}": jax.device_put(jnp.full((16 << 20,), i, jnp.float32),
                                   device) for i in range(4)}
  jax.block_until_ready(state)
  nbytes = sum(a.nbytes for a in state.values())
  target = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      state)
  out = {"state_bytes": nbytes, "window_bytes": window.RESTORE_WINDOW_BYTES}
  mgr = flax_ckpt_plugin.CheckpointManager(directory, max_to_keep=1)
  with Peak() as p:
    mgr.warm_up(state, wait=True)
  out["warm_up"] = [p.growth, p.end - p.start]
  with Peak() as p:
    for step in (1, 2):
      state = {k: v + 1 for k, v in state.items()}
      mgr.save(step, state)
      mgr.wait_until_finished()
  out["save"] = [p.growth, p.end - p.start]
  with Peak() as p:
    restored = mgr.restore(target)
    jax.block_until_ready(restored)
  out["restore_after_save"] = [p.growth, p.end - p.start]
  out["from_memory"] = mgr.last_restore_stats.nbytes_from_memory
  out["same"] = all(bool((restored[k] == state[k]).all()) for k in state)
  mgr.close()
  del state, restored
  mgr = flax_ckpt_plugin.CheckpointManager(directory, read_only=True)
  with Peak() as p:
    restored = mgr.restore(target)
    jax.block_until_ready(restored)
  out["fresh_restore"] = [p.growth, p.end - p.start]
  out["fresh_same"] = all(bool((v == i + 2).all())
                          for i, v in enumerate(restored.values()))
  mgr.close()
  return out


if __name__ == "__main__":
  _setup.emit(main(sys.argv[1]))
