"""Shared start-up of a multi-process test worker.

A worker is one real JAX process of a multi-controller run. The launcher
(`tests/launcher.py`) passes who it is through the environment:
`PORT` (the coordinator's port on 127.0.0.1), `NUM_PROCESSES` and
`PROCESS_ID`. Each process gets 2 CPU devices, so 2 processes form a 4-device
mesh. A worker reports its results by printing one JSON line last (`emit`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
from typing import Any

# XLA reads its flags when jax first initializes a backend: set them before
# anything imports jax.
os.environ["XLA_FLAGS"] = " ".join(
    ["--xla_force_host_platform_device_count=2"]
    + os.environ.get("WORKER_XLA_FLAGS", "").split())
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

PROCESS_ID = int(os.environ["PROCESS_ID"])
NUM_PROCESSES = int(os.environ["NUM_PROCESSES"])


def init(*, recoverable: bool = False,
         heartbeat_timeout_seconds: int | None = None) -> None:
  """Joins the multi-controller run; call before touching any jax device.

  `recoverable` keeps the survivors of a dead process alive (JAX's
  `jax_enable_recoverability`).
  """
  logging.basicConfig(
      level=logging.INFO, stream=sys.stderr,
      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  # Cross-process device collectives on CPU (the jitted train step and
  # process_allgather) need gloo; the default CPU backend has none.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  extra = {} if heartbeat_timeout_seconds is None else {
      "heartbeat_timeout_seconds": heartbeat_timeout_seconds}
  if os.environ.get("COORDINATOR") == "external":
    # The coordination service runs in a process of its own (the launcher
    # started `flax-ckpt coordinator`): every process is a client only,
    # recoverable (`flax_ckpt_plugin.initialize`).
    import flax_ckpt_plugin  # pylint: disable=g-import-not-at-top
    flax_ckpt_plugin.initialize(
        f"127.0.0.1:{os.environ['PORT']}", NUM_PROCESSES, PROCESS_ID,
        initialization_timeout=60, heartbeat_timeout_seconds=int(
            os.environ["COORDINATOR_HEARTBEAT"]))
    assert jax.process_index() == PROCESS_ID
    assert jax.process_count() == NUM_PROCESSES
    return
  if recoverable:
    jax.config.update("jax_enable_recoverability", True)
  # Short timeouts: a worker whose peer died should fail, not sit for the
  # 5-minute defaults (the launcher's deadline is the last line of defence).
  jax.distributed.initialize(
      f"127.0.0.1:{os.environ['PORT']}", num_processes=NUM_PROCESSES,
      process_id=PROCESS_ID, initialization_timeout=60,
      shutdown_timeout_seconds=30, **extra)
  assert jax.process_index() == PROCESS_ID
  assert jax.process_count() == NUM_PROCESSES


def client():
  """The coordination-service client (for test-only rendezvous)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


def leaf_digests(tree: Any) -> dict[str, str]:
  """sha256 of dtype, shape and bytes of every leaf's full global value.

  Called on every process: gathering a global array is a collective.
  """
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  out = {}
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    else:
      value = np.asarray(leaf)
    h = hashlib.sha256()
    h.update(f"{value.dtype.str}{value.shape}".encode())
    h.update(np.ascontiguousarray(value).tobytes())
    out[jax.tree_util.keystr(keypath)] = h.hexdigest()
  return out


def count_pinned() -> dict[str, int]:
  """Counts the arrays this process copies onto pinned host memory and off
  it (`flax_ckpt_plugin.arrays.copies`) from now on; the dict fills as it runs."""
  from flax_ckpt_plugin.arrays import copies  # pylint: disable=g-import-not-at-top
  import helpers  # pylint: disable=g-import-not-at-top
  seen, copies.copies_onto = helpers.pinned_counter(copies.copies_onto)
  return seen


@functools.lru_cache(maxsize=None)
def _mlp_and_adam(sizes: tuple[int, int, int]) -> tuple[Any, Any]:
  """The model and the optimizer of `mlp_train_state`, made once."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  _, hidden, out = sizes

  class MLP(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(out)(nn.relu(nn.Dense(hidden)(x)))

  return MLP(), optax.adam(1e-2)


def mlp_train_state(rng, sizes: tuple[int, int, int]):
  """The TrainState (Adam) of a 2-layer MLP of (in, hidden, out) sizes.

  Flax names its layers in the order they are made: "Dense_0" is the
  output layer (hidden x out), "Dense_1" the hidden one (in x hidden).
  Every call with the same sizes shares one model and one optimizer: a
  TrainState's `apply_fn` and `tx` are its pytree metadata, and JAX pairs
  two trees (a jit's `out_shardings` with its output, a restore target
  with the state) only when those are the same objects.
  """
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  model, tx = _mlp_and_adam(tuple(sizes))
  params = model.init(rng, jax.numpy.zeros((1, sizes[0])))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=tx)


def die_at(step: int, victim: int, kill_step: int, directory: Any,
           state: Any) -> None:
  """SIGKILLs this process, as a lost machine, if it is `victim` and
  `step` is `kill_step`, writing the time to `directory`/killed_at; once
  (a relaunched victim lives).

  Steps run asynchronously: the victim waits for `state` first, so that it
  dies having finished the steps before `kill_step` (their all-reduces
  done on every process).
  """
  if (PROCESS_ID == victim and step == kill_step
      and not (directory / f"killed_{victim}").exists()):
    import signal  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top
    jax.block_until_ready(state)
    # A test whose processes run a collective of their own after each step
    # (a digest of the whole state) lets the others finish it first.
    time.sleep(float(os.environ.get("DIE_DELAY_SECS", "0")))
    (directory / f"killed_{victim}").touch()
    (directory / "killed_at").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def emit(result: Any) -> None:
  """Prints the worker's result as the last line of stdout."""
  sys.stdout.flush()
  print(json.dumps(result), flush=True)
