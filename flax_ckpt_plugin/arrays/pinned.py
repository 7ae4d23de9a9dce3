"""Pinned host memory: how accelerator shards travel to and from the host.

A copy between an accelerator and host memory that the runtime has pinned
(page-locked) runs at the link's speed, and its call returns at once.
Measured on an NVIDIA H100 with 3.2 GB of state: device to pinned host 52
GB/s, the call 0.3-0.5 ms, against 1.8 GB/s into pageable memory (which
`np.asarray` waits for); host to device 50 GB/s from pinned memory, 7.7 GB/s
from a numpy array. So:

* A snapshot copies each shard it writes from an accelerator onto its
  device's `pinned_host` memory, all in one batched call (`PinnedStaging.
  copy`), and does not wait: the writer waits for each shard just before it
  checksums and writes it, reading the pinned buffer through a zero-copy
  view (`leaves.ShardData.host`). A step that donates the state right
  after the call does not tear the copy: the runtime orders the donation
  after the transfer (checked bit for bit on the H100).
* A restore reads file bytes into pinned buffers and moves them to the
  device from there (`RestoreWindow`), the next reads overlapping the
  transfers; a buffer is read into again for the next region of its shape.
  A restore of the step this process saved last, whose snapshot it still
  holds (`backends.held`), sends the snapshot's pinned buffers to the
  devices as they are, their bytes checked first: no window, no host copy.

Pinned memory is slow to get, scarce, and on TPU reported never to be given
back, so it is used with care:

* Every pinned buffer comes from the runtime's pool, which keeps what is
  freed and hands it out again: on the H100 the first 3.2 GB copy's call
  took 1.6 s (the memory is pinned then, about 0.5 s per GB), later ones
  0.4 ms, with RSS flat. A snapshot's buffers go back to the pool when its
  commit ends, and the next save waits for that commit anyway.
* `PinnedStaging.reserve` has a thread pin one buffer per piece the saves
  copy, while the train loop runs, and a save gives the ready ones back to
  the pool right before its copies take them; a piece whose memory is not
  pinned yet is copied on its device instead, so no save call waits for
  pinning, the first included. Pinning holds up the process's other
  device work (measured on the H100: train steps took 50 times longer
  while 3.2 GB were pinned at once on a background thread), so the thread
  pins one piece at a time and rests as long after each. The callback
  starts it in `restore_or_initialize` (or at its first call). The cost:
  that much host memory pinned by the runtime for the life of the process.
* A save pins at most `budget` bytes (default: all it writes); shards past
  it take the plain transfer, which the save call waits for.
* When the runtime cannot give pinned memory (a copy raises), that save
  copies on the devices, and so do the next few (1, then 2, 4, up to
  `MAX_BACK_OFF` saves after refusals in a row) before a save asks again:
  memory that was short at one moment (another allocation, a restore's
  window) is often there later. Each such save logs a warning with the
  bytes asked for and counts them in `SaveStats.pinned_fallback_bytes`. A
  restore whose window is refused reads the rest of its leaves the plain
  way; it changes nothing for the saves.
* Every wait here has a deadline (`wait_ready` for the runtime's
  transfers, `FILL_WAIT_SECS` for room in a restore's window) that ends in
  an error naming what was waited for, never a hang.

The CPU backend has a `pinned_host` memory kind too. CPU devices take this
path only when the environment sets `FLAX_CKPT_PLUGIN_PINNED_CPU=1`: the
test suite's switch, so that the accelerator path runs on any machine.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import numpy as np

from flax_ckpt_plugin.arrays.copies import bits_dtype
from flax_ckpt_plugin.deadlines import DEADLINES
from flax_ckpt_plugin.deadlines import NoAnswer

PINNED = "pinned_host"
CPU_SWITCH = "FLAX_CKPT_PLUGIN_PINNED_CPU"

# The longest a copy between a device and host memory is waited for (here
# and by the writer, `leaves.ShardData.host`). Far longer than any copy
# takes (a 13 GB state crosses the slowest path, pageable host memory at
# 1.8 GB/s, in 7 s): a wait this long is a runtime that hangs, and the
# waiting thread gets an error instead of hanging too.
TRANSFER_WAIT_SECS = 300.0

def _cpu_switch() -> bool:
  return os.environ.get(CPU_SWITCH) == "1"


@functools.lru_cache(maxsize=None)
def _has_pinned(device: Any) -> bool:
  try:
    return any(m.kind == PINNED for m in device.addressable_memories())
  except Exception:  # pylint: disable=broad-except
    return False  # A runtime without memory kinds.


def takes(device: Any) -> bool:
  """Whether shards on `device` travel through pinned host memory (where
  the runtime gives it: see `PinnedStaging.copy`, `RestoreWindow.take`)."""
  if device.platform == "cpu" and not _cpu_switch():
    return False
  return _has_pinned(device)


def fits(dtype: Any) -> bool:
  """Whether values of `dtype` can be read through a view of their buffer.

  Sub-byte types (int4, float4) are packed on the device: they take the
  plain transfer, which unpacks them.
  """
  return (bits_dtype(dtype) is not None
          or np.issubdtype(np.dtype(dtype), np.complexfloating))


def wait_ready(arrays: list[Any], what: str | Callable[[], str],
               secs: float | None = None) -> None:
  """Waits until every array is ready (its copy or program done), raising
  the runtime's error of one that failed.

  Arrays already ready cost a look each (0.2 us); a wait is made on a
  helper thread (`deadlines`), abandoned after `secs` (default
  `TRANSFER_WAIT_SECS`).

  Args:
    arrays: jax arrays (or objects with `block_until_ready`).
    what: what they are, for the error (or a callable that says it, so
      that a wait that ends at once formats nothing).
    secs: the deadline.

  Raises:
    TimeoutError: not ready after `secs`; names `what` was waited for.
  """
  pending = [a for a in arrays
             if not getattr(a, "is_ready", lambda: False)()]
  if pending:
    secs = TRANSFER_WAIT_SECS if secs is None else secs
    try:
      DEADLINES.call(lambda: [a.block_until_ready() for a in pending], secs)
    except NoAnswer:
      raise TimeoutError(
          f"{what if isinstance(what, str) else what()}: {len(pending)}"
          f" array(s) not ready after {secs:g} s; the runtime's copies do"
          " not finish") from None
  for a in arrays:  # Ready ones return at once; a failed one raises.
    a.block_until_ready()


@functools.lru_cache(maxsize=None)
def sharding_on(device: Any, kind: str = PINNED) -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def pinned_buffer(shape: tuple[int, ...], dtype: np.dtype, device: Any
                  ) -> jax.Array:
  """A new buffer of pinned host memory on `device`, ready to be written
  (its contents undefined); raises where the runtime refuses it."""
  buf = jax.device_put(np.empty(shape, dtype), sharding_on(device))
  wait_ready([buf], f"a pinned buffer of {buf.nbytes} bytes on {device}")
  return buf
