"""A training process for the crash harness (`tests/save/test_crash.py`).

    python tests/crash_worker.py CKPT_DIR

Opens CKPT_DIR with a `CheckpointCallback` (a save every step, keeping two),
restores or initializes, checks what it restored bit for bit against the state
recomputed for that step, prints that as one JSON line, prints `TRAINING`, and
trains until it is killed.

The state at step s is a pure function of s, so any step can be recomputed
without replaying the run: ~30 MB in three arrays sharded over two CPU devices
(uint32 `x`, float32 `y` and bfloat16 `z`, all exact functions of `x`), an
int32 `step` array and a Python int `count`. One jitted step, which donates
its input, moves the arrays from step s to s + 1.

Targeted crashes: with `CRASH_KILL_AT=<moment>` the worker wraps one package
function so that the `CRASH_KILL_ON`-th time that moment comes (default the
first) the process prints `{"killed_at": moment, "step": s}` and sends itself
SIGKILL: a real kill at an injected point, with no Python cleanup, from
whichever thread (the train loop or the background commit) is there. The
moments are the keys of `MOMENTS`. The hooks are installed only after the
directory was opened and restored, so they never fire during the cleanup of
the previous crash.

`CRASH_ATOMICITY` picks the manager's `atomicity` ('rename' by default);
with `CRASH_REPORT_ONLY=1` the worker exits after its report.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.backends import datafile
from flax_ckpt_plugin.manager import manager as manager_lib
from flax_ckpt_plugin.format import files
from flax_ckpt_plugin.save import writer
from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import PREEMPTED_EXIT_CODE
from flax_ckpt_plugin import Storage

# Elements per array: 3 * 2**20 gives x and y 12 MiB each and z 6 MiB, so
# every shard spans several 4 MiB checksum blocks.
N = 3 << 20
EVERY_STEPS = 1
MAX_TO_KEEP = 2
# A targeted kill comes within the first few saves; this many without it
# means the hook is no longer on the package's path.
HOOK_PATIENCE = 100
# `<n>`, `<n>.partial` or `<n>.deleting`: the entries that name a step.
_STALE = re.compile(r"(\d+)(\.partial|\.deleting)?")

# Where a targeted kill can land, in the order a save meets them.
MOMENTS = {
    "snapshot": "right after the host snapshot of a save was taken",
    "write": "half way through writing a data file",
    "finalize_manifest": "after the manifest was written, before the marker",
    "finalize_marker": "right after the commit marker was written (rename"
                       " mode: inside <step>.partial, before the rename)",
    "finalize_renamed": "right after finalize returned (the step is final)",
    "retention_renamed": "after retention renamed a step to <step>.deleting,"
                         " before removing anything",
    "retention_partial": "after retention removed part of <step>.deleting",
}


def _uint32(v: int) -> np.uint32:
  return np.uint32(v % 2**32)


def _increments() -> np.ndarray:
  """Per element, how much `x` grows per unit of step (odd, all different)."""
  iota = np.arange(N, dtype=np.uint32)
  return iota * _uint32(2654435761) + _uint32(1)


def expected_state(step: int) -> dict[str, Any]:
  """The state after `step` train steps, recomputed in closed form (numpy).

  x_s = x_0 + a * (1 + 2 + ... + s) modulo 2**32, with x_0 = iota ^ C.
  """
  iota = np.arange(N, dtype=np.uint32)
  x = (iota ^ _uint32(0x9E3779B9)) + _increments() * _uint32(
      step * (step + 1) // 2)
  return {
      "arrays": {
          "x": x,
          # Exact: a 24-bit integer is a float32, and the scale a power of 2.
          "y": (x >> np.uint32(8)).astype(np.float32) * np.float32(2**-24),
          # Exact: 0..255 fit bfloat16's 8 significant bits.
          "z": (x >> np.uint32(24)).astype(ml_dtypes.bfloat16),
          "step": np.int32(step),
      },
      "count": step,
  }


def _shardings() -> dict[str, Any]:
  mesh = Mesh(np.array(jax.devices()), ("d",))
  split = NamedSharding(mesh, P("d"))
  return {"x": split, "y": split, "z": split,
          "step": NamedSharding(mesh, P())}


def _step_fn(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
  step = arrays["step"] + 1
  a = (jax.lax.iota(jnp.uint32, N) * jnp.uint32(2654435761) + jnp.uint32(1))
  x = arrays["x"] + a * step.astype(jnp.uint32)
  return {"x": x,
          "y": (x >> 8).astype(jnp.float32) * jnp.float32(2**-24),
          "z": (x >> 24).astype(jnp.bfloat16),
          "step": step}


def compare(actual: Any, expected: Any) -> list[str]:
  """Leaf by leaf differences (dtype, shape, raw bytes; Python types)."""
  flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  flat_e = jax.tree_util.tree_flatten_with_path(expected)[0]
  if [p for p, _ in flat_a] != [p for p, _ in flat_e]:
    return [f"tree paths differ: {[p for p, _ in flat_a]}"]
  diffs = []
  for (path, a), (_, e) in zip(flat_a, flat_e):
    where = jax.tree_util.keystr(path)
    if isinstance(e, int):
      if type(a) is not int or a != e:
        diffs.append(f"{where}: {a!r} != {e!r}")
      continue
    a, e = np.asarray(a), np.asarray(e)
    if a.dtype != e.dtype or a.shape != e.shape:
      diffs.append(f"{where}: {a.dtype}{a.shape} != {e.dtype}{e.shape}")
    elif a.tobytes() != e.tobytes():
      bad = np.flatnonzero(a.reshape(-1).view(np.uint8)
                           != e.reshape(-1).view(np.uint8))
      diffs.append(f"{where}: {bad.size} bytes differ, first at byte"
                   f" {bad[0]}")
  return diffs


def stale_entries(directory: str) -> list[str]:
  """Unfinished entries: `<n>.partial`, `<n>.deleting`, unmarked `<n>`."""
  out = []
  for name in sorted(os.listdir(directory)):
    m = _STALE.fullmatch(name)
    if m and (m.group(2) or not os.path.exists(
        os.path.join(directory, name, atomicity.COMMIT_MARKER))):
      out.append(name)
  return out


def _die(moment: str, step: int) -> None:
  # One write of a complete line before the kill, so the harness sees it.
  print(json.dumps({"killed_at": moment, "step": step}), flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def _step_of(path: Any) -> int:
  """The step of a path inside (or of) a step directory."""
  for part in reversed(os.fspath(path).split(os.sep)):
    m = _STALE.fullmatch(part)
    if m:
      return int(m.group(1))
  raise ValueError(f"no step directory in {path}")


def install_hook(moment: str, kill_on: int, saving: list[int]) -> None:
  """Wraps the package function where `moment` happens with a SIGKILL.

  Args:
    moment: a key of `MOMENTS`.
    kill_on: kill at this occurrence of the moment (1 = the first).
    saving: saving[0] is the step whose `save` the train loop is in.
  """
  seen = [0]
  lock = threading.Lock()

  def due() -> bool:
    with lock:
      seen[0] += 1
      return seen[0] == kill_on

  def wrap(owner: Any, name: str,
           make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    setattr(owner, name, make(getattr(owner, name)))

  if moment == "snapshot":
    # The manager calls its own import of take_snapshot.
    def snapshot(real):
      def hooked(*args, **kwargs):
        leaves = real(*args, **kwargs)
        if due():
          _die(moment, saving[0])
        return leaves
      return hooked
    wrap(manager_lib, "take_snapshot", snapshot)
  elif moment == "write":
    writing = [None]  # The step whose files this process writes.

    def write_process_files(real):
      def hooked(step_dir, *args, **kwargs):
        writing[0] = _step_of(step_dir)
        return real(step_dir, *args, **kwargs)
      return hooked

    def write_shard(real):
      def hooked(data_file, buf, offset):
        if due():
          # Unbuffered and direct writes: these bytes hit the file.
          real(data_file, buf[:len(buf) // 2], offset)
          _die(moment, writing[0])
        real(data_file, buf, offset)
      return hooked
    wrap(writer, "write_process_files", write_process_files)
    wrap(datafile.DataFile, "write", write_shard)
  elif moment == "finalize_manifest":
    def write_manifest(real):
      def hooked(step_dir, **kwargs):
        manifest = real(step_dir, **kwargs)
        if due():
          _die(moment, _step_of(step_dir))
        return manifest
      return hooked
    wrap(writer, "write_manifest", write_manifest)
  elif moment == "finalize_marker":
    def write_small(real):
      def hooked(self, path, text):
        real(self, path, text)
        if path.name == atomicity.COMMIT_MARKER and due():
          _die(moment, _step_of(path))
      return hooked
    wrap(backend_lib.LocalBackend, "write_small", write_small)
  elif moment == "finalize_renamed":
    def finalize(real):
      def hooked(self):
        real(self)
        if due():
          _die(moment, self.step)
      return hooked
    wrap(atomicity.AtomicRenamePath, "finalize", finalize)
    wrap(atomicity.CommitFilePath, "finalize", finalize)
  elif moment in ("retention_renamed", "retention_partial"):
    # delete_step removes `<step>.deleting` twice: a leftover before the
    # rename (normally absent), then the renamed step; the hook takes the
    # second, i.e. the first call that finds the directory there.
    def remove(real):
      def hooked(self, path):
        if (path.name.endswith(atomicity.DELETING_SUFFIX) and path.exists()
            and due()):
          if moment == "retention_partial":
            # As if rmtree got part of the way: the data, then the manifest.
            real(self, path / files.DATA_DIR)
            (path / files.MANIFEST).unlink()
          _die(moment, _step_of(path))
        real(self, path)
      return hooked
    wrap(backend_lib.Backend, "remove", remove)
  else:
    raise ValueError(f"unknown CRASH_KILL_AT {moment!r}; one of"
                     f" {sorted(MOMENTS)}")


def main() -> None:
  directory = sys.argv[1]
  moment = os.environ.get("CRASH_KILL_AT")
  kill_on = int(os.environ.get("CRASH_KILL_ON", "1"))
  atomicity_mode = os.environ.get("CRASH_ATOMICITY", "rename")

  shardings = _shardings()
  init = expected_state(0)
  init["arrays"] = jax.device_put(init["arrays"], shardings)
  train_step = jax.jit(_step_fn, donate_argnums=0, out_shardings=shardings)

  cb = CheckpointCallback(directory, every_steps=EVERY_STEPS,
                          max_to_keep=MAX_TO_KEEP,
                          storage=Storage(atomicity=atomicity_mode))
  report: dict[str, Any] = {
      "stale_entries_after_open": stale_entries(directory),
      "finalized_after_open": cb.manager.all_steps(),
      "error": None,
  }
  try:
    state = cb.restore_or_initialize(init)
  except CheckpointCorruptedError as e:
    report.update(restored_step=None, verified=False,
                  error=f"{type(e).__name__}: {e}")
    print(json.dumps(report), flush=True)
    sys.exit(1)
  step = cb.restored_step or 0
  diffs = compare(state, expected_state(step))
  # Every finalized step, not only the one restored: a crash must never leave
  # a finalized step that is damaged, even one that is not the newest.
  others = {}
  for s in report["finalized_after_open"]:
    if s == cb.restored_step:
      continue
    try:
      d = compare(cb.manager.restore(init, s), expected_state(s))
    except (CheckpointCorruptedError, FileNotFoundError) as e:
      d = [f"{type(e).__name__}: {e}"]
    if d:
      others[s] = d
  report.update(restored_step=cb.restored_step, verified=not diffs,
                diffs=diffs, other_steps_bad=others)
  print(json.dumps(report), flush=True)
  if os.environ.get("CRASH_REPORT_ONLY"):
    cb.close()
    return

  saving = [step]
  if moment:
    install_hook(moment, kill_on, saving)
  print("TRAINING", flush=True)
  arrays, count = state["arrays"], state["count"]
  while True:
    arrays = train_step(arrays)
    count += 1
    saving[0] = count
    cb(count, {"arrays": arrays, "count": count})
    if cb.should_stop:  # A SIGTERM: the step is saved, so stop like a job.
      cb.close()
      sys.exit(PREEMPTED_EXIT_CODE)
    if moment and count - step > HOOK_PATIENCE:
      # The package no longer goes through the wrapped function: say so at
      # once rather than let the harness wait for its deadline.
      sys.exit(f"the {moment} hook did not fire in {HOOK_PATIENCE} saves")


if __name__ == "__main__":
  main()
