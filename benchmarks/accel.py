"""flax_ckpt_plugin against Orbax on whatever backend JAX has (an accelerator).

    python benchmarks/accel.py --cold           # 4 x 8192^2 float32 + Adam: 3.2 GB
    python benchmarks/accel.py --gb 3,13,40 --cold # 3.2, 12.9 and 40 GB in turn
                                                   # (a size skipped where the
                                                   # host lacks 4.2x it for Orbax)
    python benchmarks/accel.py --layers 2 --width 256 --repeats 1  # CPU, seconds
    FLAX_CKPT_PLUGIN_PINNED_CPU=1 python benchmarks/accel.py ...   # CPU devices
        take the accelerator path (pinned host memory), as in the tests

The state is bench.py's: a Flax `TrainState` of `--layers` Dense layers of
`--width` x `--width` float32 with Adam, on device 0, trained by a jitted
step that donates it. Each system runs `--repeats` times, alternating which goes
first, each run in fresh processes of its own. The systems: ours (direct
I/O, and the kernel reads each final step back into the page cache in the
background); ours leaving the files on the disk only (`ours_disk_only`:
`LocalBackend(cache_saved=False)`); ours writing through the page cache
(`ours_page_cache`: `LocalBackend(direct_io=False)`, so a restore on the
same machine reads memory, as Orbax's does); Orbax.

1. The save process. The step's time with no saves first. Ours is then
   warmed up as `CheckpointCallback.restore_or_initialize` does it
   (`CheckpointManager.warm_up`, timed: it starts the thread that pins the
   saves' memory), and the first save comes after `--first-after-secs` of
   training, each step timed (the steps while memory is pinned behind
   them). It measures: what the first save found not pinned yet, when the
   pinning was done; the first save's
   blocking time and its time until durable; a second save, isolated
   (nothing pending), until durable; then two loops, one that waits for
   each step (synced: it logs its loss) and one that does not, each saving
   `--loop-saves` times with the saves spaced wider than a save lasts
   (1.25 x the slowest save to durable so far, in steps). For every save:
   its blocking time, and a digest of the state taken on the device just
   before the save call (a weighted sum of the bits of every leaf), which
   the next step's donation cannot change. The loops' overhead is their
   time over the same steps without saves, per save. Then the peak RSS.
2. The restore process: the first restore in a fresh process of the last
   step saved, into an abstract target on device 0, until the arrays are
   ready, with the step's files as the save left them in the page cache;
   then `--later-restores` more (their median); then (ours, and Orbax with
   --verify-all) every saved step restored and its digest compared with
   the one taken at its save: bit-identical under donation. Its peak RSS.
3. With `--cold`, one more fresh process restores the last step after its
   files were dropped from the page cache (`POSIX_FADV_DONTNEED`), as on a
   machine that did not write them.

A first process measures the machine: device to host into pinned host
memory (`jax.device_put` onto `memory_kind="pinned_host"`) and into
pageable memory (`np.asarray`), host to device from each, on one leaf's
worth of bytes (`--rate-mb`); and the disk: a buffered write with fsync,
a read from the disk and one from the page cache, of 4 times that.

It prints medians over runs with the ratios to Orbax, and writes all
figures to `--json` (and every process's output to `--logs`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import bench
import machine
import scaling
from flax_ckpt_plugin import Storage

# "ours_disk_only": ours with a saved step's files left on the disk only;
# "ours_page_cache": ours with every byte written through the page cache
# (no direct I/O), so that a restore on the same machine reads memory.
SYSTEMS = ("ours", "ours_disk_only", "ours_page_cache", "orbax")
BACKENDS = {"ours_disk_only": {"cache_saved": False},
            "ours_page_cache": {"direct_io": False}}
DIGESTS = "digests.json"


def _peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _rounded(figures: dict) -> dict:
  return {k: round(v, 2) for k, v in figures.items()}


def _rss_gb() -> float:
  """This process's resident memory now (pinned host memory included)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024 / 1e9
  return float("nan")


