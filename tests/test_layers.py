"""The package's layers (pyproject.toml, `[tool.importlinter]`): every
import inside the package goes down the layers, never up or sideways, and
no modules import each other in a circle. import-linter checks it from the
source's imports, without running the code."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "flax_ckpt_plugin"
LAYERS = "flax_ckpt_plugin's layers import only downward"
CIRCLES = "No modules of flax_ckpt_plugin import each other in a circle"


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
  """import-linter's check of the package under `root`, with the contracts
  of `root`/pyproject.toml."""
  return subprocess.run(
      [sys.executable, "-c", "import sys; from importlinter.cli import"
       " lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"],
      cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
      capture_output=True, text=True, timeout=120, check=False)


def test_every_import_goes_down_the_layers():
  result = _lint(REPO)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f"{LAYERS} KEPT" in result.stdout
  assert f"{CIRCLES} KEPT" in result.stdout


@pytest.mark.parametrize("module,line,broken", [
    # Up: the format's records would import the callback at the top.
    ("format/records.py", "from flax_ckpt_plugin.loop import callback",
     LAYERS),
    # Up, for an annotation alone: counted all the same.
    ("format/records.py", "if TYPE_CHECKING:\n  from flax_ckpt_plugin.save"
     " import snapshot", LAYERS),
    # Sideways: a restore reads nothing of the save's code.
    ("restore/reader.py", "from flax_ckpt_plugin.save import writer",
     LAYERS),
    # Sideways: the tools and fault tolerance stand side by side.
    ("tools/inventory.py", "from flax_ckpt_plugin.tolerance import peer",
     LAYERS),
    # A circle inside one layer: the snapshot imports the staging.
    ("save/staging.py", "from flax_ckpt_plugin.save import snapshot",
     CIRCLES),
])
def test_an_import_against_the_layers_fails_the_check(tmp_path, module, line,
                                                      broken):
  """A copy of the package with one import added against the layers."""
  shutil.copytree(PACKAGE, tmp_path / "flax_ckpt_plugin",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(REPO / "pyproject.toml", tmp_path)
  with open(tmp_path / "flax_ckpt_plugin" / module, "a") as f:
    f.write(f"\n{line}  # Against the layers.\n")
  result = _lint(tmp_path)
  assert result.returncode == 1, result.stdout + result.stderr
  assert f"{broken} BROKEN" in result.stdout, result.stdout
  assert pathlib.PurePath(module).stem in result.stdout, result.stdout
