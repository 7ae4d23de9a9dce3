"""Object stores (`s3://`, `gs://`, ...): paths through fsspec, ranged reads,
and their backend (`ObjectStoreBackend`).

`as_path` turns a directory name into the `epath.Path` this package reads and
writes through; `ObjectFile` reads byte ranges of one object, each with its
own ranged GET, so restore threads read at once.
"""

from __future__ import annotations

import functools
import os
from typing import BinaryIO, Iterator

from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath as epath_gpath

from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.backends import layout
from flax_ckpt_plugin.backends.interface import Backend
from flax_ckpt_plugin.backends.interface import Identity
from flax_ckpt_plugin.backends.interface import RangedFile
from flax_ckpt_plugin.backends.interface import StepWriter
from flax_ckpt_plugin.errors import CheckpointCorruptedError

# Object-store schemes that etils' paths know, and the fsspec implementation
# and extra of this package that each needs.
_FSSPEC_PACKAGES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"),
                    "az": ("adlfs", None), "hf": ("huggingface_hub", None)}


def _gcs_emulator() -> str | None:
  """The GCS emulator that `STORAGE_EMULATOR_HOST` names, or None (GCS).

  The variable that google-cloud-storage and gcsfs read to send `gs://`
  requests to a local emulator (fake-gcs-server, gcp-storage-emulator)
  instead of storage.googleapis.com; unset, empty or 'default' means GCS.
  """
  host = os.environ.get("STORAGE_EMULATOR_HOST", "")
  return None if host in ("", "default") else host


@functools.cache
def _filesystem(protocol: str, pid: int, emulator: str | None):
  """One fsspec filesystem per protocol and process, without listing cache.

  fsspec caches directory listings by default, and a cached listing does
  not show what other processes wrote since (the commit marker of a step
  that another host finalized): every listing and existence check here
  asks the store. The process id is in the cache key because fsspec's
  event loop does not survive a fork; the GCS emulator is, so that setting
  or changing `STORAGE_EMULATOR_HOST` takes effect.
  """
  del pid
  import fsspec  # pylint: disable=g-import-not-at-top
  try:
    if emulator is None:
      return fsspec.filesystem(protocol, use_listings_cache=False)
    # An emulator speaks GCS's JSON API over HTTP, and nothing else. So no
    # credentials (google-cloud-storage's client goes anonymous there too,
    # and none of the machine's own would be sent to it), and gcsfs' JSON
    # API filesystem: the one that recent gcsfs names `gs` by default
    # (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT) first asks the gRPC Storage
    # Control API for a bucket's layout, which an emulator does not serve,
    # and retries that for up to a minute on every call.
    from gcsfs import core as gcsfs_core  # pylint: disable=g-import-not-at-top
    return gcsfs_core.GCSFileSystem(token="anon", use_listings_cache=False)
  except ImportError as e:
    package, extra = _FSSPEC_PACKAGES.get(protocol, (None, None))
    hint = (f"pip install {package} (the '{extra}' extra of"
            " flax_ckpt_plugin)" if extra else
            f"pip install {package}" if package else
            "install the fsspec implementation of this scheme")
    raise ImportError(f"{protocol}:// checkpoints need {package or 'fsspec'}:"
                      f" {hint} ({e})") from e


# Objects deleted a part at a time (`delete_step_in_parts`): one batch
# request of GCS, a few of S3's (1,000 a request).
DELETE_PART = 100


def filesystem(path: epath.PathLike):
  """The fsspec filesystem that serves the object-store `path`."""
  protocol = interface.scheme(path)
  return _filesystem(protocol, os.getpid(),
                     _gcs_emulator() if protocol == "gs" else None)


class _FsspecBackend(type(epath_backend.fsspec_backend)):
  """etils' fsspec backend, on filesystems without a listing cache."""

  def fs(self, path: epath.PathLike):
    return filesystem(path)

  def walk(self, top: epath.PathLike, *, top_down: bool = True,
           on_error=None):
    # etils passes `max_depth=` (fsspec's is `maxdepth`), which fsspec hands
    # on to `ls`, where s3fs rejects it; and fsspec's roots lack the scheme.
    prefix = f"{interface.scheme(top)}://"
    for root, dirs, files in self.fs(top).walk(
        os.fspath(top), topdown=top_down,
        on_error="omit" if on_error is None else on_error):
      yield (root if root.startswith(prefix) else prefix + root), dirs, files


