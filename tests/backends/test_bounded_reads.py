"""Small files are read only if they are small regular files of the step.

A `manifest.json`, `_WRITER` or `_COMMITTED` that is a named pipe, a link to
/dev/zero or out of the step, a huge sparse file, a manifest that claims a
huge checksum block, a hostile PRNG impl or dtype, or a leaf of thousands of
shards. Each is refused at once with a `CheckpointCorruptedError` (or, for
the writer's claim, read as no claim), never waited on, read whole or
trusted.

Calls that would block on a FIFO run in a thread: past the deadline the test
opens the pipe's write end itself to let the reader go, and fails. Calls
that would read /dev/zero or a 1 TiB file whole run in a subprocess capped
at a few GiB of address space, so that a regression fails, not the machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import tracemalloc
from typing import Any, Callable

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import registry as backend_lib
from flax_ckpt_plugin import CheckpointCorruptedError
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin import StructureMismatchError
from flax_ckpt_plugin.tools import cli
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.restore import tree as restore_lib
from helpers import call_on_thread

MANIFEST = "manifest.json"
DEADLINE_SECS = 15  # Each call takes well under a second when it works.
# The package under test, for the subprocesses.
ROOT = pathlib.Path(manifest_lib.__file__).resolve().parent.parent


@pytest.fixture
def saved(ckpt_dir):
  """Steps 1 and 2 of a small tree (an array and a PRNG key)."""
  with CheckpointManager(ckpt_dir) as manager:
    for step in (1, 2):
      manager.save(step, {"w": jnp.arange(8.0) * step,
                          "key": jax.random.key(step)})
  return ckpt_dir


def _target():
  return {"w": jax.ShapeDtypeStruct((8,), jnp.float32),
          "key": jax.eval_shape(lambda: jax.random.key(0))}


def _restore(directory: pathlib.Path, step: int) -> Any:
  with CheckpointManager(directory, read_only=True) as manager:
    return manager.restore(_target(), step)


def _edit(step_dir: pathlib.Path, edit: Callable[[dict], None]) -> None:
  doc = json.loads((step_dir / MANIFEST).read_text())
  edit(doc)
  (step_dir / MANIFEST).write_text(json.dumps(doc))


def _leaf(doc: dict, path: str) -> dict:
  return next(l for l in doc["leaves"] if l["path"] == path)


def _within_deadline(call: Callable[[], Any],
                     fifos: list[pathlib.Path]) -> Any:
  """`call()`'s result or exception; fails if it blocks past the deadline."""
  thread, outcome = call_on_thread(call, DEADLINE_SECS)
  hung = thread.is_alive()
  if hung:  # Let a reader blocked in open() go.
    for fifo in fifos:
      try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
      except OSError:
        pass
    thread.join(30)
  assert not hung, f"blocked on a named pipe among {fifos}"
  return outcome


def _mkfifo(path: pathlib.Path) -> pathlib.Path:
  path.unlink(missing_ok=True)
  os.mkfifo(path)
  return path


# -- named pipes ---------------------------------------------------------------


def test_fifo_manifest_is_refused_by_restore_at_once(saved):
  fifo = _mkfifo(saved / "2" / MANIFEST)
  outcome = _within_deadline(lambda: _restore(saved, 2), [fifo])
  error = outcome.get("error")
  assert isinstance(error, CheckpointCorruptedError), outcome
  assert f"{fifo} is not a regular file" in str(error)
  assert np.array_equal(_restore(saved, 1)["w"], np.arange(8.0))


def test_fifo_writer_claim_does_not_block_opening_for_writing(saved):
  fifo = _mkfifo(saved / atomicity.WRITER_FILE)
  assert _within_deadline(lambda: directory_lib.current_writer(saved),
                          [fifo]) == {"result": None}

  def open_and_save():
    with CheckpointManager(saved) as manager:
      manager.save(3, {"w": jnp.zeros(8), "key": jax.random.key(3)})
    return directory_lib.current_writer(saved)

  outcome = _within_deadline(open_and_save, [fifo])
  assert "error" not in outcome, outcome
  assert outcome["result"]["pid"] == os.getpid()  # The claim replaced it.


@pytest.mark.parametrize("command", ["show", "verify", "list"])
def test_fifo_manifest_or_claim_cli_answers_promptly(saved, capsys, command):
  fifos = [_mkfifo(saved / "2" / MANIFEST),
           _mkfifo(saved / atomicity.WRITER_FILE)]
  args = [command, str(saved)] + (["-q"] if command == "verify" else [])
  outcome = _within_deadline(lambda: cli.main(args), fifos)
  assert "error" not in outcome, outcome
  out = capsys.readouterr()
  if command == "list":
    assert outcome["result"] == cli.EXIT_OK, out.err
  else:
    assert outcome["result"] == cli.EXIT_CORRUPT, out.err
    assert f"{fifos[0]} is not a regular file" in out.out + out.err, out


