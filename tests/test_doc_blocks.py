"""Every python block of the pages a user reads first runs: README.md,
docs/quickstart.md, loop.md, auto_interval.md, retention.md, restoring.md,
integrations.md, cli.md, converting.md, troubleshooting.md.

A block that a test of its subject runs already (with what it prints) is
listed in `RUN_ELSEWHERE` with that test file, which must name the page.
Every other block runs here, each in a fresh process on 2 CPU devices, after
a prelude that defines what the pages leave to the reader: `workdir`,
`num_steps`, a small Flax `TrainState` (`create_train_state`), a
`train_step`, a data `loader` with a position, a metric `writer`.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/quickstart.md", "docs/loop.md",
         "docs/auto_interval.md", "docs/retention.md", "docs/restoring.md",
         "docs/integrations.md", "docs/cli.md", "docs/converting.md",
         "docs/troubleshooting.md")

# (page, the block's first line) -> the test file that runs it.
RUN_ELSEWHERE = {
    ("docs/quickstart.md", "import sys"): "test_docs.py",
    ("docs/retention.md", "from flax_ckpt_plugin import CheckpointManager, "
     "Retention"): "test_retention.py",
    ("docs/restoring.md", "import jax.numpy as jnp", "import optax"):
        "test_partial_restore.py",
    ("docs/restoring.md", "import jax", "import jax.numpy as jnp",
     "import numpy as np", "from flax_ckpt_plugin import CheckpointManager, "
     "StructureMismatchError"): "test_exporting.py",
    ("docs/restoring.md", "import flax_ckpt_plugin"): "test_exporting.py",
    ("docs/loop.md", "import functools"): "test_pmap.py",
    ("docs/integrations.md", "import collections"): "test_data_prefetch.py",
    ("docs/integrations.md", "from flax_ckpt_plugin import CheckpointManager"):
        "test_orbax_import.py",
    ("docs/cli.md", "import os", "", "import flax.linen as nn", "from "
     "flax.training import train_state", "import jax", "import jax.numpy as"
     " jnp", "import optax", "", "import flax_ckpt_plugin"):
        "test_exporting.py",
    ("docs/converting.md", "import os", "", "import flax.linen as nn",
     "from flax.training import train_state", "import jax", "import jax.numpy"
     " as jnp", "import optax", "import orbax.checkpoint as ocp"):
        "test_orbax_import.py",
}

PRELUDE = '''
import itertools, os, sys
import flax
import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax_ckpt_plugin import CheckpointCallback, CheckpointManager

workdir = os.path.abspath("ckpt")
num_steps = 3
step = 1


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


_X = jnp.ones((4, 8))


def create_train_state():
  model = _MLP()
  params = model.init(jax.random.key(0), _X)
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.adam(1e-3))


create_state = create_train_state
state = create_train_state()


@jax.jit
def _update(state):
  loss, grads = jax.value_and_grad(
      lambda p: jnp.mean(state.apply_fn(p, _X) ** 2))(state.params)
  return state.apply_gradients(grads=grads), loss


def train_step(state, batch=None):
  return _update(state)[0]


class _Loader:
  """A data loader whose position is the number of batches handed out."""

  def __init__(self):
    self.at = 0

  def __next__(self):
    self.at += 1
    return self.at

  next = __next__

  def position(self):
    return {"batches": self.at}

  def restore(self, position):
    self.at = position["batches"]


class _Writer:
  def write_scalars(self, step, scalars):
    print("scalars", step, sorted(scalars))


loader, writer = _Loader(), _Writer()
'''

# What a block needs beyond the prelude (by its page and first line).
SETUP = {
    # The loop that unpacks (state, loss) from its step.
    "README.md": "train_step = lambda s, batch: _update(s)",
    "docs/loop.md:from flax_ckpt_plugin import CheckpointCallback":
        "train_step = lambda s, batch: _update(s)",
    "docs/restoring.md:raw = mngr.restore(None)": (
        "mngr = CheckpointManager(workdir)\n"
        "mngr.save(1, state)\nmngr.wait_until_finished()"),
    # Three steps, one saved without a loss.
    "docs/retention.md:import math": (
        "mngr = CheckpointManager(workdir)\n"
        "for s, loss in ((1, 0.5), (2, 0.25), (3, None)):\n"
        "  mngr.save(s, state, metrics=None if loss is None else"
        " {'loss': loss})\n"
        "mngr.wait_until_finished()"),
    "docs/restoring.md:import jax":
        "with CheckpointManager(workdir) as m:\n  m.save(1, create_state())",
    "docs/integrations.md:import grain": (
        "num_records = 256\n"
        "load_record = lambda i: np.full((8,), i, np.float32)"),
    "docs/integrations.md:from clu import metric_writers, periodic_actions":
        "batches = itertools.repeat(None)",
    "docs/troubleshooting.md:state = train_step(state)  # consumes the old"
    " state": "cb = CheckpointCallback(workdir, every_steps=1)",
}
# What runs after a block: what the page's next lines do with it (a save
# that reaches its hooks and its metric writer), and closing what it left
# open.
_SAVE_AND_CLOSE = ("assert cb(1000, train_step(create_train_state()))\n"
                   "cb.wait_until_finished()\ncb.close()")
EPILOGUE = {
    "docs/restoring.md:raw = mngr.restore(None)": "mngr.close()",
    "docs/retention.md:import math": "mngr.close()",
    "docs/troubleshooting.md:state = train_step(state)  # consumes the old"
    " state": "cb.close()",
    "docs/integrations.md:cb = CheckpointCallback(workdir, every_steps=1000,"
    " metric_writer=writer)": _SAVE_AND_CLOSE,
    "docs/integrations.md:import subprocess": _SAVE_AND_CLOSE,
    "docs/loop.md:import signal": _SAVE_AND_CLOSE,
}
# What a block prints, where the page shows it.
PRINTS = {
    # The save at `last_step` reports the interval `AutoInterval`
    # chose and why, with its own figures.
    "docs/auto_interval.md:from flax_ckpt_plugin import AutoInterval,"
    " CheckpointCallback": ["scalars 3 ['checkpoint/auto_background_secs',"],
    "docs/loop.md:import jax.numpy as jnp": [
        "[2, 3]", "3", "{'epoch': 0}", "2 2.0"],
    "docs/integrations.md:cb = CheckpointCallback(workdir, every_steps=1000,"
    " metric_writer=writer)": ["scalars 1000 ['checkpoint/blocking_secs',"],
    "docs/integrations.md:import subprocess": ["durable: 1000 "],
    "docs/restoring.md:from flax_ckpt_plugin import CheckpointManager":
        ["32.0", "128"],
    "docs/integrations.md:import jax": [
        "bfloat16 P('fsdp',) 768.0"],
    "docs/retention.md:import time": ["[1, 3]"],
    "docs/retention.md:import os": ["['4', '5', '_WRITER']"],
    "docs/retention.md:import math": ["2 {'loss': 0.25}"],
}


def _blocks() -> list[tuple[str, int, str]]:
  out = []
  for page in PAGES:
    text = (REPO / page).read_text()
    for m in re.finditer(r"^```python\n(.*?)^```$", text, re.M | re.S):
      out.append((page, text[:m.start()].count("\n") + 1, m.group(1)))
  return out


def _elsewhere(page: str, code: str) -> str | None:
  lines = code.splitlines()
  for key, test in RUN_ELSEWHERE.items():
    if key[0] == page and tuple(lines[:len(key) - 1]) == key[1:]:
      return test
  return None


def _key(page: str, code: str, table: dict[str, str]) -> str | None:
  first = code.splitlines()[0]
  for key in (f"{page}:{first}", page):
    if key in table:
      return table[key]
  return None


BLOCKS = _blocks()


def test_every_block_is_run_here_or_by_a_test_that_names_its_page():
  assert len(BLOCKS) >= 20, BLOCKS
  for page, line, code in BLOCKS:
    test = _elsewhere(page, code)
    if test is not None:
      found = list(pathlib.Path(__file__).parent.rglob(test))
      assert len(found) == 1, (test, found)
      assert os.path.basename(page) in found[0].read_text(), (
          page, line, test)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page,line,code",
    [b for b in BLOCKS if _elsewhere(b[0], b[2]) is None],
    ids=[f"{p}:{n}" for p, n, c in BLOCKS if _elsewhere(p, c) is None])
def test_the_block_runs(tmp_path, page, line, code):
  script = "\n".join([PRELUDE, _key(page, code, SETUP) or "", code,
                      _key(page, code, EPILOGUE) or ""])
  (tmp_path / "block.py").write_text(script)
  (tmp_path / "eval.py").write_text("")  # What a commit hook launches.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
                 "PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=240,
                        check=False)
  assert proc.returncode == 0, (
      f"{page}:{line} failed:\n{textwrap.indent(code, '  ')}\n"
      f"{proc.stderr[-3000:]}")
  printed = proc.stdout.splitlines()
  for expected in _key(page, code, PRINTS) or []:
    assert any(p.startswith(expected) for p in printed), (expected, printed)
