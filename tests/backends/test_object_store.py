"""Checkpoints in `s3://` and `gs://`, against real servers on 127.0.0.1.

Every test of a bucket runs twice, once per store (test ids `[s3]` and
`[gs]`): against moto's S3 server (`tests/s3_server.py`), which boto3, s3fs
and the library reach through `AWS_ENDPOINT_URL`, and against the GCS
emulator fake-gcs-server (`tests/gcs_server.py`), which gcsfs and the
library reach through `STORAGE_EMULATOR_HOST`. Each server runs as its own
process and every test gets a fresh bucket. The tests check what local-disk
tests check (`test_manager.py`, `test_damaged_files.py`,
`test_two_writers.py`, `test_fallback.py`), as a user of a bucket
sees it: the objects in the bucket (listed with the store's own client,
boto3 or google-cloud-storage, not through fsspec), restored values bit for
bit, the requests in the server's log, and the errors. Commit-file atomicity
is chosen by itself: a step is finalized once `<step>/_COMMITTED` exists, and
anything else is unfinished.
"""

from __future__ import annotations

import abc
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from typing import Any

from etils import epath
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin.backends import object_store
from flax_ckpt_plugin import Storage
from flax_ckpt_plugin import Retention
from flax_ckpt_plugin import CheckpointCallback
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import CheckpointNotFoundError
from flax_ckpt_plugin import ConcurrentWriterError
from flax_ckpt_plugin.format import files
from gcs_server import GCSServer
from helpers import two_device_mesh
from launcher import REPO_ROOT
from launcher import run_workers
from launcher import StdoutLines
from s3_server import S3Server

DATA = "data/process_00000.bin"
# Subprocesses start jax (and one of them tensorflow) on a loaded 2-core
# machine: generous deadlines, never waited out when things work.
RUN_TIMEOUT = 180


class Bucket(abc.ABC):
  """A fresh bucket on a test server, and a checkpoint URL in it.

  Reads and writes objects with the store's own client, as a user would
  inspect a bucket (`aws s3`, `gcloud storage`), not through fsspec.
  """
  scheme: str
  server_class: type[S3Server] | type[GCSServer]
  # How many 'stat' requests one check of an object's size sends.
  stats_per_size_check: tuple[int, ...]

  def __init__(self, server: S3Server | GCSServer, name: str):
    self.server = server
    self.name = name

  @property
  def url(self) -> str:
    return f"{self.scheme}://{self.name}/run"

  @abc.abstractmethod
  def keys(self, prefix: str = "run/") -> list[str]:
    """Every object under `prefix`, sorted, as `ls --recursive` lists them."""

  @abc.abstractmethod
  def get(self, key: str) -> bytes:
    ...

  @abc.abstractmethod
  def put(self, key: str, body: bytes) -> None:
    ...

  @abc.abstractmethod
  def delete(self, key: str) -> None:
    ...

  @abc.abstractmethod
  def bucket_names(self) -> list[str]:
    """Every bucket on the server."""

  @abc.abstractmethod
  def _request_pattern(self, kind: str, key: str) -> str:
    """A regular expression matching the log line of a `kind` request."""

  def requests(self, kind: str, key: str = "") -> int:
    """How many requests of `kind` for object `key` the server logged so far.

    Kinds: 'read' (a GET of the object's bytes, ranged or not), 'stat'
    (a request of its size and metadata: HEAD on S3, a metadata GET on GCS)
    and 'list' (a listing of the bucket, whatever its prefix; no `key`).
    """
    return len(re.findall(self._request_pattern(kind, key),
                          self.server.log()))

  def settled_requests(self, kind: str, key: str = "") -> int:
    """The request count once the server's log stopped growing (0.3 s
    without a new line, or 10 s passed).

    Servers write their log behind the answers they send, so a count taken
    right after a save can miss its last requests, which a later count
    would then charge to the restore.
    """
    deadline = time.monotonic() + 10
    log = self.server.log()
    while time.monotonic() < deadline:
      time.sleep(0.3)
      if (now := self.server.log()) == log:
        break
      log = now
    return len(re.findall(self._request_pattern(kind, key), log))

  def wait_for_requests(self, kind: str, key: str = "",
                        at_least: int = 1) -> int:
    """The request count, once the server logged `at_least` (or 10 s
    passed)."""
    deadline = time.monotonic() + 10
    while (n := self.requests(kind, key)) < at_least and (
        time.monotonic() < deadline):
      time.sleep(0.05)
    return n


