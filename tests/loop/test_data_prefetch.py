"""Prefetching data loaders and `data_iterator=`: docs/integrations.md's
"Prefetching loaders", run on 2 CPU devices.

`flax.jax_utils.prefetch_to_device` reads ahead of the step, so saving the
state of the iterator under it loses batches on a resume; the page's
`DevicePrefetch` wrapper resumes on exactly the batches of an
uninterrupted run, restored in place (the same object, not re-created).
Grain's own read-ahead (threads, a prefetch buffer) is in its state.
"""

import pathlib
from typing import Any

from flax import jax_utils
import jax
import numpy as np
import pytest

from flax_ckpt_plugin import CheckpointCallback

grain = pytest.importorskip("grain")  # The [grain] extra; CI installs it.

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / (
    "integrations.md")
NUM_BATCHES = 40


def dataset(read_options: Any = None) -> Any:
  """Shuffled batches of 2 (one row per CPU device) of the record indices."""
  return (grain.MapDataset.range(2 * NUM_BATCHES).seed(7).shuffle()
          .batch(2, drop_remainder=True).to_iter_dataset(read_options))


def run_doc_block(workdir: pathlib.Path, num_steps: int) -> dict[str, Any]:
  """Runs the section's code block; its `train_step` records each batch."""
  section = DOC.read_text().split("### Prefetching loaders", 1)[1]
  code = section.split("```python\n", 1)[1].split("```", 1)[0]
  seen = []

  def train_step(state, batch):
    assert batch.sharding.num_devices == 2  # Put on the devices, sharded.
    seen.append(np.asarray(batch).tolist())
    return {"sum": state["sum"] + int(np.sum(seen[-1]))}

  scope = {"workdir": str(workdir), "num_steps": num_steps,
           "dataset": dataset(), "train_step": train_step,
           "state": {"sum": 0}}
  exec(compile(code, "docs/integrations.md", "exec"), scope)  # pylint: disable=exec-used
  scope["seen"] = seen
  return scope


def test_the_wrapper_resumes_on_the_batches_of_an_uninterrupted_run(tmp_path):
  assert jax.local_device_count() == 2
  whole = run_doc_block(tmp_path / "whole", 12)
  assert len(whole["seen"]) == 12

  # Stopped after step 7 (saved 5 and 7) with a batch on the devices that
  # step 8 had not taken yet; run again to 12.
  first = run_doc_block(tmp_path / "resumed", 7)
  assert first["seen"] == whole["seen"][:7]
  assert first["data"].iterator.get_state() == {"next_index": 8}  # Ahead.
  assert first["data"].get_state() == {"next_index": 7}  # What was saved.
  resumed = run_doc_block(tmp_path / "resumed", 12)
  assert resumed["cb"].restored_step == 7
  assert resumed["seen"] == whole["seen"][7:]  # Batch 8 first, none lost.
  assert resumed["state"]["sum"] == whole["state"]["sum"]


def _loop(workdir: pathlib.Path, num_steps: int, data: Any, batches: Any,
          seen: list[Any]) -> CheckpointCallback:
  with CheckpointCallback(workdir, every_steps=5,
                          last_step=num_steps) as cb:
    cb.restore_or_initialize({"step": 0}, data_iterator=data)
    for step in range((cb.restored_step or 0) + 1, num_steps + 1):
      seen.append(np.asarray(next(batches)).tolist())
      cb(step, {"step": step})
  return cb


def test_saving_the_iterator_under_prefetch_to_device_loses_batches(
    tmp_path):
  """What the wrapper prevents: the iterator under the prefetcher is a
  batch ahead at every save, and the resumed run never sees that batch."""
  whole = []
  it = iter(dataset())
  _loop(tmp_path / "whole", 12, it, jax_utils.prefetch_to_device(it, 2),
        whole)

  first, resumed = [], []
  it = iter(dataset())
  _loop(tmp_path / "naive", 7, it, jax_utils.prefetch_to_device(it, 2), first)
  it = iter(dataset())  # Restored to 8 batches read, of which 7 trained.
  cb = _loop(tmp_path / "naive", 12, it, jax_utils.prefetch_to_device(it, 2),
             resumed)
  assert cb.restored_step == 7
  assert first == whole[:7]
  assert resumed[0] == whole[8]  # Batch 8 (whole[7]) is never trained on.
  assert resumed[:4] == whole[8:]


def test_grain_read_ahead_is_in_its_state(tmp_path):
  """Grain's own threads and prefetch buffer: pass the iterator as it is."""
  options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
  whole = []
  _loop(tmp_path / "whole", 12, it := iter(dataset(options)), it, whole)
  first, resumed = [], []
  it = iter(dataset(options))
  _loop(tmp_path / "grain", 7, it, it, first)
  assert it.get_state() == {"next_index": 7}  # Seven taken, more buffered.
  it = iter(dataset(options))
  cb = _loop(tmp_path / "grain", 12, it, it, resumed)
  assert cb.restored_step == 7
  assert first + resumed == whole
