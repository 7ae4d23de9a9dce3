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
import sys

from local_server import LocalServer


class S3Server(LocalServer):
  """A running moto server; use `start` to make one."""

  name = "moto_server"
  # moto imports flask, boto and more: seconds on 2 cores.
  start_timeout = 60.0

  @classmethod
  def command(cls, port: int) -> list[str]:
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
            str(port)]

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

  def client(self):
    """A boto3 S3 client of this server (what a user would inspect with)."""
    import boto3  # pylint: disable=g-import-not-at-top
    return boto3.client(
        "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing")

  def create_bucket(self, name: str) -> None:
    self.client().create_bucket(Bucket=name)