class S3Bucket(Bucket):
  """A bucket on moto's S3 server, seen through boto3."""
  scheme = "s3"
  stats_per_size_check = (1,)
  server_class = S3Server

  def keys(self, prefix: str = "run/") -> list[str]:
    pages = self.server.client().get_paginator("list_objects_v2").paginate(
        Bucket=self.name, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

  def get(self, key: str) -> bytes:
    return self.server.client().get_object(
        Bucket=self.name, Key=key)["Body"].read()

  def put(self, key: str, body: bytes) -> None:
    self.server.client().put_object(Bucket=self.name, Key=key, Body=body)

  def delete(self, key: str) -> None:
    self.server.client().delete_object(Bucket=self.name, Key=key)

  def bucket_names(self) -> list[str]:
    return [b["Name"] for b in self.server.client().list_buckets()["Buckets"]]

  def _request_pattern(self, kind: str, key: str) -> str:
    # Lines look like `"GET /bucket/key HTTP/1.1" 206`, maybe with colour
    # codes.
    if kind == "list":
      return rf"(?<![A-Z])GET /{re.escape(self.name)}/?\?list-type="
    method = {"read": "GET", "stat": "HEAD"}[kind]
    return (rf"(?<![A-Z]){method} /{re.escape(self.name)}/{re.escape(key)}"
            " HTTP")


class GCSBucket(Bucket):
  """A bucket on fake-gcs-server, seen through google-cloud-storage."""
  scheme = "gs"
  # gcsfs asks an object's size with a metadata GET raced against a
  # one-item listing of `key/` (is it a directory?); when the listing comes
  # back empty before the race is decided, gcsfs fetches the metadata a
  # second time. Which happens first varies from run to run.
  stats_per_size_check = (1, 2)
  server_class = GCSServer

  def _blob(self, key: str):
    return self.server.client().bucket(self.name).blob(key)

  def keys(self, prefix: str = "run/") -> list[str]:
    return self.server.list_names(self.name, prefix)

  def get(self, key: str) -> bytes:
    return self._blob(key).download_as_bytes()

  def put(self, key: str, body: bytes) -> None:
    self._blob(key).upload_from_string(body)

  def delete(self, key: str) -> None:
    self._blob(key).delete()

  def bucket_names(self) -> list[str]:
    return [b.name for b in self.server.client().list_buckets()]

  def _request_pattern(self, kind: str, key: str) -> str:
    # JSON API: `GET /download/storage/v1/b/BUCKET/o/run%2F1%2Fx?alt=media`
    # fetches bytes; the same object URL without `alt=media` its metadata.
    if kind == "list":
      return rf"(?<![A-Z])GET /storage/v1/b/{re.escape(self.name)}/o\?"
    url = (rf"/storage/v1/b/{re.escape(self.name)}/o/"
           + re.escape(urllib.parse.quote(key, safe="")))
    if kind == "read":
      return rf"(?<![A-Z])GET (?:/download)?{url}\?(?:\S*&)?alt=media[& ]"
    assert kind == "stat", kind
    return rf"(?<![A-Z])GET {url}(?:\?(?!\S*alt=media)\S*)? HTTP"


# The stores under test, by URL scheme.
_STORES: dict[str, type[Bucket]] = {"s3": S3Bucket, "gs": GCSBucket}


def _stores(*schemes: str) -> list[Any]:
  """Parameters of the `store` fixture. A test of a store starts its
  server process, so it is in the multiprocess tier."""
  return [pytest.param(s, id=s, marks=pytest.mark.multiprocess)
          for s in schemes]


# For the few tests that are about one store only (each says why).
s3_only = pytest.mark.parametrize("store", _stores("s3"), indirect=True)


@pytest.fixture(scope="session", params=_stores(*_STORES))
def store(request) -> str:
  """The URL scheme of the store under test: every test that uses a
  bucket runs once per store."""
  return request.param


@pytest.fixture(scope="session")
def store_server(store):
  """One server per store for the session; fails every test of that store
  if it cannot start."""
  try:
    server = _STORES[store].server_class.start()
  except RuntimeError as e:
    pytest.fail(f"could not start the {store} server: {e}", pytrace=False)
  yield server
  server.stop()


@pytest.fixture
def bucket(store, store_server, monkeypatch) -> Bucket:
  """A fresh bucket of the store under test. The environment (which
  subprocesses inherit) sends the library to its server."""
  for key, value in store_server.env.items():
    monkeypatch.setenv(key, value)
  name = f"ckpt-{uuid.uuid4().hex[:12]}"
  store_server.create_bucket(name)
  return _STORES[store](store_server, name)


def _step_keys(step: int) -> list[str]:
  """The objects of a finalized step written by one process."""
  return [f"run/{step}/{name}"
          for name in ("_COMMITTED", DATA, files.MANIFEST)]


def _expected_keys(*steps: int) -> list[str]:
  """The bucket's listing when it holds these finalized steps (one writer)."""
  return sorted([f"run/{atomicity.WRITER_FILE}"]
                + [k for s in steps for k in _step_keys(s)])


def _steps_in_bucket(b: Bucket) -> set[str]:
  return {k.split("/")[1] for k in b.keys()} - {atomicity.WRITER_FILE}


def _sharded(state: Any, spec_of) -> Any:
  """`state` with every array leaf placed by `spec_of(leaf)` on 2 devices."""
  return jax.tree.map(
      lambda x: jax.device_put(
          x, NamedSharding(two_device_mesh(), spec_of(x))), state)


def _abstract(state: Any, spec_of) -> Any:
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype,
          sharding=NamedSharding(two_device_mesh(), spec_of(x))),
      state)


