"""Preemption notices: signals turned into "save now and stop" at one step.

With `jax.distributed`, JAX's preemption notifier catches SIGTERM and
`Coordinator.reached_preemption_sync_point(step)` turns true on every process at
the same step. Without it, a single process needs its own handler: this
module's `SignalFlag` only sets a flag (so it is safe at any instant), and the
next callback call saves and stops.

Schedulers send different signals: SIGTERM (Kubernetes, GCE, SLURM at the time
limit), or whatever SLURM's `--signal=USR1@90` names. With several processes
only SIGTERM reaches JAX's notifier, so other configured signals are passed on
to this process as SIGTERM, and the notifier propagates them to every host.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Iterable

from flax_ckpt_plugin.logs import log


class SignalFlag:
  """Installs handlers for `signals` that set a flag, chained to the old ones.

  The previous Python handler of each signal still runs (after the flag is
  set); the default action (terminate) does not, since the point is to save
  first. `uninstall()` puts the previous handlers back.

  Args:
    signals: the preemption signals.
    forward: the runtime's notifier catches SIGTERM and tells every process
      (`Coordinator.preemption_notifier_installed()`): SIGTERM is left to it,
      and the other signals are passed on to it as SIGTERM.
  """

  def __init__(self, signals: Iterable[int | signal.Signals], *,
               forward: bool = False):
    self.signals = tuple(signal.Signals(s) for s in signals)
    self._previous: dict[signal.Signals, object] = {}
    self.received: signal.Signals | None = None
    self._forward = forward

  def install(self) -> bool:
    """Installs the handlers; False (and nothing done) off the main thread."""
    if threading.current_thread() is not threading.main_thread():
      log.warning("preemption signal handlers can only be installed from the"
                  " main thread; signals %s will not trigger a checkpoint",
                  [s.name for s in self.signals])
      return False
    for sig in self.signals:
      if self._forward and sig == signal.SIGTERM:
        continue  # JAX's notifier already handles it on every process.
      self._previous[sig] = signal.signal(sig, self._handle)
    return True

  def _handle(self, signum, frame) -> None:
    sig = signal.Signals(signum)
    self.received = sig
    if self._forward:
      # Hand the notice to JAX's notifier, which tells every process.
      os.kill(os.getpid(), signal.SIGTERM)
    previous = self._previous.get(sig)
    if callable(previous):
      previous(signum, frame)

  @property
  def triggered(self) -> bool:
    """True once a signal arrived (single-process use)."""
    return self.received is not None and not self._forward

  def uninstall(self) -> None:
    """Restores the handlers that were installed before."""
    if threading.current_thread() is not threading.main_thread():
      return
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous.clear()