def _build(args: argparse.Namespace):
  """bench.py's TrainState (its creation, not run), its donating step, and
  the digest."""
  import jax  # pylint: disable=g-import-not-at-top
  create, train_step = bench.model(args)
  return jax.jit(create), train_step, digest_fn()


def digest_fn():
  """A jitted digest of a tree: per leaf, sums of its bits weighted by
  position (uint32 arithmetic), so any changed or moved element shows."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top

  def leaf(a):
    a = jnp.ravel(a)
    width = a.dtype.itemsize
    if a.dtype == jnp.bool_:
      bits = a.astype(jnp.uint32)
    else:
      bits = lax.bitcast_convert_type(
          a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
              8: jnp.uint32}[width]).astype(jnp.uint32).ravel()
    pos = lax.iota(jnp.uint32, bits.shape[0])
    return jnp.stack([jnp.sum(bits * (pos * jnp.uint32(2654435761) + 1)),
                      jnp.sum(bits ^ pos)])

  return jax.jit(lambda tree: [leaf(a) for a in jax.tree.leaves(tree)])


def _system(name: str):
  """(open_manager, save, restore) of one system; every step is kept."""
  if name in BACKENDS:
    import flax_ckpt_plugin  # pylint: disable=g-import-not-at-top
    from flax_ckpt_plugin.backends import registry  # pylint: disable=g-import-not-at-top
    _, save, restore = scaling.system("ours", max_to_keep=None)

    def open_manager(directory):
      return flax_ckpt_plugin.CheckpointManager(
          directory, max_to_keep=None,
          storage=Storage(backend=registry.LocalBackend(**BACKENDS[name])))

    return open_manager, save, restore
  return scaling.system("orbax" if name == "orbax" else "ours",
                        max_to_keep=None)


def _host(tree) -> list[list[int]]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  return [np.asarray(d).astype(np.int64).tolist() for d in tree]


def _save_worker(args: argparse.Namespace) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  create, train_step, digest = _build(args)
  open_manager, save, restore = _system(args.worker)
  state = create()
  for _ in range(2):  # Compile and warm up.
    state, loss = train_step(state)
    float(loss)
  jax.block_until_ready(digest(state))
  leaves = jax.tree.leaves(state)
  out = {"system": args.worker, "backend": jax.default_backend(),
         "device": str(jax.devices()[0].device_kind),
         "jax": jax.__version__, "state_bytes": sum(a.nbytes for a in leaves)}
  ours = args.worker.startswith("ours")
  if ours:
    from flax_ckpt_plugin.arrays import pinned  # pylint: disable=g-import-not-at-top
    out["pinned_path"] = pinned.takes(jax.devices()[0])

  def steps(n, synced=True):
    nonlocal state
    t = time.perf_counter()
    for _ in range(n):
      state, loss = train_step(state)
      if synced:
        float(loss)
    jax.block_until_ready(state)
    return time.perf_counter() - t

  out["step_secs"] = steps(20) / 20
  # Where host memory goes: after JAX, the state and the step; after the
  # warm-up; after the first save; at the end (and the peak).
  rss = out["rss_gb_at"] = {"trained": _rss_gb()}
  mngr = open_manager(os.path.join(args.ckpt_root, "ckpt"))
  pinning = getattr(mngr, "_pinned", None)  # Ours: the saves' pinned memory.
  if ours:  # As CheckpointCallback.restore_or_initialize does.
    t = time.perf_counter()
    mngr.warm_up(state)
    out["warm_up_secs"] = time.perf_counter() - t
    # The loop runs while a thread pins the saves' memory: each step's time
    # (waited for), until the first save.
    times = []
    while time.perf_counter() - t < args.first_after_secs:
      times.append(steps(1))
    out["steps_while_pinning_secs"] = times
    out["pinned_before_first_save"] = pinning.wait_reserved(0)
    rss["warmed_up"] = _rss_gb()
  else:
    steps(math.ceil(args.first_after_secs / out["step_secs"]))
  digests = {}
  saved_at = 0

  def save_now(step, wait):
    nonlocal saved_at
    digests[step] = digest(state)  # Enqueued before the save and the step.
    t = time.perf_counter()
    save(mngr, step, state)
    blocking = time.perf_counter() - t
    durable = None
    if wait:
      mngr.wait_until_finished()
      durable = time.perf_counter() - t
    saved_at = step
    return blocking, durable

  out["first_save_blocking_secs"], out["first_save_durable_secs"] = save_now(
      1, True)
  rss["first_saved"] = _rss_gb()
  if ours:  # What the first save found not pinned yet, and when it was.
    out["first_save_unpinned_bytes"] = mngr.last_save_stats.unpinned_bytes
    pinning.wait_reserved(600)
    out["pinning_done_secs"] = time.perf_counter() - t
    out["pinned_gb"] = pinning.reserved_bytes / 1e9
  out["isolated_save_blocking_secs"], out["isolated_save_durable_secs"] = (
      save_now(2, True))
  every = max(args.every, math.ceil(
      1.25 * max(out["first_save_durable_secs"],
                 out["isolated_save_durable_secs"]) / out["step_secs"]))
  out["every_steps"] = every
  step = 2
  for synced in (True, False) if args.loop_saves else ():
    name = "synced" if synced else "unsynced"
    blocking = []
    baseline = steps(every, synced)  # The same steps without a save.
    t = time.perf_counter()
    for _ in range(args.loop_saves):
      state, loss = train_step(state)
      if synced:
        float(loss)
      step += 1
      blocking.append(save_now(step, False)[0])
      steps(every - 1, synced)
    mngr.wait_until_finished()
    secs = time.perf_counter() - t
    out[f"{name}_blocking_secs"] = blocking
    out[f"{name}_overhead_per_save_secs"] = (
        secs - args.loop_saves * baseline) / args.loop_saves
    out[f"{name}_overhead"] = secs / (args.loop_saves * baseline) - 1
  out["later_save_blocking_secs"] = (
      out.get("synced_blocking_secs", []) + out.get("unsynced_blocking_secs",
                                                    []))
  # The restore of the newest step in the process that saved it, right
  # after the save (an eval of the saved step, an elastic recovery): ours
  # takes its bytes from the snapshot it still holds (`backends.held`).
  mngr.wait_until_finished()
  target = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      state)
  t = time.perf_counter()
  restored = restore(mngr, saved_at, target)
  jax.block_until_ready(restored)
  out["restore_after_save_secs"] = time.perf_counter() - t
  out["restore_after_save_identical"] = (
      _host(digest(restored)) == _host(digests[saved_at]))
  if ours:
    out["restore_after_save_from_memory_bytes"] = (
        mngr.last_restore_stats.nbytes_from_memory)
  restored = None
  rss["restored_after_save"] = _rss_gb()
  mngr.close()
  rss["closed"] = _rss_gb()
  out["peak_rss_gb"] = _peak_rss_gb()
  with open(os.path.join(args.ckpt_root, DIGESTS), "w") as f:
    json.dump({"last": saved_at,
               "digests": {s: _host(d) for s, d in digests.items()}}, f)
  return out


def _restore_worker(args: argparse.Namespace) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  create, _, digest = _build(args)
  open_manager, _, restore = _system(args.worker)
  with open(os.path.join(args.ckpt_root, DIGESTS)) as f:
    saved = json.load(f)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
      jax.eval_shape(create))
  out = {}
  if args.phase == "cold":  # The step's files leave the page cache.
    out["evicted_bytes"] = _evict(os.path.join(args.ckpt_root, "ckpt"))
  mngr = open_manager(os.path.join(args.ckpt_root, "ckpt"))
  rss = {"opened": _rss_gb()}
  t = time.perf_counter()
  restored = restore(mngr, saved["last"], target)
  jax.block_until_ready(restored)
  out["first_restore_secs"] = time.perf_counter() - t
  rss["restored"] = _rss_gb()
  rss["peak_first"] = _peak_rss_gb()
  if args.phase == "cold":
    mngr.close()
    return {"cold_first_restore_secs": out["first_restore_secs"],
            "evicted_bytes": out["evicted_bytes"]}
  out["later_restore_secs"] = []
  for _ in range(args.later_restores):
    restored = None  # Freed first, as a job's old state would be.
    t = time.perf_counter()
    restored = restore(mngr, saved["last"], target)
    jax.block_until_ready(restored)
    out["later_restore_secs"].append(time.perf_counter() - t)
  restored = None
  if args.worker.startswith("ours") or args.verify_all:
    identical = []
    for step, expected in sorted(saved["digests"].items(),
                                 key=lambda kv: int(kv[0])):
      got = _host(digest(restore(mngr, int(step), target)))
      identical.append(got == expected)
    out["saves_bit_identical"] = identical
  mngr.close()
  out["restore_rss_gb_at"] = rss
  out["peak_rss_gb"] = _peak_rss_gb()
  return out


def _evict(root: str) -> int:
  """Drops every file under `root` from the page cache (it was fsynced, so
  its pages are clean); returns their bytes."""
  total = 0
  for dirpath, _, names in os.walk(root):
    for name in names:
      fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        total += os.fstat(fd).st_size
      finally:
        os.close(fd)
  return total


def _disk_rates(directory: str | None, nbytes: int) -> dict:
  """GB/s of a buffered write with fsync, a read from the disk (the file
  dropped from the page cache first), one with direct I/O by many threads,
  and a read from the page cache."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  root = tempfile.mkdtemp(dir=directory)
  path = os.path.join(root, "rate.bin")
  chunk = np.ones(64 << 20, np.uint8)
  n = max(1, nbytes // chunk.nbytes)
  out = {}
  try:
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
      for _ in range(n):
        f.write(memoryview(chunk))
      os.fsync(f.fileno())
    out["disk_write_fsync_gbps"] = n * chunk.nbytes / 1e9 / (
        time.perf_counter() - t)
    out["disk_write_direct_gbps"] = machine.direct_write_gbps(
        os.path.join(root, "direct.bin"), n * chunk.nbytes)
    for name, evict in (("disk_read_gbps", True),
                        ("page_cache_read_gbps", False)):
      if evict:
        _evict(root)
      t = time.perf_counter()
      with open(path, "rb", buffering=0) as f:
        while f.readinto(chunk):
          pass
      out[name] = n * chunk.nbytes / 1e9 / (time.perf_counter() - t)
    out["disk_read_direct_gbps"] = _direct_read_rate(root, path,
                                                     n * chunk.nbytes)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return out


def _direct_read_rate(root: str, path: str, nbytes: int) -> float | None:
  """GB/s of the disk's best read: 16 threads reading 32 MB each with
  direct I/O, so many requests are in flight (what no restore beats from
  the disk); None where the file system takes no direct I/O."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  import mmap  # pylint: disable=g-import-not-at-top
  piece = 32 << 20
  _evict(root)
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
  except OSError:
    return None
  buf = mmap.mmap(-1, nbytes)  # Page-aligned, as direct I/O needs.
  view = memoryview(buf)
  try:
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
      list(pool.map(lambda lo: os.preadv(fd, [view[lo:lo + piece]], lo),
                    range(0, nbytes, piece)))
    return nbytes / 1e9 / (time.perf_counter() - t)
  except OSError:
    return None
  finally:
    view.release()
    buf.close()
    os.close(fd)


def _rates_worker(args: argparse.Namespace) -> dict:
  """GB/s of each way between the device and host memory."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  n = int(args.rate_mb * 1e6) // 4
  x = jnp.arange(n, dtype=jnp.float32)
  x.block_until_ready()
  gb = x.nbytes / 1e9
  pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  on_device = jax.sharding.SingleDeviceSharding(
      dev, memory_kind=dev.default_memory().kind)

  def best(fn, reps=3):
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t)
    return gb / min(times)

  out = {"bytes": x.nbytes}
  try:
    jax.device_put(x, pinned).block_until_ready()  # Pins its memory once.
    out["d2h_pinned_gbps"] = best(
        lambda: jax.device_put(x, pinned).block_until_ready())
    held = jax.device_put(x, pinned)
    out["h2d_pinned_gbps"] = best(
        lambda: jax.device_put(held, on_device).block_until_ready())
  except Exception as e:  # pylint: disable=broad-except
    out["pinned_error"] = repr(e)[:300]

  def pageable():
    y = x + 0  # A new array: no host copy cached on it.
    y.block_until_ready()
    t = time.perf_counter()
    np.asarray(y)
    return time.perf_counter() - t

  pageable()
  out["d2h_pageable_gbps"] = gb / min(pageable() for _ in range(3))
  host = np.asarray(x).copy()
  out["h2d_pageable_gbps"] = best(
      lambda: jax.device_put(host, on_device).block_until_ready())
  out.update(_disk_rates(args.dir, x.nbytes * 4))
  return out


