"""Saves and restores as processes are added, over simulated per-host links.

    python benchmarks/scaleout.py                       # 64 MB, 1/2/4 processes
    python benchmarks/scaleout.py --mb 8 --processes 1,2 --json /tmp/s.json

A SIMULATION of per-host network links: every process reaches storage
through a backend (`PacedBackend`) that paces its own reads and writes at
`--mbps` MB/s (a process's data file is durable once its bytes would have
crossed the link; each ranged read takes its bytes' time on it). The disk
itself is this machine's. A job whose every host writes its share of the
state then saves in 1/N of the time one host takes; a job that leaves it to
one host does not get faster.

For each layout and process count (`--processes`, 2 CPU devices each):

* `data_parallel`: every array replicated on all devices;
* `hsdp`: arrays split over the 2 devices of a process, replicated over
  the processes;

the processes save two steps of a state of `--mb` MB (Adam-like: kernels
with two moments, small biases) and restore the second into the same
shardings, every process together (`restore_newest_valid`: the processes
split what several of them need and share it over JAX collectives, see
`shared_read`). Measured: the slowest process's time blocked in the
second `save` and from it to durable (the first save in a process also
compiles the programs that copy its shards, once per run), its time for
the restore, and the bytes each process wrote and read. Then Orbax saves the
same state in the same processes (StandardCheckpointer, unpaced): the bytes
each process wrote, from its `ocdbt.process_N` files. Every restore is
checked bit for bit. Prints a table; `--json` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any
from flax_ckpt_plugin import Processes
from flax_ckpt_plugin import Storage

LAYOUTS = ("data_parallel", "hsdp")


# -- the paced storage ----------------------------------------------------------


def paced_backend(mbps: float):
  """A local-disk backend whose writes and reads take `mbps` MB/s per
  process (see the module doc)."""
  from flax_ckpt_plugin.backends import registry as backend_lib  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin.backends import handles  # pylint: disable=g-import-not-at-top

  rate = mbps * 1e6
  link = threading.Lock()  # One link per process: its transfers queue.

  class Link:
    """Time on this process's link: `take(n)` returns when `n` bytes
    would have crossed it after what was already queued."""
    free_at = 0.0

    @classmethod
    def take(cls, nbytes: int) -> None:
      with link:
        start = max(time.monotonic(), cls.free_at)
        cls.free_at = start + nbytes / rate
        wait = cls.free_at - time.monotonic()
      if wait > 0:
        time.sleep(wait)

  class PacedWriter(handles.StepWriter):
    def __init__(self, inner: handles.StepWriter):
      self.inner = inner
      self.positional = inner.positional  # The data file goes by `sync`.

    def open(self, name):
      return self.inner.open(name)

    def open_direct(self, name):
      return None  # Every byte through `open`'s file, paced at `sync`.

    def mapping(self, f, size):
      return None

    def sync(self, f):
      Link.take(os.fstat(f.fileno()).st_size)
      self.inner.sync(f)

    def close(self):
      self.inner.close()

  class PacedFile(handles.RangedFile):
    def __init__(self, inner: handles.RangedFile):
      self.inner = inner
      self.size = inner.size

    def read_into(self, offset, out):
      n = self.inner.read_into(offset, out)
      Link.take(n)
      return n

    def close(self):
      self.inner.close()

  class PacedBackend(backend_lib.LocalBackend):
    def step_writer(self, step_dir, identity, *args, **kwargs):
      return PacedWriter(super().step_writer(step_dir, identity, *args,
                                             **kwargs))

    def open_ranged(self, path, within):
      return PacedFile(super().open_ranged(path, within))

  return PacedBackend()


# -- one process of a run -------------------------------------------------------


def _state(mesh, layout: str, mb: float):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  width = max(64, int((mb * 1e6 / 4 / 3 / 4) ** 0.5) // 64 * 64)
  spec = P() if layout == "data_parallel" else P("fsdp")
  tree = {}
  for n in range(4):  # Four width x width kernels, three copies each.
    for part in ("params", "mu", "nu"):
      values = np.random.default_rng(n).standard_normal((width, width),
                                                        np.float32)
      tree.setdefault(part, {})[f"dense_{n}"] = {
          "kernel": jax.device_put(values, NamedSharding(mesh, spec)),
          "bias": jax.device_put(np.full(width, n, np.float32),
                                 NamedSharding(mesh, P()))}
  return tree


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f))
             for root, _, files in os.walk(path) for f in files)


def worker(args: argparse.Namespace) -> dict:
  """One process: save, restore, then Orbax's save (see the module doc)."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  pid, n = int(os.environ["PROCESS_ID"]), int(os.environ["NUM_PROCESSES"])
  if n > 1:
    jax.distributed.initialize(f"127.0.0.1:{os.environ['PORT']}",
                               num_processes=n, process_id=pid)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax_ckpt_plugin import CheckpointManager  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(n, 2),
                           ("replica", "fsdp"))
  state = _state(mesh, args.layout, args.mb)
  mine = [np.asarray(s.data) for x in jax.tree.leaves(state)
          for s in x.addressable_shards]
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  out = {"process": pid, "state_bytes": sum(
      x.nbytes for x in jax.tree.leaves(state))}
  directory = os.path.join(args.dir, "ours")
  with CheckpointManager(
      directory,
      storage=Storage(backend=paced_backend(args.mbps)),
      processes=Processes(barrier_timeout_secs=600)) as mgr:
    for step in (1, 2):  # The first in a process compiles its copies.
      multihost_utils.sync_global_devices(f"save {step}")
      t = time.perf_counter()
      mgr.save(step, state)
      mgr.wait_until_finished()
      out["first_save_secs" if step == 1 else "save_secs"] = (
          time.perf_counter() - t)
    out["written"] = mgr.last_save_stats.process_bytes
    out["blocking_secs"] = mgr.last_save_stats.blocking_secs  # The 2nd save.
    multihost_utils.sync_global_devices("restore")
    t = time.perf_counter()
    _, restored = mgr.restore_newest_valid(target)  # All together.
    restored = jax.block_until_ready(restored)
    out["restore_secs"] = time.perf_counter() - t
    out["read"] = mgr.last_restore_stats.nbytes_read
  got = [np.asarray(s.data) for x in jax.tree.leaves(restored)
         for s in x.addressable_shards]
  out["bit_identical"] = all(np.array_equal(a, b) for a, b in zip(got, mine))
  del restored, got

  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  orbax_dir = os.path.join(args.dir, "orbax")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(orbax_dir, state)
  checkpointer.wait_until_finished()
  checkpointer.close()
  multihost_utils.sync_global_devices("orbax saved")
  out["orbax_written"] = _dir_bytes(os.path.join(orbax_dir,
                                                 f"ocdbt.process_{pid}"))
  return out