_FSSPEC_BACKEND = _FsspecBackend()


class ObjectStorePath(epath_gpath.PosixGPath):
  """An `epath.Path` on `s3://`, `gs://`... that always uses fsspec.

  `epath.Path` sends `gs://` and `s3://` to `tf.io.gfile` whenever
  tensorflow is importable (unless `EPATH_USE_TF=false` is set before its
  first use), and `tf.io.gfile` has no `s3://` since TensorFlow 2.6. A
  checkpoint directory must not change backends because a training job
  happens to have tensorflow installed (for its input pipeline, say), so
  the paths this package makes use fsspec; the user's own `epath.Path`
  objects and the process-wide etils settings are left as they are.
  Paths derived from one (`/`, `parent`, `iterdir`) are of this class too.
  """

  @property
  def _backend(self) -> epath_backend.Backend:
    return _FSSPEC_BACKEND

  def mkdir(self, mode: int = 0o777, parents: bool = False,
            exist_ok: bool = False) -> None:
    """Checks that the bucket exists; object stores have no directories.

    A prefix exists as soon as an object under it does, so there is nothing
    to create. fsspec's `makedirs` would create a missing bucket, so that a
    mistyped bucket name would quietly make a new bucket: never done here.

    Raises:
      FileNotFoundError: the bucket does not exist (or these credentials
        cannot see it); names the bucket.
      FileExistsError: `exist_ok` is False and objects exist under the path.
    """
    del mode, parents
    if not exist_ok and self.exists():
      raise FileExistsError(f"{self} already exists")
    try:
      filesystem(self).mkdir(os.fspath(self), create_parents=False)
    except FileExistsError:
      if not exist_ok:
        raise
    except FileNotFoundError as e:
      bucket = os.fspath(self).split("://", 1)[1].split("/", 1)[0]
      raise FileNotFoundError(
          f"cannot use {self}: bucket {bucket!r} does not exist or these"
          f" credentials cannot see it ({e}). Buckets are never created"
          " here.") from e


def as_path(path: epath.PathLike) -> epath.Path:
  """`path` as the `epath.Path` that this package reads and writes through.

  Local paths: `epath.Path(path)`. `s3://`, `gs://`, `az://`, `hf://`: an
  `ObjectStorePath`, which goes through fsspec (install
  `flax_ckpt_plugin[s3]` or `[gcs]`). Other schemes: whatever `epath.Path`
  makes of them.
  """
  if isinstance(path, ObjectStorePath):
    return path
  if interface.scheme(path) in _FSSPEC_PACKAGES:
    return ObjectStorePath(os.fspath(path))
  return path if isinstance(path, epath.Path) else epath.Path(path)


# Object stores: one ranged GET fetches at most this many bytes, and a
# longer range is fetched as that many GETs at once (bounding the transient
# copy of each); a range up to this size is exactly one GET.
_GET_BYTES = 16 << 20
_GETS_AT_ONCE = 4


class ObjectFile:
  """A data file in an object store, read by ranged GETs.

  Holds no connection or file position, so threads read it at once: each
  range is fetched by its own request (`cat_file` with start and end), not
  by seek and read on a shared handle, whose read-ahead buffer would fetch
  far more than asked and serialize the threads.
  """

  def __init__(self, path: epath.Path):
    self._fs = filesystem(path)
    self._url = os.fspath(path)
    info = self._fs.info(self._url)  # FileNotFoundError if it is missing.
    if info.get("type") != "file":
      raise CheckpointCorruptedError(
          f"data file {path} is not a file (a prefix of other objects?)")
    self.size = info["size"]

  def read_into(self, offset: int, out: memoryview) -> int:
    """Reads into `out` from `offset`; returns bytes read (short at the end)."""
    # Nothing past the end is asked for: S3 and GCS answer a range that
    # starts there with an error (416), not with no bytes.
    out = out[:max(0, min(len(out), self.size - offset))]
    pieces = [(a, min(a + _GET_BYTES, len(out)))
              for a in range(0, len(out), _GET_BYTES)]
    done = 0
    for i in range(0, len(pieces), _GETS_AT_ONCE):
      batch = pieces[i:i + _GETS_AT_ONCE]
      if len(batch) == 1:
        data = [self._fs.cat_file(self._url, start=offset + batch[0][0],
                                  end=offset + batch[0][1])]
      else:  # Concurrent requests, on fsspec's event loop.
        data = self._fs.cat_ranges(
            [self._url] * len(batch), [offset + a for a, _ in batch],
            [offset + b for _, b in batch], on_error="raise")
      for (a, b), chunk in zip(batch, data):
        out[a:a + len(chunk)] = chunk
        done += len(chunk)
        if len(chunk) < b - a:
          return done  # The object ended early.
    return done

  def close(self) -> None:
    pass


