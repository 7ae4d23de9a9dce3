"""Memory of a cast restore and of an export, each in a fresh process.

    python benchmarks/travel.py                      # 1 GB cast, 2 GB export
    python benchmarks/travel.py --cast-mb 16 --export-mb 16 \\
        --json /tmp/travel.json                      # seconds, for CI

1. cast restore: a float32 state of `--cast-mb` MB (8 leaves) is saved, and
   a new process restores it with `restore(target, cast=True)` into a
   bfloat16 target (`jax.ShapeDtypeStruct`s, on the CPU device). Its peak
   RSS is reset once JAX is up and has run a small program (as a training
   job has built its model before it restores; JAX's first program costs
   about 44 MB of its own); the figure is how far the peak rose during
   the restore, against the restored state's bytes (half the saved ones).
   Twice, each in a new process: cold, and warm, after a restore of one
   leaf in the same process. For reference, a cold restore of the same
   step without a cast, into float32: what its peak rose by beyond its
   restored state is the restore's own one-time costs. The values are
   checked against `jnp.asarray(saved, jnp.bfloat16)` on a sample of each
   leaf.
2. export: a float32 state of `--export-mb` MB (8 leaves) is saved, and a
   new process (without JAX) exports it to safetensors, then another to
   npz; the figure is each process's whole peak RSS (`VmHWM`).

Each child prints one JSON line; this script prints a table and writes
every figure with `--json`. Everything it writes under `--dir` is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

LEAVES = 8
COLS = 1024


def _status_bytes(field: str) -> int:
  """A `VmRSS`/`VmHWM`-like field of /proc/self/status, in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
  """Sets VmHWM to the current RSS (Linux 4.0+)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def _rows(mb: int) -> int:
  return max(1, mb * 10**6 // (LEAVES * COLS * 4))


def _values(i: int, rows: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(i)
  return rng.standard_normal((rows, COLS), dtype=np.float32)


def save(directory: str, mb: int) -> dict:
  """Saves step 1: `LEAVES` float32 leaves of about `mb` MB in all."""
  from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top
  rows = _rows(mb)
  state = {f"layer_{i}": _values(i, rows) for i in range(LEAVES)}
  with CheckpointManager(directory) as manager:
    manager.save(1, state)
  return {"saved_bytes": sum(v.nbytes for v in state.values())}


def cast_restore(directory: str, mb: int, warm: bool,
                 dtype: str = "bfloat16") -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top
  rows = _rows(mb)
  target = {f"layer_{i}": jax.ShapeDtypeStruct((rows, COLS), dtype)
            for i in range(LEAVES)}
  # The runtime is up, and has run a program, before the peak is reset: a
  # training job restores after building its model on the devices.
  jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones(8)))
  with CheckpointManager(directory, read_only=True) as manager:
    if warm:
      jax.block_until_ready(manager.restore(
          {"layer_0": target["layer_0"]}, partial=True, cast=True))
    before = _status_bytes("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    restored = jax.block_until_ready(
        manager.restore(target, cast=dtype != "float32"))
    secs = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
  restored_bytes = sum(v.nbytes for v in restored.values())
  exact = True
  for i in range(LEAVES):  # A sample of each leaf: rows of the start, end.
    want = _values(i, rows)[[0, rows // 2, rows - 1]]
    got = np.asarray(restored[f"layer_{i}"][np.array([0, rows // 2,
                                                      rows - 1])])
    exact &= got.tobytes() == np.asarray(jnp.asarray(want, dtype)).tobytes()
  return {"restored_bytes": restored_bytes, "rss_before": before,
          "peak_rss": peak, "peak_above_before": peak - before,
          "secs": secs, "exact": bool(exact)}


def export(directory: str, fmt: str, out: str) -> dict:
  from flax_ckpt_plugin.tools import exporting  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  result = exporting.export(directory, out, format=fmt)
  secs = time.perf_counter() - t0
  files = sum(os.path.getsize(os.path.join(out, f)) for f in result.files)
  return {"peak_rss": _status_bytes("VmHWM"), "secs": secs,
          "exported_bytes": result.nbytes, "file_bytes": files,
          "jax_imported": "jax" in sys.modules}


def _child(*args: str) -> dict:
  proc = subprocess.run([sys.executable, __file__, "--child", *args],
                        capture_output=True, text=True, check=False,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  if proc.returncode != 0:
    raise RuntimeError(f"{args[0]} failed:\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _mb(n: float) -> str:
  return f"{n / 1e6:.0f} MB"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cast-mb", type=int, default=1000)
  parser.add_argument("--export-mb", type=int, default=2000)
  parser.add_argument("--dir", default=None, help="where to write (a disk)")
  parser.add_argument("--json", default=None)
  parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    stage, rest = args.child[0], args.child[1:]
    fn = {"save": lambda d, mb: save(d, int(mb)),
          "cast": lambda d, mb: cast_restore(d, int(mb), warm=False),
          "cast_warm": lambda d, mb: cast_restore(d, int(mb), warm=True),
          "plain": lambda d, mb: cast_restore(d, int(mb), warm=False,
                                              dtype="float32"),
          "export": export}[stage]
    print(json.dumps(fn(*rest)))
    return
  root = tempfile.mkdtemp(prefix="travel-", dir=args.dir)
  try:
    cast_dir, export_dir = os.path.join(root, "cast"), os.path.join(root, "x")
    result = {"cast_save": _child("save", cast_dir, str(args.cast_mb))}
    result["cast"] = cast = _child("cast", cast_dir, str(args.cast_mb))
    result["cast_warm"] = warm = _child("cast_warm", cast_dir,
                                        str(args.cast_mb))
    result["plain"] = plain = _child("plain", cast_dir, str(args.cast_mb))
    shutil.rmtree(cast_dir)
    result["export_save"] = _child("save", export_dir, str(args.export_mb))
    for fmt in ("safetensors", "npz"):
      out = os.path.join(root, f"out_{fmt}")
      result[fmt] = _child("export", export_dir, fmt, out)
      shutil.rmtree(out)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  ratio = cast["peak_above_before"] / cast["restored_bytes"]
  result["cast_peak_over_restored"] = ratio
  warm_ratio = warm["peak_above_before"] / warm["restored_bytes"]
  result["cast_warm_peak_over_restored"] = warm_ratio
  print(f"cast restore of {_mb(result['cast_save']['saved_bytes'])} float32"
        f" into bfloat16 ({_mb(cast['restored_bytes'])} restored), in a"
        " fresh process:")
  for name, r, x in (("cold", cast, ratio), ("warm", warm, warm_ratio)):
    print(f"  {name}: peak RSS rose by {_mb(r['peak_above_before'])} during"
          f" the restore: {x:.3f} x the restored state (limit 1.10);"
          f" {r['secs']:.2f} s; values exact: {r['exact']}")
  print(f"  reference, without a cast into float32, cold: peak RSS rose by"
        f" {_mb(plain['peak_above_before'] - plain['restored_bytes'])} beyond"
        f" its restored state ({_mb(plain['restored_bytes'])})")
  print(f"export of {_mb(result['export_save']['saved_bytes'])} float32,"
        " each in a fresh process without JAX:")
  for fmt in ("safetensors", "npz"):
    r = result[fmt]
    print(f"  {fmt:<12} peak RSS {_mb(r['peak_rss'])} (limit 600 MB),"
          f" {r['secs']:.2f} s, {_mb(r['file_bytes'])} written,"
          f" JAX imported: {r['jax_imported']}")
  if args.json:  # Every figure, for scripts.
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