def run(args: argparse.Namespace, layout: str, n: int) -> list[dict]:
  """`n` worker processes of this script; their results."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = tempfile.mkdtemp(dir=args.dir)
  procs = []
  try:
    for pid in range(n):
      env = dict(os.environ, PROCESS_ID=str(pid), PORT=str(port),
                 NUM_PROCESSES=str(n))
      procs.append(subprocess.Popen(
          [sys.executable, __file__, "--worker", "--layout", layout,
           "--mb", str(args.mb), "--mbps", str(args.mbps), "--dir", root],
          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=args.timeout) for p in procs]
  finally:
    for p in procs:
      p.kill()
    shutil.rmtree(root, ignore_errors=True)
  if any(p.returncode for p in procs):
    sys.exit(f"{layout} x{n}: a process failed:\n"
             + "\n".join(e[-3000:] for _, e in outs))
  return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mb", type=float, default=64.0,
                      help="state size in MB")
  parser.add_argument("--mbps", type=float, default=100.0,
                      help="each process's simulated link, MB/s")
  parser.add_argument("--processes", default="1,2,4")
  parser.add_argument("--layouts", default=",".join(LAYOUTS))
  parser.add_argument("--dir", default=None)
  parser.add_argument("--json", default=None)
  parser.add_argument("--timeout", type=float, default=1800)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--layout", default="data_parallel",
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(worker(args)))
    return
  args.dir = args.dir or tempfile.gettempdir()
  counts = [int(c) for c in args.processes.split(",")]
  results: dict[str, Any] = {"mb": args.mb, "mbps": args.mbps, "runs": {}}
  rows = []
  for layout in args.layouts.split(","):
    base = None
    for n in counts:
      outs = run(args, layout, n)
      assert all(o["bit_identical"] for o in outs), (layout, n)
      total = outs[0]["state_bytes"]
      save = max(o["save_secs"] for o in outs)
      first = max(o["first_save_secs"] for o in outs)
      restore = max(o["restore_secs"] for o in outs)
      blocking = max(o["blocking_secs"] for o in outs)
      base = base or (save, restore)
      results["runs"][f"{layout}_{n}"] = outs
      rows.append([
          layout, str(n), f"{blocking:.3f}", f"{first:.2f}", f"{save:.2f}",
          f"{save / base[0]:.2f}",
          f"{restore:.2f}", f"{restore / base[1]:.2f}",
          " ".join(f"{o['written'] / total:.2f}" for o in outs),
          f"{sum(o['read'] for o in outs) / total:.2f}",
          " ".join(f"{o['orbax_written'] / total:.2f}" for o in outs)])
  header = ["layout", "procs", "blocking s", "1st save s", "save s", "x1 proc", "restore s", "x1 proc",
            "written/state per proc", "read/state all",
            "Orbax written/state per proc"]
  widths = [max(len(r[i]) for r in rows + [header])
            for i in range(len(header))]
  print(f"SIMULATED per-process links of {args.mbps:g} MB/s (PacedBackend);"
        f" state {args.mb:g} MB; the slowest process's times")
  for r in [header] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