# -- the backend ---------------------------------------------------------------


class _ObjectStepWriter(StepWriter):
  """No directory to make or to hold: a prefix exists once an object under
  it does; each file is one object, uploaded when it is closed."""

  def __init__(self, step_dir: epath.Path):
    self._dir = as_path(step_dir)

  def open(self, name: str) -> BinaryIO:
    return (self._dir / name).open("wb")


class _ObjectFile(RangedFile):

  def __init__(self, path: epath.Path):
    self._file = ObjectFile(path)
    self.size = self._file.size

  def read_into(self, offset: int, out: memoryview) -> int:
    done = 0
    while done < len(out):  # A ranged GET stops short only at the end.
      n = self._file.read_into(offset + done, out[done:])
      if not n:
        break
      done += n
    return done

  def close(self) -> None:
    self._file.close()


class ObjectStoreBackend(Backend):
  """`gs://`, `s3://`... through fsspec: no rename, no fsync, no inodes.

  A PUT is atomic and durable once it returns, so small files need no more;
  a step is deleted commit marker first, so what is left of a crash half
  way is unfinished.
  """

  rename_is_atomic = False
  reads_are_requests = True

  def as_path(self, given: str) -> epath.Path:
    return as_path(given)

  def write_small(self, path: epath.Path, text: str) -> None:
    path.write_text(text)

  def replace_small(self, path: epath.Path, text: str) -> None:
    path.write_text(text)

  def step_writer(self, step_dir: epath.Path, identity: Identity | None,
                  data_dir: str) -> StepWriter:
    del identity, data_dir
    return _ObjectStepWriter(step_dir)

  def open_ranged(self, path: epath.Path, within: epath.Path) -> RangedFile:
    del within  # Object names cannot leave a prefix.
    return _ObjectFile(path)

  def read_small(self, path: epath.Path, *, within: epath.Path,
                 limit: int) -> bytes:
    del within  # Object names cannot leave a prefix.
    fs, url = filesystem(path), os.fspath(path)
    info = fs.info(url)  # FileNotFoundError if it is missing.
    if info.get("type") != "file":
      raise CheckpointCorruptedError(f"{path} is not a file")
    if info["size"] > limit:
      raise CheckpointCorruptedError(
          f"{path}: {info['size']} bytes, over the limit of {limit}")
    data = fs.cat_file(url, start=0, end=limit + 1)
    if len(data) > limit:  # Replaced by a larger object meanwhile.
      raise CheckpointCorruptedError(f"{path}: over the limit of {limit}")
    return data

  def delete_step(self, directory: epath.Path, step: int) -> None:
    step_dir = directory / str(step)
    (step_dir / layout.COMMIT_MARKER).unlink(missing_ok=True)
    self.remove(step_dir)

  def delete_step_in_parts(self, directory: epath.Path, step: int
                           ) -> Iterator[None]:
    # The marker first: from then on it is not a step. Then its objects,
    # `DELETE_PART` names to a request batch (GCS takes 100 a batch).
    step_dir = directory / str(step)
    (step_dir / layout.COMMIT_MARKER).unlink(missing_ok=True)
    yield
    fs, url = filesystem(step_dir), os.fspath(step_dir)
    fs.invalidate_cache()
    try:
      names = sorted(fs.find(url))
    except FileNotFoundError:
      names = []
    for i in range(0, len(names), DELETE_PART):
      fs.rm(names[i:i + DELETE_PART])
      yield
    self.remove(step_dir)  # What a listing missed, and folder entries.

  def set_aside(self, directory: epath.Path, step: int) -> str:
    # Without its marker the step is unfinished; the next writer cleans up.
    (directory / str(step) / layout.COMMIT_MARKER).unlink(missing_ok=True)
    return "unfinished (its commit marker was removed)"

  def size_and_mtime(self, path: epath.Path) -> tuple[int, float]:
    st = path.stat()
    return st.length, float(st.mtime)
