"""Retention's deletes against the saves, on a GCS emulator with a delay
per request.

    python benchmarks/deletes.py                     # 1000 files, 20 ms
    python benchmarks/deletes.py --files 1000 --delay-ms 20 --saves 8 \\
        --every-secs 3 --json /tmp/deletes.json
    PYTHONPATH=<other tree> python benchmarks/deletes.py ...  # its code
    python benchmarks/deletes.py --wait-for-deletes  # disk use bounded

A train loop saves a small state to `gs://` every `--every-secs` seconds,
`--saves` times, once with `max_to_keep=None` (nothing deleted) and once
with `--max-to-keep` (each save's retention deletes one step). Each step
holds `--files` objects, as a step of a job of many processes does: the
save writes its own few, and the benchmark adds the rest (`pad/`) once the
step is final, straight to the emulator, in the time between two saves.
Every request of the library goes through a proxy (a subprocess) that
holds it `--delay-ms` first: the round trip of a real object store, which
the in-memory emulator on loopback does not have (gcsfs deletes an
emulator's objects one request each, five at a time). Printed per
configuration: the save call (what the loop waits for) and the save to
durable (from the call to the step being final, seen by a commit hook),
median and max over the saves after the first two.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

# Hop-by-hop headers: the proxy's own connections, not forwarded.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer",
        "upgrade", "proxy-authorization", "proxy-authenticate"}


def serve_proxy(port: int, upstream: str, delay: float) -> None:
  """Forwards every HTTP request to `upstream` after `delay` seconds."""
  host, upstream_port = upstream.rsplit(":", 1)
  local = threading.local()

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _forward(self):
      length = int(self.headers.get("Content-Length") or 0)
      body = self.rfile.read(length) if length else None
      time.sleep(delay)  # The store's round trip.
      if getattr(local, "conn", None) is None:
        local.conn = http.client.HTTPConnection(host, int(upstream_port),
                                                timeout=60)
      headers = {k: v for k, v in self.headers.items()
                 if k.lower() not in _HOP}
      try:
        local.conn.request(self.command, self.path, body=body,
                           headers=headers)
        reply = local.conn.getresponse()
        data = reply.read()
      except (OSError, http.client.HTTPException):
        local.conn.close()
        local.conn = None
        raise
      self.send_response(reply.status, reply.reason)
      for k, v in reply.getheaders():
        if k.lower() not in _HOP and k.lower() != "content-length":
          self.send_header(k, v)
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

    def log_message(self, *args):
      del args

  class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
      if not isinstance(sys.exc_info()[1], ConnectionError):
        super().handle_error(request, client_address)  # A client gone: fine.

  Server(("127.0.0.1", port), Handler).serve_forever()


def _start_proxy(upstream: str, delay_ms: float):
  from launcher import free_port  # pylint: disable=g-import-not-at-top
  port = free_port()
  proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), "--proxy", str(port),
       upstream.removeprefix("http://"), str(delay_ms)])
  import urllib.error  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 30
  while True:
    try:
      urllib.request.urlopen(url + "/storage/v1/b", timeout=5).read()
      return proc, url
    except urllib.error.HTTPError:
      return proc, url
    except OSError:
      if time.monotonic() > deadline or proc.poll() is not None:
        proc.kill()
        raise RuntimeError("the delay proxy did not start")
      time.sleep(0.1)


def _pad(direct_fs, url: str, count: int) -> None:
  """Adds `count` small objects under `<step>/pad/`, past the proxy."""
  direct_fs.pipe({f"{url}/pad/{i:05d}": b"x" for i in range(count)})


def run(args, max_to_keep, bucket_url, direct_fs) -> dict:
  # pylint: disable-next=g-import-not-at-top
  import numpy as np
  import flax_ckpt_plugin as fcp  # pylint: disable=g-import-not-at-top

  directory = f"{bucket_url}/{uuid.uuid4().hex[:8]}"
  final: dict[int, float] = {}
  cond = threading.Condition()

  def hook(stats):
    with cond:
      final[stats.step] = time.perf_counter()
      cond.notify_all()

  state = {"w": np.arange(args.elements, dtype=np.float32)}
  calls, durable = [], []
  retention = None
  if args.wait_for_deletes and max_to_keep is not None:
    retention = fcp.Retention(max_to_keep=max_to_keep, wait_for_deletes=True)
    max_to_keep = None
  mgr = fcp.CheckpointManager(directory, max_to_keep=max_to_keep,
                              retention=retention, hooks=[hook])
  try:
    next_save = time.perf_counter()
    for step in range(1, args.saves + 1):
      now = time.perf_counter()
      if next_save > now:
        time.sleep(next_save - now)  # The train steps between two saves.
      t0 = time.perf_counter()
      mgr.save(step, state)
      calls.append(time.perf_counter() - t0)
      next_save = t0 + args.every_secs
      with cond:
        cond.wait_for(lambda: step in final, timeout=120)
      durable.append(final[step] - t0)
      _pad(direct_fs, f"{directory}/{step}", args.files - args.own_files)
    mgr.close()
  finally:
    direct_fs.rm(directory.removeprefix("gs://"), recursive=True)
  steady = slice(2, None)  # From the first save whose retention deletes.
  return {
      "max_to_keep": max_to_keep if retention is None else
                     retention.max_to_keep,
      "wait_for_deletes": retention is not None,
      "save_call_secs": calls, "durable_secs": durable,
      "save_call_median": statistics.median(calls[steady]),
      "save_call_max": max(calls[steady]),
      "durable_median": statistics.median(durable[steady]),
      "durable_max": max(durable[steady]),
  }


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "--proxy":
    serve_proxy(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]) / 1000)
    return
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--files", type=int, default=1000,
                      help="objects per step")
  parser.add_argument("--own-files", type=int, default=6,
                      help="objects a save writes itself (not padded)")
  parser.add_argument("--delay-ms", type=float, default=20.0)
  parser.add_argument("--saves", type=int, default=8)
  parser.add_argument("--every-secs", type=float, default=3.0)
  parser.add_argument("--max-to-keep", type=int, default=2)
  parser.add_argument("--elements", type=int, default=1 << 16,
                      help="float32 elements of the state")
  parser.add_argument("--wait-for-deletes", action="store_true",
                      help="Retention(wait_for_deletes=True) (this code's)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  from gcs_server import GCSServer  # pylint: disable=g-import-not-at-top
  with GCSServer.start() as server:
    server.create_bucket("deletes-bench")
    proxy, url = _start_proxy(server.endpoint_url, args.delay_ms)
    try:
      os.environ["STORAGE_EMULATOR_HOST"] = url  # The library's requests.
      from gcsfs import core as gcsfs_core  # pylint: disable=g-import-not-at-top
      direct_fs = gcsfs_core.GCSFileSystem(
          token="anon", endpoint_url=server.endpoint_url,
          use_listings_cache=False)
      import flax_ckpt_plugin  # pylint: disable=g-import-not-at-top
      print(f"code: {os.path.dirname(flax_ckpt_plugin.__file__)}")
      print(f"{args.files} objects a step, {args.delay_ms:g} ms a request,"
            f" a save every {args.every_secs:g} s, {args.saves} saves")
      results = []
      for keep in (None, args.max_to_keep):
        r = run(args, keep, "gs://deletes-bench", direct_fs)
        results.append(r)
        bounded = ", wait_for_deletes" if r["wait_for_deletes"] else ""
        print(f"max_to_keep={keep}{bounded}: save call median"
              f" {r['save_call_median'] * 1e3:.1f} ms, max"
              f" {r['save_call_max'] * 1e3:.1f} ms; save to durable median"
              f" {r['durable_median']:.3f} s, max {r['durable_max']:.3f} s")
    finally:
      proxy.kill()
      proxy.wait()
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
