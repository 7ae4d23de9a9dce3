"""Every python block of the pages a user reads first runs: README.md,
docs/quickstart.md, loop.md, auto_interval.md, retention.md, restoring.md,
integrations.md, cli.md, converting.md, troubleshooting.md.

A block that a test of its subject runs already (with what it prints) is
listed in `RUN_ELSEWHERE` with that test's node id, and counts as run only
if that test really runs it: its code (and the module's functions and names
it uses) names the page outside a docstring, takes a python block from it,
finds this one (by a heading whose section holds it, by a line of the block,
or as the page's only python block) and runs code (`exec`, or a subprocess).
A file that merely names the page does not count. Every other block runs
here, each in a fresh process on 2 CPU devices, after a prelude that defines
what the pages leave to the reader: `workdir`, `num_steps`, a small Flax
`TrainState` (`create_train_state`), a `train_step`, a data `loader` with a
position, a metric `writer`.
"""

from __future__ import annotations

import ast
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

# (page, the block's first lines) -> the test that runs it (its node id,
# from tests/).
_EXPORTING = "tools/test_exporting.py::"
_ORBAX = "tools/test_orbax_import.py::"
RUN_ELSEWHERE = {
    ("docs/quickstart.md", "import sys"):
        "test_docs.py::"
        "test_quickstart_script_trains_resumes_and_prints_what_the_doc_shows",
    ("docs/retention.md", "from flax_ckpt_plugin import CheckpointManager, "
     "Retention"):
        "manager/test_retention.py::"
        "test_retention_doc_example_and_the_list_it_shows",
    ("docs/restoring.md", "import jax.numpy as jnp", "import optax"):
        "restore/test_partial_restore.py::"
        "test_the_restoring_doc_example_runs_as_shown",
    ("docs/restoring.md", "import jax", "import jax.numpy as jnp",
     "import numpy as np", "from flax_ckpt_plugin import CheckpointManager, "
     "StructureMismatchError"):
        _EXPORTING
        + "test_restoring_md_cast_and_export_blocks_print_what_the_page_shows",
    ("docs/restoring.md", "import flax_ckpt_plugin"):
        _EXPORTING
        + "test_restoring_md_cast_and_export_blocks_print_what_the_page_shows",
    ("docs/loop.md", "import functools"):
        "test_pmap.py::"
        "test_saves_one_copy_and_a_resume_replicates_and_trains_on_exactly",
    ("docs/integrations.md", "import collections"):
        "loop/test_data_prefetch.py::"
        "test_the_wrapper_resumes_on_the_batches_of_an_uninterrupted_run",
    ("docs/integrations.md", "from flax_ckpt_plugin import CheckpointManager"):
        _ORBAX + "test_integrations_md_converts_and_restores",
    ("docs/cli.md", "import os", "", "import flax.linen as nn", "from "
     "flax.training import train_state", "import jax", "import jax.numpy as"
     " jnp", "import optax", "", "import flax_ckpt_plugin"):
        _EXPORTING
        + "test_converting_md_export_commands_print_what_the_page_shows",
    ("docs/converting.md", "import os", "", "import flax.linen as nn",
     "from flax.training import train_state", "import jax", "import jax.numpy"
     " as jnp", "import optax", "import orbax.checkpoint as ocp"):
        _ORBAX + "test_converting_md_commands_print_what_the_page_shows",
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


def _headings(text: str, at: int) -> set[str]:
  """The headings (their words, without the #s) whose sections hold the
  offset `at` of the page `text`, less its title (a heading of every
  block); lines in code fences are not headings."""
  open_: dict[int, str] = {}
  fenced = False
  for line in text[:at].splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced and (m := re.match(r"(#+) (.*)", line)):
      level = len(m.group(1))
      open_ = {k: h for k, h in open_.items() if k < level}
      open_[level] = m.group(2).strip()
  return {h for level, h in open_.items() if level > 1}


def _reach(path: pathlib.Path, name: str) -> list[ast.AST]:
  """Test `name` of the file `path`, and the module-level functions and
  assignments that it names (its fixtures too), and that those name."""
  tree = ast.parse(path.read_text())
  defs: dict[str, ast.AST] = {}
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      defs[node.name] = node
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for target in targets:
        for n in ast.walk(target):
          if isinstance(n, ast.Name):
            defs.setdefault(n.id, node)
  if not isinstance(defs.get(name), ast.FunctionDef):
    return []
  seen: list[ast.AST] = []
  todo = [defs[name]]
  while todo:
    node = todo.pop()
    if any(node is s for s in seen):
      continue
    seen.append(node)
    for n in ast.walk(node):
      used = (n.id if isinstance(n, ast.Name)
              else n.arg if isinstance(n, ast.arg) else None)
      if used in defs:
        todo.append(defs[used])
  return seen


def _why_not_run(test: str, page: str, at: int, code: str) -> str | None:
  """None if the test of node id `test` runs the block `code` (at offset
  `at` of `page`); otherwise what it lacks."""
  file, _, name = test.partition("::")
  path = pathlib.Path(__file__).parent / file
  if not name.startswith("test") or not path.is_file():
    return f"{test} is not a test's node id (file.py::test_name)"
  reach = _reach(path, name)
  if not reach:
    return f"{file} has no test {name}"
  docstrings = {id(n.value) for r in reach for n in ast.walk(r)
                if isinstance(n, ast.Expr) and isinstance(n.value,
                                                          ast.Constant)}
  strings = [n.value for r in reach for n in ast.walk(r)
             if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and id(n) not in docstrings]
  called = {n.func.id if isinstance(n.func, ast.Name) else
            f"{getattr(n.func.value, 'id', '')}.{n.func.attr}"
            for r in reach for n in ast.walk(r) if isinstance(n, ast.Call)
            and isinstance(n.func, (ast.Name, ast.Attribute))}
  text = (REPO / page).read_text()
  if not any(os.path.basename(page) in s for s in strings):
    return f"{test} does not name {page} (outside docstrings)"
  if not (any("```python" in s for s in strings)
          or ("doc_blocks" in called and "python" in strings)):
    return f"{test} takes no python block of a page"
  headings = _headings(text, at)
  if not (len(re.findall(r"^```python$", text, re.M)) == 1
          or any(s.lstrip("#").strip() in headings for s in strings)
          or any(len(s) >= 10 and s in code for s in strings)):
    return (f"{test} names none of the headings over the block "
            f"({sorted(headings)}) nor a line of it")
  if not called & {"exec", "subprocess.run", "subprocess.Popen"}:
    return f"{test} runs no code (exec, or a subprocess)"
  return None


def test_every_block_is_run_here_or_by_a_test_that_runs_it():
  assert len(BLOCKS) >= 20, BLOCKS
  for page, line, code in BLOCKS:
    test = _elsewhere(page, code)
    if test is not None:
      text = (REPO / page).read_text()
      at = sum(len(l) + 1 for l in text.splitlines()[:line - 1])
      why = _why_not_run(test, page, at, code)
      assert why is None, f"{page}:{line}: {why}"


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
