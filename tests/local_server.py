"""A storage server for the tests, as a subprocess on 127.0.0.1.

`LocalServer.start` runs the command a subclass names (`command`) on a free
port, with its output in a log file, and waits until it answers HTTP at
`probe_path`. Starting has a deadline: if the server does not answer in
time, or exits, `start` raises with its log instead of waiting; a port
taken between choosing and binding it is tried again. `stop` kills it.
`s3_server.S3Server` (moto) and `gcs_server.GCSServer` (fake-gcs-server)
are the two.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import TypeVar

from launcher import free_port

S = TypeVar("S", bound="LocalServer")


class LocalServer:
  """A running server; use `start` of a subclass to make one."""

  name = "server"  # In error messages and the log file's name.
  probe_path = "/"  # Any HTTP answer here means the server is up.
  start_timeout = 60.0
  port_taken = "address already in use"  # In its log, lowercase.

  def __init__(self, proc: subprocess.Popen, port: int, log_path: str):
    self.proc = proc
    self.port = port
    self.log_path = log_path
    self.endpoint_url = f"http://127.0.0.1:{port}"

  @classmethod
  def command(cls, port: int) -> list[str]:
    """The command line that serves on 127.0.0.1:`port`."""
    raise NotImplementedError

  def log(self) -> str:
    """What the server printed (its request log, errors)."""
    with open(self.log_path, "rb") as f:
      return f.read().decode("utf-8", errors="replace")

  @classmethod
  def start(cls: type[S], timeout: float | None = None, tries: int = 3) -> S:
    """Starts the server on a free port and waits until it answers HTTP.

    Raises:
      RuntimeError: the server exited (e.g. its port was taken between
        choosing and binding it, `tries` times) or did not answer within
        `timeout` seconds; the message carries its log.
    """
    timeout = cls.start_timeout if timeout is None else timeout
    errors = []
    for _ in range(tries):
      port = free_port()
      command = cls.command(port)
      fd, log_path = tempfile.mkstemp(prefix=f"{cls.name}_", suffix=".log")
      with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
      server = cls(proc, port, log_path)
      deadline = time.monotonic() + timeout
      while time.monotonic() < deadline and proc.poll() is None:
        try:
          with urllib.request.urlopen(server.endpoint_url + cls.probe_path,
                                      timeout=2):
            return server
        except urllib.error.HTTPError:
          return server  # It answered, if not with 200.
        except (urllib.error.URLError, OSError):
          time.sleep(0.1)
      exited = proc.poll() is not None
      log = server.log()
      status = (f"exited with {proc.returncode}" if exited
                else f"did not answer within {timeout:.0f}s")
      errors.append(f"{cls.name} on port {port} {status}:\n{log}")
      server.stop()
      if not (exited and cls.port_taken in log.lower()):
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

  def __enter__(self: S) -> S:
    return self

  def __exit__(self, *exc) -> None:
    self.stop()