def _run(script: str, argv: list[str], extra: list[str],
         logs: str | None) -> dict:
  proc = subprocess.run([sys.executable, script, *argv, *extra],
                        capture_output=True, text=True, check=False)
  if logs:
    name = "_".join(a for a in extra if not a.startswith(("-", "/")))
    with open(os.path.join(logs, f"{name}.log"), "a") as f:
      f.write(proc.stdout + proc.stderr)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(extra)} failed:\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-6000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(values) -> float:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else float("nan")


FIGURES = (  # (label, key, how to pool one run, target ours/Orbax)
    ("warm-up at start: the call (s)", "warm_up_secs", None, ""),
    ("  steps while it pins memory, median (s)", "steps_while_pinning_secs",
     "median", ""),
    ("  steps while it pins memory, max (s)", "steps_while_pinning_secs",
     "max", ""),
    ("  memory pinned (from the warm-up, s)", "pinning_done_secs", None, ""),
    ("first save: blocking (s)", "first_save_blocking_secs", None, "<= 1"),
    ("later saves: blocking, median (s)", "later_save_blocking_secs",
     "median", "<= 0.1"),
    ("later saves: blocking, max (s)", "later_save_blocking_secs", "max",
     ""),
    ("isolated save to durable (s)", "isolated_save_durable_secs", None,
     "<= 0.7"),
    ("first save to durable (s)", "first_save_durable_secs", None, ""),
    ("loop overhead per save, synced (s)", "synced_overhead_per_save_secs",
     None, ""),
    ("loop overhead per save, unsynced (s)",
     "unsynced_overhead_per_save_secs", None, ""),
    ("restore right after the save, saving process (s)",
     "restore_after_save_secs", None, "<= 0.2"),
    ("first restore, fresh process (s)", "first_restore_secs", None,
     "<= 0.8"),
    ("  the same, files evicted first (s)", "cold_first_restore_secs", None,
     ""),
    ("later restores, median (s)", "later_restore_secs", "median", "<= 0.3"),
    ("peak host RSS, save process (GB)", "save_peak_rss_gb", None, ""),
    ("peak host RSS, restore process (GB)", "restore_peak_rss_gb", None, ""),
    ("peak host RSS, either (GB)", "peak_rss_gb", None, "<= 0.7"),
)