# -- /dev/zero, sparse files, huge blocks --------------------------------------

# Run with at most 3 GiB of address space: reading /dev/zero or a 1 TiB
# file whole fails there with a MemoryError instead of taking the machine.
_CAPPED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.tools import cli, inventory
from flax_ckpt_plugin.format import manifest
from etils import epath
d = epath.Path(sys.argv[2])
what = sys.argv[1]
if what == "manifest":
  try:
    manifest.read(d / "2", 2)
  except manifest.CheckpointCorruptedError as e:
    print("refused:", e)
elif what == "writer":
  print("claim:", directory_lib.current_writer(d))
elif what == "marker":
  print("committed:", inventory.committed_unix(d / "2"))
else:
  sys.exit(cli.main([what, str(d)]))
"""


def _capped(what: str, directory: pathlib.Path
            ) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
  return subprocess.run([sys.executable, "-c", _CAPPED, what, str(directory)],
                        capture_output=True, text=True, timeout=120,
                        check=False, env=env)


def _zero_link(path: pathlib.Path) -> None:
  path.unlink(missing_ok=True)
  os.symlink("/dev/zero", path)


def _sparse(path: pathlib.Path) -> None:
  with open(path, "wb") as f:
    f.truncate(1 << 40)


@pytest.mark.parametrize("damage", [_zero_link, _sparse],
                         ids=["dev_zero_link", "sparse_1tib"])
def test_huge_manifest_is_refused_without_reading_it(saved, damage):
  path = saved / "2" / MANIFEST
  damage(path)
  r = _capped("manifest", saved)
  assert r.returncode == 0, r.stderr[-2000:]
  assert f"refused: {path}" in r.stdout, r.stdout
  r = _capped("show", saved)
  assert r.returncode == cli.EXIT_CORRUPT, r.stderr[-2000:]
  assert str(path) in r.stderr, r.stderr


@pytest.mark.parametrize("damage", [_zero_link, _sparse],
                         ids=["dev_zero_link", "sparse_1tib"])
def test_huge_writer_claim_or_marker_reads_as_none(saved, damage):
  damage(saved / atomicity.WRITER_FILE)
  damage(saved / "2" / atomicity.COMMIT_MARKER)
  assert _capped("writer", saved).stdout == "claim: None\n"
  assert _capped("marker", saved).stdout == "committed: None\n"
  r = _capped("list", saved)
  assert r.returncode == cli.EXIT_OK, r.stderr[-2000:]


def _one_block_per_shard(block: int) -> Callable[[pathlib.Path], None]:
  """Makes the manifest claim `block`-byte checksum blocks, honestly."""
  def damage(step_dir):
    def edit(doc):
      doc["checksum"]["block_bytes"] = block
      for leaf in doc["leaves"]:
        for s in leaf.get("shards", []):
          with open(step_dir / s["file"], "rb") as f:
            f.seek(s["offset"])
            s["crc32c"] = [crc32c.crc32c(f.read(s["nbytes"]))]
    _edit(step_dir, edit)
  return damage


def test_verify_of_a_huge_claimed_block_allocates_what_the_files_hold(
    saved, capsys):
  _one_block_per_shard(1 << 50)(saved / "2")  # 1 PiB.
  tracemalloc.start()
  try:
    code = cli.main(["verify", str(saved), "2", "-q"])
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  out = capsys.readouterr()
  assert code == cli.EXIT_OK, out.err
  assert "step 2: ok" in out.out
  assert peak < 16 << 20, peak
  assert np.array_equal(_restore(saved, 2)["w"], np.arange(8.0) * 2)


def test_verify_sums_a_block_larger_than_its_buffer(ckpt_dir, capsys,
                                                    monkeypatch):
  from flax_ckpt_plugin.tools import verify  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(verify, "_VERIFY_CHUNK", 1000)
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, {"w": jnp.arange(5000.0)})
  _one_block_per_shard(1 << 30)(ckpt_dir / "1")
  assert cli.main(["verify", str(ckpt_dir), "-q"]) == cli.EXIT_OK
  doc = json.loads((ckpt_dir / "1" / MANIFEST).read_text())
  shard = _leaf(doc, "w")["shards"][0]
  with open(ckpt_dir / "1" / shard["file"], "r+b") as f:
    f.seek(shard["offset"] + 4321)
    f.write(b"\x7f")
  assert cli.main(["verify", str(ckpt_dir), "-q"]) == cli.EXIT_CORRUPT
  assert "checksum mismatch" in capsys.readouterr().out


# -- a manifest linked from outside --------------------------------------------


def test_manifest_linked_from_outside_the_step_is_refused(saved, tmp_path):
  outside = tmp_path / "elsewhere.json"
  outside.write_bytes((saved / "2" / MANIFEST).read_bytes())  # Genuine.
  (saved / "2" / MANIFEST).unlink()
  os.symlink(outside, saved / "2" / MANIFEST)
  with pytest.raises(CheckpointCorruptedError,
                     match="leads outside") as info:
    _restore(saved, 2)
  assert str(saved / "2" / MANIFEST) in str(info.value)


def test_manifest_linked_within_the_step_is_read(saved):
  step_dir = saved / "2"
  os.rename(step_dir / MANIFEST, step_dir / "real.json")
  os.symlink("real.json", step_dir / MANIFEST)
  assert np.array_equal(_restore(saved, 2)["w"], np.arange(8.0) * 2)


def test_read_small_caps_the_size(tmp_path):
  path = tmp_path / "f"
  path.write_bytes(b"x" * 11)
  read = backend_lib.LOCAL.read_small
  assert read(path, within=tmp_path, limit=11) == b"x" * 11
  with pytest.raises(CheckpointCorruptedError, match="11 bytes, over the"
                     " limit of 10"):
    read(path, within=tmp_path, limit=10)
  with pytest.raises(FileNotFoundError):
    read(tmp_path / "g", within=tmp_path, limit=10)


# -- hostile key_impl and dtype ------------------------------------------------


def _set(path: str, field: str, value: Any) -> Callable[[dict], None]:
  def edit(doc):
    if value is _DELETE:
      del _leaf(doc, path)[field]
    else:
      _leaf(doc, path)[field] = value
  return edit


_DELETE = object()
_HOSTILE_LEAVES = {
    "key_impl_empty": (_set("key", "key_impl", ""), "'key'"),
    "key_impl_10kb": (_set("key", "key_impl", "x" * 10_000), "'key'"),
    "key_impl_not_a_name": (_set("key", "key_impl", "../threefry"), "'key'"),
    "key_impl_null": (_set("key", "key_impl", None), "'key'"),
    "dtype_missing": (_set("w", "dtype", _DELETE), "'w'"),
    "dtype_null": (_set("w", "dtype", None), "'w'"),
}


@pytest.mark.parametrize("case", list(_HOSTILE_LEAVES))
def test_hostile_key_impl_or_dtype_is_corruption_naming_file_and_leaf(
    saved, capsys, case):
  edit, leaf = _HOSTILE_LEAVES[case]
  _edit(saved / "2", edit)
  path = saved / "2" / MANIFEST
  with pytest.raises(CheckpointCorruptedError) as info:
    _restore(saved, 2)
  message = str(info.value)
  assert str(path) in message and f"leaf {leaf}" in message, message
  assert len(message) < 1000, message
  assert cli.main(["show", str(saved), "2"]) == cli.EXIT_CORRUPT
  err = capsys.readouterr().err
  assert str(path) in err and f"leaf {leaf}" in err, err


def test_unknown_key_impl_is_named_by_the_check_restore_calls(saved):
  _edit(saved / "2", _set("key", "key_impl", "no_such_impl"))
  m = manifest_lib.read(saved / "2", 2)  # A well-formed name: parses.
  where = f"step 2 in {saved / '2'}"
  with pytest.raises(CheckpointCorruptedError,
                     match=r"leaf 'key': key data of PRNG impl"
                     r" 'no_such_impl' cannot be restored"):
    restore_lib.check_key_impl(m.leaf_by_path["key"], where)
  restore_lib.check_key_impl(m.leaf_by_path["w"], where)  # No key: fine.
  good = manifest_lib.read(saved / "1", 1).leaf_by_path["key"]
  restore_lib.check_key_impl(good, where)


def test_unknown_key_impl_through_restore(saved):
  """An impl this JAX lacks depends on the environment: a mismatch with the
  target's impl, never damage (the fallback would set the step aside)."""
  _edit(saved / "2", _set("key", "key_impl", "no_such_impl"))
  with pytest.raises(StructureMismatchError, match="leaf 'key'"):
    _restore(saved, 2)


# -- the cover check -----------------------------------------------------------


def _many_shards(n: int) -> bytes:
  """A manifest of one float32[4, n] leaf in n shards of one column each."""
  shards = [{"file": "d", "offset": 16 * i, "nbytes": 16,
             "index": [[0, 4], [i, i + 1]], "crc32c": [0]} for i in range(n)]
  doc = {"format": "flax_ckpt_plugin", "format_version": 1, "step": 1,
         "files": {"d": 16 * n},
         "checksum": {"algorithm": "crc32c", "block_bytes": 4 << 20},
         "leaves": [{"path": "w", "kind": "array", "dtype": "float32",
                     "shape": [4, n], "shards": shards}]}
  return json.dumps(doc).encode()


def test_a_leaf_of_20000_shards_parses_quickly():
  raw = _many_shards(20_000)
  start = time.perf_counter()
  m = manifest_lib.parse(raw, "m.json")
  secs = time.perf_counter() - start
  print(f"parsed {len(raw) / 1e6:.1f} MB, 20000 shards, in {secs:.3f}s")
  assert len(m.leaves[0].shards) == 20_000
  assert secs < 5, secs  # Took 35 s when the check was quadratic.
