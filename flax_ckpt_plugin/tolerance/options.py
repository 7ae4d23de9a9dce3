"""The options of fault tolerance and of the local tier, as one typed record
(and, deprecated for one release, the options of `every_steps="auto"`, now
`loop.interval.AutoInterval`'s).

`CheckpointCallback(tolerance=FaultTolerance(...))`: what the callback does
when a preemption notice arrives or a process is lost, and the per-host
local tier that a loss and a fast restore draw on.
"""

from __future__ import annotations

import dataclasses
import signal
import warnings
from typing import Iterable

from etils import epath

from flax_ckpt_plugin import errors


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
  """Preemption, lost processes, and the local tier.

  Attributes:
    save_on_preemption: save and stop when a preemption notice arrives.
    preemption_signals: the signals that are preemption notices.
    watch_peers: notice a lost process at once (see
      docs/fault_tolerance.md): a thread polls the live processes, and
      once a peer died or restarted, every call of the callback and every
      wait of its saves raises `PeerLostError` instead of waiting for it. Default: on with several
      processes when `jax_enable_recoverability` is set (without it, JAX
      itself ends every process when one dies).
    watch_poll_secs: the period of those polls; in a job of more than 200
      processes it grows so that the job's watchers call the coordination
      service at most 800 times a second in all (7.68 s at 4,096
      processes, see docs/control_plane.md).
    elastic: after a lost process, the loop goes on without it: it catches
      the loss and calls `recover` (see `elastic`), instead of the
      survivors saving and exiting for a relaunch. Needs a local tier.
    elastic_wait_secs: how long after a loss the survivors wait for the
      loop to call `recover` before they save and exit anyway (set it
      above `--xla_cpu_collective_timeout_seconds`: the loop may be stuck
      that long in a collective with the dead process).
    local_directory: a per-host path (a local SSD, or `/dev/shm`) for the
      local tier: every `local_every_steps` steps
      each process also saves there every shard it holds, apart from the
      other processes and from the persistent tier's schedule, keeping the
      newest 2 steps. A restore then takes the newest step from the fastest tier
      that has it (see `CheckpointCallback.restored_tier`). The path must
      belong to this job. A failure of the local tier is logged, never
      raised (see docs/fault_tolerance.md).
    local_every_steps: the local tier's interval, in steps (an int:
      `AutoInterval` sets the persistent tier's interval only).
    replicas: partner copies (see docs/fault_tolerance.md): at each local-tier
      save, every shard that fewer than `replicas + 1` processes hold
      (with FSDP or tensor parallelism across hosts: every shard) is also
      saved in the local tiers of partner processes, so that a lost
      process's shards survive `replicas` losses: the survivors' save,
      `elastic` recovery and a relaunch after a lost disk restore them
      from the partners. Costs, per process, `replicas` times its unique
      share of the state in bytes sent and in local storage, and as much
      device memory until the copies reach the host. Needs a local tier
      and at least `replicas + 1` processes.
    failure_domain: this process's failure domain (e.g. a rack or a
      slice); partners sit in other domains where any exist. Default: the
      host's name, so that partners are on other hosts. Shared through
      the coordination service when the tiers open.
    mtbf_secs: deprecated (warns; goes away in the next release):
      `CheckpointCallback(every_steps=AutoInterval(mtbf_secs=...))`, with
      `every_steps="auto"`.
    min_every_steps: deprecated, as `mtbf_secs`:
      `AutoInterval(min_every_steps=)`.
    max_every_steps: deprecated, as `mtbf_secs`:
      `AutoInterval(max_every_steps=)`.
  """
  save_on_preemption: bool = True
  preemption_signals: Iterable[int] = (signal.SIGTERM,)
  watch_peers: bool | None = None
  watch_poll_secs: float = 0.5
  elastic: bool = False
  elastic_wait_secs: float = 120.0
  local_directory: epath.PathLike | None = None
  local_every_steps: int | None = None
  replicas: int = 0
  failure_domain: str | None = None
  mtbf_secs: float | None = None
  min_every_steps: int | None = None
  max_every_steps: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "preemption_signals",
                       tuple(self.preemption_signals))
    if (self.local_directory is None) != (self.local_every_steps is None):
      raise ValueError(
          "local_directory and local_every_steps go together; got"
          f" {self.local_directory!r} and {self.local_every_steps!r}")
    if self.local_every_steps == "auto":
      raise ValueError(
          'local_every_steps="auto" is not offered: the interval that'
          " loses least depends on the rate of the failures a tier"
          " restores from, and the local tier's differ from the persistent"
          " tier's (AutoInterval(mtbf_secs=) is theirs: see every_steps="
          "AutoInterval(...) of the callback); give the local tier an int")
    if self.local_every_steps is not None:
      errors.check_count("local_every_steps", self.local_every_steps)
    errors.check_count("replicas", self.replicas, minimum=0)
    if self.replicas and self.local_directory is None:
      raise ValueError("replicas (partner copies) live in the local tier:"
                       " set local_directory and local_every_steps too")
    if self.failure_domain is not None and not (
        isinstance(self.failure_domain, str) and self.failure_domain):
      raise ValueError("failure_domain must be a non-empty str, got"
                       f" {self.failure_domain!r}")
    self._check_auto_interval()
    for name in ("watch_poll_secs", "elastic_wait_secs"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

  def _check_auto_interval(self) -> None:
    """The deprecated options of `every_steps="auto"`: checked as
    `AutoInterval` checks them (whose module sits above this one), with a
    `DeprecationWarning` that names the new form."""
    given = {name: getattr(self, name) for name in (
        "mtbf_secs", "min_every_steps", "max_every_steps")
             if getattr(self, name) is not None}
    if not given:
      return
    if self.mtbf_secs is not None:
      errors.check_secs("mtbf_secs", self.mtbf_secs)
    for name in ("min_every_steps", "max_every_steps"):
      if getattr(self, name) is not None:
        errors.check_count(name, getattr(self, name))
    errors.check_at_most("min_every_steps", self.min_every_steps,
                         "max_every_steps", self.max_every_steps)
    args = ", ".join(f"{k}={v!r}" for k, v in given.items())
    warnings.warn(
        f"FaultTolerance({args}) is deprecated and goes away in the next"
        " release: the interval's options belong to its schedule; pass"
        f" CheckpointCallback(every_steps=AutoInterval({args})), i.e."
        " every_steps=AutoInterval(mtbf_secs=...), instead",
        DeprecationWarning, stacklevel=4)