def _rows(x) -> P:
  return P("x") if x.ndim else P()


def _columns(x) -> P:
  return P(None, "x") if x.ndim == 2 else P()


def _replicated(x) -> P:
  del x
  return P()


@pytest.mark.multiprocess
@pytest.mark.parametrize("server_class", [S3Server, GCSServer],
                         ids=["s3", "gs"])
def test_server_that_does_not_answer_fails_the_test_instead_of_hanging(
    server_class):
  """The helpers' own contract: a deadline, then an error with the log."""
  start = time.monotonic()
  with pytest.raises(RuntimeError, match="did not answer within"):
    server_class.start(timeout=0.0)
  assert time.monotonic() - start < 30  # Includes stopping the server.


# -- paths and atomicity ------------------------------------------------------


_TF_SUBPROCESS = """
import json, sys
try:
  import tensorflow  # What a job with a tf.data input pipeline has loaded.
  have_tf = True
except ImportError:
  have_tf = False
from etils import epath
import numpy as np
from flax_ckpt_plugin import CheckpointManager

url = sys.argv[1]
plain_error = None
try:
  epath.Path(url).exists()
except Exception as e:  # tf.io.gfile: "File system scheme 's3' not implemented"
  plain_error = f"{type(e).__name__}: {e}"
state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
with CheckpointManager(url) as manager:
  manager.save(5, state)
  manager.wait_until_finished()
  restored = manager.restore({"w": np.zeros((3, 4), np.float32)})
  print(json.dumps({"have_tf": have_tf, "plain_error": plain_error,
                    "path_class": type(manager.directory).__name__,
                    "steps": manager.all_steps(),
                    "restored": restored["w"].tolist()}))
"""


