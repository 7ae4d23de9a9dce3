"""A real S3-compatible server (moto in server mode) on 127.0.0.1.

    with S3Server.start() as server:
      server.create_bucket("ckpt-test")
      os.environ.update(server.env)  # boto3 and s3fs now talk to it.

The server is a separate process (`python -m moto.server`) speaking the S3
REST protocol over HTTP, so every request of s3fs, boto3 and the checkpoint
library really goes over a socket, as it would to AWS. Starting it has a
deadline: if it does not answer in time, or exits, `start` raises with its
log instead of waiting. The server keeps everything in memory and is killed
on `stop`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from launcher import free_port

START_TIMEOUT = 60.0  # moto imports flask, boto and more: seconds on 2 cores.


class S3Server:
  """A running moto server; use `start` to make one."""

  def __init__(self, proc: subprocess.Popen, port: int, log_path: str):
    self.proc = proc
    self.port = port
    self.log_path = log_path
    self.endpoint_url = f"http://127.0.0.1:{port}"

  @property
  def env(self) -> dict[str, str]:
    """Environment that sends boto3, aiobotocore and s3fs to this server.

    `AWS_ENDPOINT_URL` is read by botocore when a client is made, so it also
    reaches s3fs and child processes. The config and credential files point
    nowhere and instance metadata is off, so nothing of the machine's own
    AWS set-up is read and no request leaves 127.0.0.1.
    """
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": self.endpoint_url,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }

  def log(self) -> str:
    """What the server printed (its request log, errors)."""
    with open(self.log_path, "rb") as f:
      return f.read().decode("utf-8", errors="replace")

  def client(self):
    """A boto3 S3 client of this server (what a user would inspect with)."""
    import boto3  # pylint: disable=g-import-not-at-top
    return boto3.client(
        "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing")

  def create_bucket(self, name: str) -> None:
    self.client().create_bucket(Bucket=name)

  @classmethod
  def start(cls, timeout: float = START_TIMEOUT, tries: int = 3) -> "S3Server":
    """Starts moto on a free port and waits until it answers HTTP.

    Raises:
      RuntimeError: the server exited (e.g. its port was taken between
        choosing and binding it, `tries` times) or did not answer within
        `timeout` seconds; the message carries its log.
    """
    errors = []
    for _ in range(tries):
      port = free_port()
      fd, log_path = tempfile.mkstemp(prefix="moto_server_", suffix=".log")
      with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
             str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
      server = cls(proc, port, log_path)
      deadline = time.monotonic() + timeout
      while time.monotonic() < deadline and proc.poll() is None:
        try:
          with urllib.request.urlopen(server.endpoint_url + "/", timeout=2):
            return server
        except urllib.error.HTTPError:
          return server  # It answered, if not with 200.
        except (urllib.error.URLError, OSError):
          time.sleep(0.1)
      exited = proc.poll() is not None
      log = server.log()
      status = (f"exited with {proc.returncode}" if exited
                else f"did not answer within {timeout:.0f}s")
      errors.append(f"moto server on port {port} {status}:\n{log}")
      server.stop()
      if not (exited and "Address already in use" in log):
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

  def __enter__(self) -> "S3Server":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()
