"""Small helpers that several test modules share.

Plain functions only: fixtures live in `conftest.py`, and starting processes
is `launcher.py`'s job.
"""

from __future__ import annotations

from concurrent import futures
import contextlib
import os
import pathlib
import re
import subprocess
import sys
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.arrays import copies as copies_lib
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.backends import registry as backend_lib

# The writer's claim on a checkpoint directory (docs/format.md); not a step.
_WRITER = "_WRITER"


def entries(directory: str | os.PathLike) -> set[str]:
  """The names in `directory`, less the writer's claim on it."""
  return set(os.listdir(directory)) - {_WRITER}


def sorted_entries(directory: str | os.PathLike) -> list[str]:
  """`entries(directory)`, sorted."""
  return sorted(entries(directory))


def all_entries(directory: pathlib.Path) -> list[str]:
  """The names in `directory`, the writer's claim included, sorted."""
  return sorted(os.listdir(directory))


def assert_only_finalized_steps(directory: pathlib.Path,
                                steps: list[int]) -> None:
  """`directory` holds exactly `steps`, each finalized, and nothing else."""
  assert sorted_entries(directory) == sorted(str(s) for s in steps), (
      "expected only the finalized steps; leftovers such as '.partial' or"
      " unfinished step directories must not remain")
  for s in steps:
    assert (directory / str(s) / "_COMMITTED").is_file(), s


def tiny(step: int) -> dict[str, jax.Array]:
  """A one-leaf state whose value names the step it was saved at."""
  return {"w": jnp.full((3,), step, jnp.int32)}


def has_key_impl(name: str) -> bool:
  """Whether this JAX has the PRNG implementation `name` (philox4x32 came
  with JAX 0.10.2; older releases raise ValueError for it)."""
  try:
    jax.random.key(0, impl=name)
  except ValueError:
    return False
  return True


def two_device_mesh() -> Mesh:
  """A 1-D mesh ('x') over the two CPU devices that conftest sets up."""
  return Mesh(np.array(jax.devices()[:2]), ("x",))


def small_state(seed: int) -> dict[str, Any]:
  """A few leaves of every kind the format stores.

  A float32 matrix sharded over the 2 CPU devices (two shards), a bfloat16
  vector, a jax int32 scalar, and Python float and int leaves (which live in
  the manifest, without data bytes).
  """
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((8, 4), dtype=np.float32)
  return {
      "w": jax.device_put(w, NamedSharding(two_device_mesh(), P("x"))),
      "v": jnp.asarray(rng.standard_normal(6), jnp.bfloat16),
      "n": jnp.int32(rng.integers(1000)),
      "lr": float(rng.uniform()),
      "count": int(rng.integers(1000)),
  }


def adam_train_state(step: int):
  """A Flax `TrainState` (Adam, params {"w": ones(3)}) at `step`."""
  # Imported here: worker processes import this module, and flax and optax
  # take seconds to import.
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  s = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)},
                                    tx=optax.adam(1e-3))
  return s.replace(step=jnp.int32(step))


def save_each(directory: pathlib.Path, *states: Any, **kwargs) -> None:
  """Saves `states` as steps 1, 2, ..., waiting for each to finalize."""
  with CheckpointManager(directory, **kwargs) as mgr:
    for step, state in enumerate(states, start=1):
      mgr.save(step, state)
      mgr.wait_until_finished()


def restore_read_only(directory: pathlib.Path, target: Any, step: int,
                      **kwargs) -> Any:
  """`restore(target, step)` through a read-only manager of `directory`."""
  # Read-only: restoring must never need write access, and a read-only
  # manager never touches the directory.
  with CheckpointManager(directory, read_only=True) as manager:
    return manager.restore(target, step, **kwargs)


class FlakyDisk(backend_lib.LocalBackend):
  """A local disk whose step writes fail while `on_fire` is set.

  Passed to a manager as `backend=`: the fault goes through the storage
  seam, not through a patched module.
  """

  def __init__(self, on_fire: bool = False):
    self.on_fire = on_fire

  def step_writer(self, step_dir, identity, data_dir):
    if self.on_fire:
      raise OSError(f"disk on fire while writing {step_dir}")
    return super().step_writer(step_dir, identity, data_dir)


def join_commit(manager: CheckpointManager, timeout: float) -> None:
  """Waits for the background thread without asking the manager for errors."""
  assert manager._committer.join(timeout)  # pylint: disable=protected-access


def free_bytes(path: pathlib.Path) -> int:
  st = os.statvfs(path)
  return st.f_bavail * st.f_frsize


def fill(path: pathlib.Path, nbytes: int) -> None:
  chunk = b"\0" * (1 << 20)
  with open(path, "wb") as f:
    while nbytes > 0:
      nbytes -= f.write(chunk[:nbytes])


def flip_byte(path: pathlib.Path, offset: int) -> None:
  """Inverts every bit of one byte, as a disk or a copy gone bad would."""
  with open(path, "r+b") as f:
    f.seek(offset)
    (byte,) = f.read(1)
    f.seek(offset)
    f.write(bytes([byte ^ 0xFF]))


def start_thread(fn: Callable[[], Any], *, name: str = "test-call",
                 daemon: bool = True) -> tuple[threading.Thread, dict]:
  """Starts `fn()` on a thread; its 'result' or 'error' lands in the dict."""
  box: dict[str, Any] = {}

  def run():
    try:
      box["result"] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      box["error"] = e

  thread = threading.Thread(target=run, name=name, daemon=daemon)
  thread.start()
  return thread, box