# S3 only: the failure it guards against is tf.io.gfile's missing `s3://`.
# For `gs://`, tf.io.gfile has its own GCS client, which knows nothing of
# the emulator and would go to the internet; that the manager's `gs://`
# paths are fsspec ones is checked by
# `test_manager_on_a_bucket_uses_commit_file[gs]`.
@s3_only
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_s3_goes_through_fsspec_even_where_tensorflow_is_imported(bucket):
  """etils would send `s3://` to tf.io.gfile, which has no s3: we do not.

  A subprocess imports tensorflow first (when installed, as in this test
  environment), as a training job with a tf.data pipeline does. There a
  plain `epath.Path('s3://...')` fails, while the manager saves and
  restores through fsspec and s3fs.
  """
  proc = subprocess.run(
      [sys.executable, "-c", _TF_SUBPROCESS, bucket.url], cwd=REPO_ROOT,
      capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
  assert proc.returncode == 0, proc.stderr[-6000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  if out["have_tf"]:
    assert "scheme 's3' not implemented" in out["plain_error"], out
  assert out["path_class"] == "ObjectStorePath"
  assert out["steps"] == [5]
  assert out["restored"] == np.arange(12).reshape(3, 4).tolist()
  assert bucket.keys() == _expected_keys(5)


def test_object_store_paths_stay_object_store_paths():
  path = object_store.as_path("s3://some-bucket/run")
  assert isinstance(path, epath.Path)
  assert isinstance(path, object_store.ObjectStorePath)
  for derived in (path / "3" / DATA, path.parent, path / "3" / ".." / "4"):
    assert isinstance(derived, object_store.ObjectStorePath), derived
  assert os.fspath(path / "3") == "s3://some-bucket/run/3"
  assert object_store.as_path(epath.Path("gs://b/x")).__class__ is (
      object_store.ObjectStorePath)
  local = object_store.as_path("/tmp/x")
  assert not isinstance(local, object_store.ObjectStorePath)
  assert os.fspath(local) == "/tmp/x"


@pytest.mark.parametrize("url", ["s3://b/run", "gs://b/run"])
def test_atomicity_auto_selects_commit_file_for_object_stores(url):
  assert atomicity.resolve_atomicity(url, "auto") == "commit_file"
  assert atomicity.resolve_atomicity(url, "commit_file") == "commit_file"
  with pytest.raises(ValueError, match="without atomic rename"):
    atomicity.resolve_atomicity(url, "rename")
  tmp = atomicity.temporary_path(object_store.as_path(url), 7, "commit_file")
  assert isinstance(tmp, atomicity.CommitFilePath)
  assert os.fspath(tmp.path) == f"{url}/7"  # Written in place, no rename.


def test_manager_on_a_bucket_uses_commit_file(bucket):
  with CheckpointManager(bucket.url) as manager:
    assert manager.atomicity == "commit_file"
    assert isinstance(manager.directory, object_store.ObjectStorePath)
  with pytest.raises(ValueError, match="without atomic rename"):
    CheckpointManager(bucket.url, storage=Storage(atomicity="rename"))


def test_walking_a_checkpoint_in_a_bucket(bucket):
  """`walk` works on these paths (etils' fsspec walk fails on s3fs)."""
  with CheckpointManager(bucket.url) as manager:
    manager.save(1, {"w": np.arange(3)})
  found = {}
  for root, _, names in object_store.as_path(bucket.url).walk():
    assert isinstance(root, object_store.ObjectStorePath)
    for name in names:
      found[os.fspath(root / name)] = (root / name).stat().length
  prefix = f"{bucket.scheme}://{bucket.name}/"
  assert sorted(found) == [prefix + key for key in _expected_keys(1)]
  assert found[f"{bucket.url}/1/{DATA}"] == 3 * 8


def test_missing_bucket_is_an_error_and_is_never_created(bucket):
  with pytest.raises(FileNotFoundError) as info:
    CheckpointManager(f"{bucket.scheme}://no-such-bucket-here/run")
  assert "bucket 'no-such-bucket-here' does not exist" in str(info.value)
  assert bucket.name in bucket.bucket_names()
  assert "no-such-bucket-here" not in bucket.bucket_names()


@pytest.mark.parametrize("emulator", [None, "http://127.0.0.1:9"],
                         ids=["gcs", "emulator"])
def test_missing_fsspec_implementation_says_what_to_install(monkeypatch,
                                                            emulator):
  # Fault injected: gcsfs made unimportable (None in sys.modules), so the
  # test runs whether or not it is installed.
  if emulator is None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
  else:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator)
  monkeypatch.setitem(sys.modules, "gcsfs", None)
  object_store._filesystem.cache_clear()  # pylint: disable=protected-access
  with pytest.raises(ImportError,
                     match=r"gs:// checkpoints need gcsfs: pip install gcsfs"
                     r" \(the 'gcs' extra of flax_ckpt_plugin\)"):
    CheckpointManager("gs://some-bucket/run")


# -- save and restore ---------------------------------------------------------


def test_train_state_round_trip_and_the_objects_a_user_sees(
    bucket, make_state, train_step, assert_trees_equal, host_copy):
  state = train_step(make_state())
  expected = host_copy(state)
  with CheckpointManager(bucket.url) as manager:
    manager.save(1, state, extra={"data_position": 17}, metrics={"loss": 0.5})
    manager.wait_until_finished()
    assert manager.all_steps() == [1]
    assert manager.latest_step() == 1
    stats = manager.last_save_stats
    assert stats.process_bytes > 0

  # What `aws s3 ls --recursive` shows: the marker, the manifest, one data
  # object; no shard tables, no attempt token, nothing else.
  assert bucket.keys() == _expected_keys(1)
  manifest = json.loads(bucket.get(f"run/1/{files.MANIFEST}"))
  assert manifest["step"] == 1 and manifest["extra"] == {"data_position": 17}
  assert manifest["files"] == {DATA: stats.process_bytes}
  assert len(bucket.get(f"run/1/{DATA}")) == stats.process_bytes
  assert json.loads(bucket.get("run/1/_COMMITTED"))["step"] == 1

  # A fresh manager (a restarted job) restores it bit for bit, as the
  # target's type, and training continues from it.
  with CheckpointManager(bucket.url) as manager:
    assert manager.all_steps() == [1]
    restored = manager.restore(train_step(make_state(seed=5)))
    assert manager.metadata().extra == {"data_position": 17}
    assert manager.metadata().metrics == {"loss": 0.5}
    assert manager.last_restore_stats.nbytes_read == stats.process_bytes
  assert_trees_equal(restored, expected)
  assert_trees_equal(host_copy(train_step(restored)),
                     host_copy(train_step(train_step(make_state()))))


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
@pytest.mark.parametrize("target_spec", [_rows, _columns, _replicated],
                         ids=["as_saved", "columns", "replicated"])
def test_sharded_train_state_restores_into_any_partitioning(
    bucket, make_state, train_step, assert_trees_equal, host_copy,
    target_spec, verify):
  """Saved split by rows over 2 devices; restored as saved or re-split.

  Restoring by columns needs a strided part of each saved shard: on an
  object store that is fetched as one range around it, not row by row.
  """
  state = _sharded(train_step(make_state()), _rows)
  expected = host_copy(state)
  with CheckpointManager(bucket.url) as manager:
    manager.save(3, state)
    manager.wait_until_finished()
  target = _abstract(expected, target_spec)
  data_key = f"run/3/{DATA}"
  before = bucket.settled_requests("read", data_key)
  with CheckpointManager(bucket.url, read_only=True) as manager:
    restored = manager.restore(target, verify=verify)
  assert_trees_equal(restored, expected)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert got.sharding == want.sharding
  # Every shard is small and they lie side by side in the one data object:
  # the whole restore is one ranged GET, whichever devices need which
  # parts of them (one per shard before reads were coalesced).
  manifest = json.loads(bucket.get(f"run/3/{files.MANIFEST}"))
  shards = sum(len(leaf.get("shards", ())) for leaf in manifest["leaves"])
  assert shards > 10
  bucket.wait_for_requests("read", data_key, before + 1)
  time.sleep(0.2)  # Any late request would be logged by now.
  assert bucket.requests("read", data_key) - before == 1


def test_small_leaves_are_fetched_together_with_one_ranged_get(bucket):
  """A restore of small leaves asks the data object's size once (a HEAD on
  S3, one or two metadata GETs on GCS, see `stats_per_size_check`) and
  fetches all of them with one ranged GET."""
  rng = np.random.default_rng(0)
  state = {f"leaf_{i}": rng.standard_normal((50, i + 1)).astype(np.float32)
           for i in range(6)}
  with CheckpointManager(bucket.url) as manager:
    manager.save(1, state)
    manager.wait_until_finished()
  data_key = f"run/1/{DATA}"
  reads_before = bucket.settled_requests("read", data_key)
  stats_before = bucket.requests("stat", data_key)  # Settled above.
  with CheckpointManager(bucket.url, read_only=True) as manager:
    restored = manager.restore({k: np.zeros_like(v) for k, v in state.items()})
  for key, value in state.items():
    assert restored[key].tobytes() == value.tobytes(), key
  bucket.wait_for_requests("read", data_key, reads_before + 1)
  time.sleep(0.2)  # Any late request would be logged by now.
  assert bucket.requests("read", data_key) - reads_before == 1
  stats = bucket.requests("stat", data_key) - stats_before
  assert stats in bucket.stats_per_size_check, stats


def test_long_ranges_are_fetched_in_concurrent_pieces(bucket, monkeypatch):
  monkeypatch.setattr(object_store, "_GET_BYTES", 1000)
  monkeypatch.setattr(object_store, "_GETS_AT_ONCE", 3)
  value = np.random.default_rng(1).standard_normal(2500).astype(np.float32)
  with CheckpointManager(bucket.url) as manager:
    manager.save(1, {"v": value})
    manager.wait_until_finished()
  data_key = f"run/1/{DATA}"
  before = bucket.settled_requests("read", data_key)
  with CheckpointManager(bucket.url, read_only=True) as manager:
    restored = manager.restore({"v": np.zeros_like(value)})
  assert restored["v"].tobytes() == value.tobytes()
  assert bucket.wait_for_requests("read", data_key,
                                  before + 10) - before == 10  # 10,000 bytes.


def test_a_read_past_the_end_of_an_object_is_short_not_an_error(
    bucket, monkeypatch):
  """The `RangedFile` contract on both stores: a short read at the end.

  Both answer a ranged GET that starts past the end of an object with an
  error (416), so none is sent.
  """
  monkeypatch.setattr(object_store, "_GET_BYTES", 4)  # Pieces past the end.
  bucket.put("run/x.bin", b"0123456789")
  path = object_store.as_path(bucket.url) / "x.bin"
  f = backend_lib.OBJECT_STORE.open_ranged(path, within=path.parent)
  assert f.size == 10
  out = bytearray(b"." * 20)
  assert f.read_into(5, memoryview(out)) == 5
  assert bytes(out) == b"56789" + b"." * 15
  assert f.read_into(10, memoryview(out)) == 0
  assert f.read_into(50, memoryview(out)) == 0
  f.close()


# -- retention and unfinished steps -------------------------------------------


def test_retention_deletes_from_the_bucket(bucket):
  with CheckpointManager(bucket.url, max_to_keep=2,
                         retention=Retention(keep_every_n_steps=3)) as manager:
    for step in range(1, 8):
      manager.save(step, {"w": jnp.full((4,), step, jnp.int32)})
      manager.wait_until_finished()
      # Never fewer than the kept steps, and the newest is always there.
      assert str(step) in _steps_in_bucket(bucket)
    assert manager.all_steps() == [3, 6, 7]
  assert bucket.keys() == _expected_keys(3, 6, 7)
  with CheckpointManager(bucket.url, read_only=True) as manager:
    restored = manager.restore({"w": np.zeros(4, np.int32)}, step=3)
  assert restored["w"].tolist() == [3] * 4


def test_a_step_of_many_objects_is_deleted_in_parts_marker_first(bucket):
  """Retention's deletes go a part at a time (so that a save's requests
  can go between them): the marker first, then every object, in parts of
  `DELETE_PART`, until nothing of the step is left."""
  with CheckpointManager(bucket.url) as manager:
    for step in (1, 2):
      manager.save(step, {"w": jnp.arange(3)})
      manager.wait_until_finished()
  for n in range(250):  # As a step of 250 processes holds.
    bucket.put(f"run/1/data/extra_{n:05d}.bin", b"x")
  directory = object_store.as_path(bucket.url)
  backend = backend_lib.ObjectStoreBackend()
  parts = backend.delete_step_in_parts(directory, 1)
  next(parts)  # The marker: no longer a step, its objects still there.
  assert "run/1/_COMMITTED" not in bucket.keys()
  assert directory_lib.finalized_steps(directory) == [2]
  assert len([k for k in bucket.keys() if k.startswith("run/1/")]) > 250
  left = []
  for _ in parts:
    left.append(len([k for k in bucket.keys() if k.startswith("run/1/")]))
  assert len(left) >= 3 and left == sorted(left, reverse=True)
  assert bucket.keys() == _expected_keys(2)


def _copy_step_without_marker(b: Bucket, src: int, dst: int) -> None:
  """Step `dst` as a crash before its marker leaves it: data, no marker."""
  for key in b.keys(f"run/{src}/"):
    if not key.endswith("/_COMMITTED"):
      body = b.get(key)
      if key.endswith(files.MANIFEST):
        body = body.replace(b'"step": %d' % src, b'"step": %d' % dst)
      b.put(key.replace(f"run/{src}/", f"run/{dst}/"), body)


def test_unfinished_step_is_never_listed_or_restored_and_is_cleaned_up(
    bucket):
  """Step 2 has all its data and manifest but no `_COMMITTED`."""
  with CheckpointManager(bucket.url) as manager:
    manager.save(1, {"w": jnp.arange(6.0)})
    manager.wait_until_finished()
  _copy_step_without_marker(bucket, 1, 2)
  assert f"run/2/{DATA}" in bucket.keys()

  # A reader (an evaluation job) neither lists, restores nor removes it.
  with CheckpointManager(bucket.url, read_only=True) as reader:
    assert reader.all_steps() == [1]
    assert reader.latest_step() == 1
    with pytest.raises(CheckpointNotFoundError, match="step 2 is not a"):
      reader.restore({"w": np.zeros(6, np.float32)}, step=2)
    restored = reader.restore({"w": np.zeros(6, np.float32)})
  assert restored["w"].tolist() == list(range(6))
  assert directory_lib.unfinished_entries(object_store.as_path(bucket.url)) == [
      object_store.as_path(bucket.url) / "2"]

  # The next writer removes every object of it, and may save step 2 anew.
  with CheckpointManager(bucket.url) as writer:
    assert not any(k.startswith("run/2/") for k in bucket.keys())
    assert writer.all_steps() == [1]
    writer.save(2, {"w": jnp.arange(6.0) * 2})
  assert bucket.keys() == _expected_keys(1, 2)


_KILLED_WRITER = """
import sys
import numpy as np
from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import object_store
from flax_ckpt_plugin import CheckpointManager

def finalize_never(self):
  # Data and manifest are in the bucket; the marker is next. Stop here.
  print("about to write the commit marker", flush=True)
  import time
  time.sleep(600)

url = sys.argv[1]
with CheckpointManager(url) as manager:
  manager.save(1, {"w": np.arange(8, dtype=np.int64)})
  manager.wait_until_finished()
  print("step 1 finalized", flush=True)
  atomicity.CommitFilePath.finalize = finalize_never
  manager.save(2, {"w": np.arange(8, dtype=np.int64) * 2})
  manager.wait_until_finished()
"""


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_writer_killed_before_the_marker_leaves_nothing_that_looks_final(
    bucket):
  """SIGKILL a real writer process right before it writes `_COMMITTED`."""
  proc = subprocess.Popen(
      [sys.executable, "-u", "-c", _KILLED_WRITER, bucket.url],
      cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, start_new_session=True)
  try:
    lines = StdoutLines(proc.stdout)
    found = lines.wait_match("about to write the commit marker",
                             time.monotonic() + RUN_TIMEOUT)
    assert found, "\n".join(lines.lines)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  # Everything of step 2 but the marker reached the bucket.
  keys = bucket.keys()
  assert f"run/2/{files.MANIFEST}" in keys and f"run/2/{DATA}" in keys
  assert "run/2/_COMMITTED" not in keys

  with CheckpointManager(bucket.url, read_only=True) as reader:
    assert reader.all_steps() == [1]
    with pytest.raises(CheckpointNotFoundError):
      reader.restore({"w": np.zeros(8, np.int64)}, step=2)
  with CheckpointManager(bucket.url) as restarted:
    assert restarted.latest_step() == 1
    assert restarted.restore({"w": np.zeros(8, np.int64)})["w"].tolist() == (
        list(range(8)))
  assert bucket.keys() == _expected_keys(1)


def test_interrupted_deletion_never_leaves_a_finalized_looking_step(
    bucket, monkeypatch):
  """Retention removes the marker first: a crash after that is unfinished."""
  with CheckpointManager(bucket.url) as manager:
    for step in (1, 2):
      manager.save(step, {"w": jnp.arange(3)})
      manager.wait_until_finished()
  directory = object_store.as_path(bucket.url)

  def crash(self, path):
    raise OSError(f"connection lost while removing {path}")

  with monkeypatch.context() as m:
    m.setattr(backend_lib.ObjectStoreBackend, "remove", crash)
    with pytest.raises(OSError, match="connection lost"):
      directory_lib.delete_step(directory, 1)
  assert "run/1/_COMMITTED" not in bucket.keys()
  assert f"run/1/{DATA}" in bucket.keys()
  assert directory_lib.finalized_steps(directory) == [2]
  with CheckpointManager(bucket.url) as manager:
    assert manager.all_steps() == [2]
  assert bucket.keys() == _expected_keys(2)


def test_two_attempts_at_one_step_never_finalize_or_delete_each_other(
    bucket):
  """An old job re-preparing a step that a new job is writing (commit file).

  The later `prepare` replaces the step's `_ATTEMPT` token: the earlier
  attempt may neither finalize over it nor, when abandoned, delete it.
  """
  directory = object_store.as_path(bucket.url)
  old = atomicity.temporary_path(directory, 4, "commit_file")
  new = atomicity.temporary_path(directory, 4, "commit_file")
  old.prepare()
  (old.path / "old.txt").write_text("old")
  new.prepare()
  (new.path / "new.txt").write_text("new")
  assert old.is_ours() is False and new.is_ours() is True
  with pytest.raises(FileExistsError, match="was replaced while it was"):
    old.finalize()
  old.abandon()
  assert bucket.keys("run/4/") == ["run/4/_ATTEMPT", "run/4/new.txt"]
  new.finalize()
  assert bucket.keys("run/4/") == ["run/4/_COMMITTED", "run/4/new.txt"]
  assert directory_lib.finalized_steps(directory) == [4]


def test_second_writer_takes_over_and_the_first_gets_concurrent_writer_error(
    bucket):
  first = CheckpointManager(bucket.url, max_to_keep=1)
  first.save(1, {"w": jnp.arange(4)})
  first.wait_until_finished()
  claim = json.loads(bucket.get("run/_WRITER"))
  second = CheckpointManager(bucket.url, max_to_keep=1)
  assert json.loads(bucket.get("run/_WRITER"))["token"] != claim["token"]
  first.save(2, {"w": jnp.arange(4) + 2})
  with pytest.raises(ConcurrentWriterError, match="step 2 was not finalized"):
    first.wait_until_finished()
  first.close()
  assert not any(k.startswith("run/2/") for k in bucket.keys())
  second.save(2, {"w": jnp.arange(4) + 20})
  second.close()
  assert bucket.keys() == _expected_keys(2)


# -- the callback and damaged objects -----------------------------------------


def test_restore_or_initialize_from_a_bucket(bucket, make_state, train_step,
                                             assert_trees_equal, host_copy):
  # First run: nothing in the bucket, so the given state comes back.
  initial = make_state()
  with CheckpointCallback(bucket.url, every_steps=2, max_to_keep=2) as cb:
    state = cb.restore_or_initialize(initial)
    assert state is initial and cb.restored_step is None
    saved = {}
    for step in range(1, 6):
      state = train_step(state)
      if cb(step, state, extra={"step": step}):
        saved[step] = host_copy(state)
    cb.wait_until_finished()
    assert cb.manager.all_steps() == [2, 4]
  assert _steps_in_bucket(bucket) == {"2", "4"}

  # Restart: the newest finalized step, with its `extra`.
  with CheckpointCallback(bucket.url, every_steps=2, max_to_keep=2) as cb:
    restored = cb.restore_or_initialize(train_step(make_state(seed=3)))
    assert cb.restored_step == 4
    assert cb.restored_extra == {"step": 4}
  assert_trees_equal(restored, saved[4])


def _flip_byte(b: Bucket, step: int, offset: int) -> None:
  body = bytearray(b.get(f"run/{step}/{DATA}"))
  body[offset] ^= 0xFF
  b.put(f"run/{step}/{DATA}", bytes(body))


def _truncate(b: Bucket, step: int) -> None:
  b.put(f"run/{step}/{DATA}", b.get(f"run/{step}/{DATA}")[:-10])


def _remove(b: Bucket, step: int) -> None:
  b.delete(f"run/{step}/{DATA}")


@pytest.mark.parametrize("damage,fragment", [
    (lambda b, s: _flip_byte(b, s, 5), "leaf 'w': checksum mismatch"),
    (_truncate, "truncated"),
    (_remove, "missing"),
], ids=["flipped_byte", "truncated_object", "missing_object"])
def test_damaged_object_error_names_file_step_and_leaf(bucket, damage,
                                                       fragment):
  states = {s: {"w": np.random.default_rng(s).standard_normal(64)
                .astype(np.float32)} for s in (1, 2)}
  with CheckpointManager(bucket.url) as manager:
    for step, state in states.items():
      manager.save(step, state)
      manager.wait_until_finished()
  damage(bucket, 2)
  target = {"w": np.zeros(64, np.float32)}
  with CheckpointManager(bucket.url, read_only=True) as manager:
    with pytest.raises(CheckpointCorruptedError) as info:
      manager.restore(target, step=2)
    message = str(info.value)
    assert fragment in message, message
    assert f"{bucket.url}/2" in message and DATA in message, message
    assert "step 2" in message, message
    assert "leaf 'w'" in message, message
    # The other step is untouched, and the fallback finds it.
    step, restored = manager.restore_newest_valid(target)
  assert step == 1
  assert restored["w"].tobytes() == states[1]["w"].tobytes()


def test_restore_or_initialize_skips_a_corrupted_newest_step(
    bucket, make_state, train_step, assert_trees_equal, host_copy):
  saved = {}
  with CheckpointCallback(bucket.url, every_steps=1) as cb:
    state = make_state()
    for step in (1, 2):
      state = train_step(state)
      cb(step, state)
      saved[step] = host_copy(state)
  manifest = json.loads(bucket.get(f"run/2/{files.MANIFEST}"))
  shard = next(leaf for leaf in manifest["leaves"]
               if leaf["path"].endswith("kernel"))["shards"][0]
  _flip_byte(bucket, 2, shard["offset"] + 3)
  with CheckpointCallback(bucket.url, every_steps=1) as cb:
    restored = cb.restore_or_initialize(train_step(make_state(seed=4)))
    assert cb.restored_step == 1
  assert_trees_equal(restored, saved[1])
  # Set aside: no longer finalized, so the resumed run saves step 2 anew.
  assert "run/2/_COMMITTED" not in bucket.keys()
  with CheckpointCallback(bucket.url, every_steps=1) as cb:  # Cleans it up.
    assert not any(k.startswith("run/2/") for k in bucket.keys())
    assert cb(2, train_step(jax.device_put(saved[1])))
  assert "run/2/_COMMITTED" in bucket.keys()


# -- several processes --------------------------------------------------------


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_two_processes_save_and_restore_a_sharded_train_state_in_a_bucket(
    bucket):
  """2 JAX processes (4 devices) train and save to a bucket; 2 fresh ones
  restore.

  Each process uploads only its own shards, as `data/process_0000N.bin`.
  The workers inherit the environment that points at the server.
  """
  saving = [r.json for r in run_workers(
      "save_restore", 2, args=["save", bucket.url], timeout=RUN_TIMEOUT)]
  latest = saving[0]["saved"]["6"]
  for p, out in enumerate(saving):
    assert out["all_steps"] == [4, 6], p
    assert out["restored"] == latest, p
  keys = bucket.keys()
  assert keys == sorted(["run/_WRITER"] + [
      f"run/{s}/{name}" for s in (4, 6)
      for name in ("_COMMITTED", files.MANIFEST, "data/process_00000.bin",
                   "data/process_00001.bin")])
  sizes = [len(bucket.get(f"run/6/data/process_{p:05d}.bin")) for p in (0, 1)]
  assert sizes == [saving[0]["owned_bytes"], saving[1]["owned_bytes"]]
  assert sum(sizes) == saving[0]["total_array_bytes"]

  fresh = [r.json for r in run_workers(
      "save_restore", 2, args=["restore", bucket.url], timeout=RUN_TIMEOUT)]
  for p, out in enumerate(fresh):
    assert out["restored_step"] == 6, p
    assert out["is_train_state"], p
    assert out["restored_on_target_shardings"], p
    assert out["restored"] == latest, p
    assert out["alt_restored"] == latest, p
    assert out["step_after_training"] == 7, p


# S3 only: on GCS, gcsfs answers every existence check (of a step's
# _COMMITTED) with a listing too, so each process still lists.
@s3_only
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_a_resume_lists_and_reads_as_often_with_4_processes_as_with_1(
    bucket):
  """Opening the directory and restoring the newest step, as a resumed job
  does on every process: only the primary lists the bucket and reads the
  manifest (the others receive them through the coordinator), and the
  state, 16 MiB replicated on every device, is read once, a quarter by
  each process (one checksum block each), and shared by a collective. So 4
  processes send the store as many list requests and manifest GETs as 1,
  and read the state's bytes once."""
  w = np.arange(4 << 20, dtype=np.int32)
  with CheckpointManager(bucket.url) as manager:
    manager.save(3, {"w": w})
  keys = {"list": "", "manifest": "run/3/manifest.json"}
  counts, reads = [], []
  for processes in (1, 4):
    before = {name: bucket.settled_requests(
        "list" if name == "list" else "read", key)
              for name, key in keys.items()}
    out = [r.json for r in run_workers(
        "open_restore", processes, args=[bucket.url, "int32", len(w)],
        timeout=RUN_TIMEOUT)]
    for o in out:
      assert (o["step"], o["dtype"], o["head"], o["sum"]) == (
          3, "int32", [0, 1, 2, 3], int(w.sum(dtype=np.int32))), o
    bucket.wait_for_requests("list", at_least=before["list"] + 1)
    counts.append({name: bucket.settled_requests(
        "list" if name == "list" else "read", key) - before[name]
                   for name, key in keys.items()})
    reads.append([o["read"] for o in out])
  assert counts[0]["list"] > 0 and counts[0] == counts[1], counts
  assert counts[0]["manifest"] == 1, counts
  assert sum(reads[0]) == sum(reads[1]) == w.nbytes, reads
  assert max(reads[1]) <= w.nbytes / 4 + 4096, reads  # A quarter each.