def _pooled(run: dict, key: str, pool: str | None) -> float | None:
  value = run.get(key)
  if pool is None:
    return value
  if not value:  # No loops: no later saves.
    return None
  return _median(value) if pool == "median" else max(value)


def summarize(results: dict[str, list[dict]]) -> dict:
  s = {}
  for name, runs in results.items():
    if not runs:
      continue
    s[name] = {}
    for _, key, pool, _ in FIGURES:
      s[name][key + ("_max" if pool == "max" else "")] = _median(
          [_pooled(r, key, pool) for r in runs])
    s[name]["saves_bit_identical"] = [
        all(r["saves_bit_identical"]) for r in runs
        if "saves_bit_identical" in r]
  base = s.get("orbax")
  s["ratios"] = {name: {k: v / base[k] if base and base[k] else float("nan")
                        for k, v in s[name].items()
                        if k != "saves_bit_identical"}
                 for name in s if name != "orbax"}
  return s


def print_table(s: dict, runs: dict, rates: dict) -> None:
  first = runs["ours"][0]
  print(f"\nbackend {first['backend']} ({first['device']}), jax"
        f" {first['jax']}; state {first['state_bytes'] / 1e9:.2f} GB; ours"
        f" through pinned host memory: {first.get('pinned_path')};"
        f" median of {len(runs['ours'])} run(s) per system; steps of"
        f" {first['step_secs'] * 1e3:.1f} ms")
  names = [n for n in SYSTEMS if n in s]
  ours = [n for n in names if n != "orbax"]
  rows = []
  for label, key, pool, target in FIGURES:
    key = key + ("_max" if pool == "max" else "")
    rows.append((label, *(f"{s[n][key]:.4f}" for n in names),
                 *(f"{s['ratios'][n][key]:.3f}" for n in ours), target))
  head = ("", *names, *(f"{n}/orbax" for n in ours), "target")
  widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
  for row in [head] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
  print("every save restored bit-identical (per run): " + ", ".join(
      f"{n} {s[n]['saves_bit_identical'] or 'not checked'}" for n in names))
  direct = rates.get("disk_write_direct_gbps")
  if direct:
    gb = first["state_bytes"] / 1e9
    print("isolated save to durable / the disk's direct-write rate: " +
          ", ".join(f"{n} {gb / s[n]['isolated_save_durable_secs'] / direct:.2f}"
                    for n in names) + " (target: ours >= 0.8)")
  print("machine: " + ", ".join(
      f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
      for k, v in rates.items()))


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gb", default=None,
                      help="state sizes in GB, comma-separated (e.g. 3,13):"
                      " each runs in turn, its --layers of --width chosen"
                      " to come nearest (Adam: 3 x layers x width^2 x 4"
                      " bytes); default: --layers as given")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--loop-saves", type=int, default=3,
                      help="saves in each of the two loops (0: no loops)")
  parser.add_argument("--no-rates", action="store_true",
                      help="skip the machine's transfer and disk rates")
  parser.add_argument("--every", type=int, default=4,
                      help="the fewest steps between saves in the loops")
  parser.add_argument("--first-after-secs", type=float, default=3.0,
                      help="training before the first save")
  parser.add_argument("--later-restores", type=int, default=3)
  parser.add_argument("--verify-all", action="store_true",
                      help="also check every Orbax save bit for bit")
  parser.add_argument("--rate-mb", type=float, default=None,
                      help="bytes for the transfer rates (default: one"
                      " layer's kernel)")
  parser.add_argument("--dir", default=None,
                      help="where checkpoints go (default: a temp dir)")
  parser.add_argument("--systems", default=",".join(SYSTEMS),
                      help=f"which of {', '.join(SYSTEMS)} to run")
  parser.add_argument("--cold", action="store_true",
                      help="also restore in a fresh process after dropping"
                      " the step's files from the page cache")
  parser.add_argument("--logs", default=None,
                      help="append every process's output to files here")
  parser.add_argument("--json", default=None, help="write all figures here")
  parser.add_argument("--worker", choices=SYSTEMS + ("rates",),
                      help=argparse.SUPPRESS)
  parser.add_argument("--phase", choices=("save", "restore", "cold"),
                      help=argparse.SUPPRESS)
  parser.add_argument("--ckpt-root", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.rate_mb is None:
    args.rate_mb = args.width * args.width * 4 / 1e6
  if args.worker == "rates":
    print(json.dumps(_rates_worker(args)))
    return
  if args.worker:
    print(json.dumps(_save_worker(args) if args.phase == "save"
                     else _restore_worker(args)))
    return
  if "ours" not in args.systems.split(","):
    sys.exit("--systems must include ours")
  argv = [a for a in sys.argv[1:]]
  for flag in ("--json", "--gb"):
    if flag in argv:
      i = argv.index(flag)
      del argv[i:i + 2]
  sizes = ([float(g) for g in args.gb.split(",")] if args.gb else [None])
  figures = {}
  for gb in sizes:
    if gb is not None and "orbax" in args.systems.split(",") and (
        ORBAX_HOST_FACTOR * gb * 1e9 > _host_bytes()):
      print(f"\n{gb:g} GB skipped: Orbax beside it needs about"
            f" {ORBAX_HOST_FACTOR:g}x the state in host memory, and this"
            f" host has {_host_bytes() / 1e9:.0f} GB")
      continue
    layers = args.layers if gb is None else max(1, round(
        gb * 1e9 / (3 * args.width * args.width * 4)))
    size_argv = argv + ["--layers", str(layers)] if gb is not None else argv
    figures[f"{gb:g}GB" if gb is not None else "state"] = _run_size(
        args, size_argv)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(figures if args.gb else figures["state"], f, indent=1)


# Orbax's save process peaked at about this many times the state in host
# memory (53.9 GB for 12.9 GB on an H200).
ORBAX_HOST_FACTOR = 4.2


def _host_bytes() -> int:
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _run_size(args: argparse.Namespace, argv: list[str]) -> dict:
  """Every system at one state size (`argv` says which); prints the
  table and returns the figures."""
  systems = [n for n in SYSTEMS if n in args.systems.split(",")]
  results = {name: [] for name in systems}
  if args.logs:
    os.makedirs(args.logs, exist_ok=True)
  try:
    rates = {} if args.no_rates else _run(__file__, argv,
                                          ["--worker", "rates"], args.logs)
    for rep in range(args.repeats):
      for name in systems if rep % 2 == 0 else systems[::-1]:
        root = tempfile.mkdtemp(dir=args.dir)
        try:
          extra = ["--worker", name, "--ckpt-root", root]
          run = _run(__file__, argv, extra + ["--phase", "save"], args.logs)
          restored = _run(__file__, argv, extra + ["--phase", "restore"],
                          args.logs)
          if args.cold:
            run.update(_run(__file__, argv, extra + ["--phase", "cold"],
                            args.logs))
        finally:
          shutil.rmtree(root, ignore_errors=True)
        run["save_peak_rss_gb"] = run.pop("peak_rss_gb")
        run["restore_peak_rss_gb"] = restored.pop("peak_rss_gb")
        run["peak_rss_gb"] = max(run["save_peak_rss_gb"],
                                 run["restore_peak_rss_gb"])
        run.update(restored)
        results[name].append(run)
        print(f"run {rep + 1}/{args.repeats} {name}: first save"
              f" {run['first_save_blocking_secs']:.4f} s blocking, later"
              f" {_median(run['later_save_blocking_secs']):.4f} s; isolated"
              f" durable {run['isolated_save_durable_secs']:.3f} s; first"
              f" restore {run['first_restore_secs']:.3f} s (evicted"
              f" {run.get('cold_first_restore_secs', float('nan')):.3f} s),"
              f" later {_median(run['later_restore_secs']):.3f} s;"
              f" identical {run.get('saves_bit_identical', 'not checked')};"
              f" RSS GB {_rounded(run['rss_gb_at'])}, restore"
              f" {_rounded(run['restore_rss_gb_at'])}", flush=True)
  except RuntimeError as e:
    sys.exit(str(e))
  summary = summarize(results)
  print_table(summary, results, rates)
  return {"args": vars(args), "argv": argv, "runs": results, "rates": rates,
          "summary": summary}


if __name__ == "__main__":
  main()
