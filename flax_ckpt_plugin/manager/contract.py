"""What the layers above ask of a manager: the `Manager` protocol.

The modules of `tolerance/` (the local tier, the survivors, the relaunched
process, the tiered restore) are handed a `CheckpointManager` by the tiers
(`loop.tiers`) and use only what this protocol lists: its attributes, its
step list, its restores and its save. They name this protocol rather than
the class, so that they stand beside the manager, not above the whole of
it and of restore: a module of `tolerance/` imports neither
`manager.manager` nor `restore/` for a type. `CheckpointManager` has every
member here with the same signature (tests/manager/test_contract.py);
the docstrings are the class's (see docs/api.md).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from etils import epath

from flax_ckpt_plugin.backends.interface import Backend
from flax_ckpt_plugin.format.datastate import DataIterator
from flax_ckpt_plugin.multihost.coordinator import Coordinator
from flax_ckpt_plugin.stats import StepMetadata


class Manager(Protocol):
  """A `CheckpointManager` as the tolerance layer uses it."""

  directory: epath.Path
  backend: Backend
  coordinator: Coordinator
  primary_host: int
  is_primary: bool
  atomicity: str
  barrier_timeout_ms: int
  name: str
  check_still_writer: Callable[..., None] | None

  def all_steps(self) -> list[int]:
    ...

  def latest_step(self) -> int | None:
    ...

  def metadata(self, step: int | None = None) -> StepMetadata:
    ...

  def save(self, step: int, state: Any, *, extra: Any = None,
           metrics: dict[str, Any] | None = None,
           data_state: Any = None,
           partner_shards: Callable[[], dict[str, list[Any]]] | None = None
           ) -> None:
    ...

  def wait_until_finished(self, timeout: float | None = None, *,
                          deletes: bool = True) -> bool:
    ...

  def read_step(self, step: int, fn: Callable[[Backend], Any]) -> Any:
    ...

  def restore(self, target: Any, step: int | None = None, *,
              verify: bool = True,
              data_iterator: DataIterator | None = None,
              partial: bool = False, missing: str = "error",
              cast: bool = False, rename: Any = None) -> Any:
    ...

  def restore_together(self, target: Any, step: int | None = None, *,
                       verify: bool = True,
                       data_iterator: DataIterator | None = None,
                       cast: bool = False, rename: Any = None) -> Any:
    ...

  def restore_newest_valid(self, target: Any, *, verify: bool = True,
                           data_iterator: DataIterator | None = None,
                           cast: bool = False, rename: Any = None
                           ) -> tuple[int, Any] | None:
    ...

  def discard(self, steps: list[int]) -> None:
    ...

  def set_aside(self, steps: list[int]) -> None:
    ...

  def regroup(self, coordinator: Any, wait_secs: float, *, tag: str,
              primary_host: int) -> None:
    ...