def call_on_thread(fn: Callable[[], Any], secs: float
                   ) -> tuple[threading.Thread, dict[str, Any]]:
  """`start_thread(fn)`, waiting at most `secs` for it to return.

  The thread is still alive if `fn` blocks: a test then fails on a hang or
  a deadlock instead of hanging itself.
  """
  thread, box = start_thread(fn)
  thread.join(secs)
  return thread, box


# -- the docs' examples ----------------------------------------------------------

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BIN = pathlib.Path(sys.executable).parent  # Where `flax-ckpt` is installed.


def doc_section(page: str, heading: str) -> str:
  """The text of docs/`page` from `heading` (a line) to the next `## `."""
  text = (DOCS / page).read_text()
  start = text.index(f"\n{heading}\n")
  end = text.find("\n## ", start + 1)
  return text[start:] if end < 0 else text[start:end]


def doc_blocks(text: str, kind: str) -> list[str]:
  """The fenced blocks of `kind` (python, console, text) in `text`."""
  return re.findall(rf"^```{kind}\n(.*?)^```$", text, re.M | re.S)


def run_console(block: str, cwd: pathlib.Path) -> None:
  """Runs the block's `$ ` command in bash; its output must be the block's."""
  command, _, expected = block.partition("\n")
  assert command.startswith("$ "), block
  env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
             COLUMNS="80")
  r = subprocess.run(["bash", "-c", command[2:]], cwd=cwd, env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True, timeout=300, check=False)
  assert r.stdout == expected, f"{command}\n{r.stdout}"


def wait_for_compiles() -> None:
  """Waits for every compile that `copies.PROGRAMS` has queued, so that a
  save after it finds its programs compiled."""
  programs = copies_lib.PROGRAMS
  with programs._lock:  # pylint: disable=protected-access
    pending = list(programs._pending.values())  # pylint: disable=protected-access
  futures.wait(pending)


def received_bytes(ring: Any, shards: Sequence[tuple[tuple[int, ...], int]],
                   replicas: int) -> list[int]:
  """The bytes each process receives as partner copies of `shards`
  ((holders, bytes) each, every distinct shard of the state once) along
  `ring` (a `tolerance.partners.Ring`)."""
  out = [0] * len(ring)
  for holders, nbytes in shards:
    for c in ring.copies(holders, replicas):
      out[c.receiver] += nbytes
  return out


def pinned_counter(real: Callable[..., Any]
                   ) -> tuple[dict[str, int], Callable[..., Any]]:
  """Counts the arrays that `real` (`copies.copies_onto`) copies onto pinned
  host memory and off it, by memory kind. Returns the counts, which fill as
  it runs, and the counting function to put in its place."""
  seen = {"onto_pinned": 0, "off_pinned": 0}

  def counting(srcs, shardings):
    for src, sharding in zip(srcs, shardings):
      if sharding.memory_kind == "pinned_host":
        seen["onto_pinned"] += 1
      elif src.sharding.memory_kind == "pinned_host":
        seen["off_pinned"] += 1
    return real(srcs, shardings)

  return seen, counting


class HangingDisk(backend_lib.LocalBackend):
  """A local disk on which some reads or syncs never return, as on a
  network or FUSE mount that stops answering, until `unblock` is set.

  A fake: no real mount here can be made to stop answering on demand.
  Reads of data files whose path matches `reads` (with `maps`, their
  mappings, as a mount whose pages never come), and syncs of files
  written under a name matching `syncs`, block; `hung` is set once one
  does. Passed to a manager as `backend=`.
  """

  def __init__(self, *, reads: str | None = None, syncs: str | None = None,
               maps: bool = False):
    self.reads, self.syncs, self.maps = reads, syncs, maps
    self.unblock = threading.Event()
    self.hung = threading.Event()

  def block(self) -> None:
    self.hung.set()
    self.unblock.wait()

  def open_ranged(self, path, within):
    f = super().open_ranged(path, within)
    if self.reads is not None and re.search(self.reads, os.fspath(path)):
      return _HangingFile(f, self)
    return f

  def step_writer(self, step_dir, identity, data_dir):
    out = super().step_writer(step_dir, identity, data_dir)
    return out if self.syncs is None else _HangingWriter(out, self)


class _HangingFile(interface.RangedFile):
  """`HangingDisk`'s data file: every read blocks; its mappings block too
  (`maps`), or it maps nothing."""

  def __init__(self, f, disk: HangingDisk):
    self._f, self._disk, self.size = f, disk, f.size

  def read_into(self, offset, out):
    self._disk.block()
    return self._f.read_into(offset, out)

  @contextlib.contextmanager
  def mapped(self, offset, size):
    if not self._disk.maps:
      yield None
      return
    self._disk.block()
    with self._f.mapped(offset, size) as view:
      yield view

  def close(self):
    self._f.close()


class _HangingWriter(interface.StepWriter):
  """`HangingDisk`'s step writer: syncs of files named like `syncs` block."""

  def __init__(self, out, disk: HangingDisk):
    self._out, self._disk = out, disk
    self.positional = out.positional
    self._names: dict[int, str] = {}

  def open(self, name):
    f = self._out.open(name)
    self._names[id(f)] = name
    return f

  def open_direct(self, name):
    return self._out.open_direct(name)

  def mapping(self, f, size):
    return self._out.mapping(f, size)

  def sync(self, f):
    if re.search(self._disk.syncs, self._names.get(id(f), "")):
      self._disk.block()
    self._out.sync(f)

  def close(self):
    self._out.close()
