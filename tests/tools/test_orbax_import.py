"""`flax-ckpt import-orbax` (importer), tested as a user runs it.

Orbax itself writes the checkpoints, the way its documentation shows
(`CheckpointManager` with `StandardSave`, `StandardCheckpointer`,
`PyTreeCheckpointer`, named items), for a linen `TrainState` (Adam, a few
steps trained, one of them sharded over the two CPU devices) and an NNX
model and optimizer. The CLI converts them in a subprocess
(`python -m flax_ckpt_plugin import-orbax`, one of them with a single
device) or in this process (`cli.main`); our `CheckpointManager` restores
the step into the user's own target, compared bit for bit. The errors, the
Orbax source left untouched, Orbax imported by this command alone, and the
commands of docs/converting.md and docs/integrations.md, and docs/cli.md's
`--help`, are checked too.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import subprocess
import sys

from etils import epath
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from conftest import create_state
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.tools import importer
from helpers import doc_blocks
from helpers import doc_section
from helpers import run_console
from helpers import two_device_mesh
from launcher import run_workers

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent  # Where `flax-ckpt` is installed.
KERNEL = "params/params/Dense_0/kernel"


def run_process(*args, cwd=None, one_device: bool = False
                ) -> subprocess.CompletedProcess:
  """`python -m flax_ckpt_plugin ARGS` in a new interpreter."""
  env = dict(os.environ)
  if one_device:  # Not the two devices that conftest gives this process.
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+",
                              "", env.get("XLA_FLAGS", "")).strip()
  return subprocess.run(
      [sys.executable, "-m", "flax_ckpt_plugin", *map(str, args)], cwd=cwd,
      env=env, capture_output=True, text=True, timeout=300, check=False)


def trained(train_step, steps: int = 3, seed: int = 0):
  """A TrainState after `steps` jitted Adam steps (its step an int32)."""
  state = create_state(seed)
  for _ in range(steps):
    state = train_step(state)
  return state


def orbax_manager_save(directory: pathlib.Path, step: int, state) -> None:
  """Orbax's `CheckpointManager` with `StandardSave`, as its docs show."""
  with ocp.CheckpointManager(directory.absolute()) as mngr:
    mngr.save(step, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()


def standard_save(path: pathlib.Path, tree) -> None:
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path.absolute(), tree)


def files_of(directory: pathlib.Path) -> dict[str, tuple[int, int, str]]:
  """Every file under `directory`: size, mtime and digest, by relative path."""
  return {str(f.relative_to(directory)): (
      f.stat().st_size, f.stat().st_mtime_ns,
      hashlib.sha256(f.read_bytes()).hexdigest())
          for f in sorted(directory.rglob("*")) if f.is_file()}


def restore(directory: pathlib.Path, target, step=None):
  with CheckpointManager(directory, read_only=True) as mgr:
    return mgr.restore(target, step)


# -- a TrainState, converted by the CLI and restored into the user's own ------


@pytest.mark.multiprocess
def test_cli_converts_a_train_state_that_orbax_saved(
    tmp_path, train_step, host_copy, assert_trees_equal, run):
  state = trained(train_step, steps=3)
  expected = host_copy(state)
  orbax_manager_save(tmp_path / "orbax", 3, state)
  source = tmp_path / "orbax" / "3"
  before = files_of(tmp_path / "orbax")
  dest = tmp_path / "ours"

  r = run_process("import-orbax", source, dest)
  assert r.returncode == 0, r.stderr
  assert r.stderr == ""  # Neither Orbax's logs nor warnings.
  lines = r.stdout.splitlines()
  assert lines[0] == (f"imported {source} (Orbax item 'default') as step 3"
                      f" of {dest}")
  assert lines[1] == f"step dir:  {dest}/3 (finalized, with crc32c checksums)"
  assert lines[2] == "size:      2.5 KiB of array data (2552 bytes)"
  assert lines[3] == "leaves:    14"
  assert re.search(r"^  step\s+int32\[\] = 3\s+4 B$", r.stdout, re.M)
  assert re.search(r"^  opt_state/0/count\s+int32\[\] = 3\s+4 B$", r.stdout,
                   re.M)
  assert re.search(rf"^  {KERNEL}\s+float32\[8,16\]\s+512 B$", r.stdout, re.M)
  assert len(lines) == 4 + 1 + 14

  # The user's own TrainState (another seed, trained too): every leaf, the
  # step and Adam's state included, bit for bit.
  restored = restore(dest, trained(train_step, steps=1, seed=1))
  assert_trees_equal(restored, expected)
  assert int(restored.step) == 3 and int(restored.opt_state[0].count) == 3
  assert run("verify", dest, "-q").returncode == 0
  assert (dest / "3" / "_COMMITTED").is_file()
  assert files_of(tmp_path / "orbax") == before  # Only read.


def test_python_scalars_numpy_leaves_and_the_pytree_checkpointer(
    tmp_path, host_copy, assert_trees_equal):
  """Orbax records a Python scalar as int64/float64/bool and restores it as
  a Python scalar: it stays one (a fresh TrainState's step is a Python int);
  other scalar dtypes, numpy arrays and bfloat16 keep their dtype."""
  state = create_state()  # Untrained: step is the Python int 0.
  tree = {"state": state, "lr": np.float32(0.5), "flag": True, "n": 7,
          "scale": 2.5, "ids": np.arange(5, dtype=np.int16),
          "half": jnp.linspace(0, 1, 6, dtype=jnp.bfloat16)}
  expected = host_copy(tree)
  ocp.PyTreeCheckpointer().save((tmp_path / "checkpoint_7").absolute(), tree)

  result = importer.import_orbax(tmp_path / "checkpoint_7",
                                     tmp_path / "ours")
  assert (result.source.step, result.source.item) == (7, None)
  assert result.leaves == 20
  assert os.fspath(result.path) == os.fspath(tmp_path / "ours" / "7")
  leaves = {leaf.path: leaf for leaf in manifest_lib.read(result.path, 7).leaves}
  assert (leaves["state/step"].kind, leaves["state/step"].value) == ("int", 0)
  assert (leaves["n"].kind, leaves["flag"].kind, leaves["scale"].kind) == (
      "int", "bool", "float")
  assert (leaves["lr"].kind, str(leaves["lr"].dtype), leaves["lr"].shape) == (
      "numpy", "float32", ())
  assert (leaves["ids"].kind, str(leaves["ids"].dtype)) == ("numpy", "int16")
  assert (leaves["half"].kind, str(leaves["half"].dtype)) == ("array",
                                                              "bfloat16")

  target = dict(tree, state=create_state(seed=1))
  restored = restore(tmp_path / "ours", target)
  assert type(restored["state"].step) is int
  assert_trees_equal(restored, expected)


def test_checkpoint_manager_items(tmp_path, train_step, host_copy,
                                  assert_trees_equal, run):
  """A step with named items: the one PyTree item, or --item among several."""
  state = trained(train_step, steps=2)
  expected = host_copy(state)
  with ocp.CheckpointManager((tmp_path / "one").absolute(),
                             item_names=("state", "meta")) as mngr:
    mngr.save(2, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave({"epoch": 1})))
  with ocp.CheckpointManager((tmp_path / "two").absolute(),
                             item_names=("params", "opt")) as mngr:
    mngr.save(5, args=ocp.args.Composite(
        params=ocp.args.StandardSave({"params": state.params}),
        opt=ocp.args.StandardSave({"opt_state": state.opt_state})))

  r = run("import-orbax", tmp_path / "one" / "2", tmp_path / "ours")
  assert r.returncode == 0, r.stderr
  assert "(Orbax item 'state') as step 2" in r.stdout
  assert_trees_equal(restore(tmp_path / "ours", state), expected)

  r = run("import-orbax", tmp_path / "two" / "5", tmp_path / "ours")
  assert (r.returncode, r.stdout) == (2, "")
  assert r.stderr == (f"flax-ckpt import-orbax: {tmp_path}/two/5 holds several"
                      " PyTree items ['opt', 'params']: choose one with"
                      " --item\n")
  r = run("import-orbax", tmp_path / "two" / "5", tmp_path / "ours",
          "--item", "opt", "--json")
  assert r.returncode == 0, r.stderr
  assert '"item": "opt"' in r.stdout and '"leaf_count": 9' in r.stdout
  # An item directory itself; its step number is its parent's.
  r = run("import-orbax", tmp_path / "two" / "5" / "params",
          tmp_path / "params")
  assert r.returncode == 0, r.stderr
  restored = restore(tmp_path / "ours", {"opt_state": state.opt_state}, 5)
  assert_trees_equal(restored, {"opt_state": expected.opt_state})
  restored = restore(tmp_path / "params", {"params": state.params}, 5)
  assert_trees_equal(restored, {"params": expected.params})


# -- a sharded TrainState; NNX --------------------------------------------------


@pytest.mark.multiprocess
def test_sharded_train_state_converted_by_a_process_without_that_mesh(
    tmp_path, train_step, host_copy, assert_trees_equal):
  mesh = two_device_mesh()

  def spec(x):  # Kernels split over 'x' by their columns; the rest copied.
    return P(None, "x") if x.ndim == 2 else P()

  state = trained(train_step, steps=2)
  sharded = jax.device_put(
      state, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), state))
  kernel = sharded.params["params"]["Dense_0"]["kernel"]
  assert len(kernel.addressable_shards) == 2
  assert kernel.addressable_shards[0].data.shape == (8, 8)
  expected = host_copy(sharded)
  standard_save(tmp_path / "orbax" / "2", sharded)

  # A process with one device converts what two devices saved.
  r = run_process("import-orbax", tmp_path / "orbax" / "2", tmp_path / "ours",
                  one_device=True)
  assert r.returncode == 0, r.stderr
  assert "leaves:    14" in r.stdout

  # Restored into a sharded target of the same mesh, bit for bit.
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      sharded)
  restored = restore(tmp_path / "ours", target)
  assert_trees_equal(restored, expected)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(sharded)):
    assert got.sharding == want.sharding


def _leaf_path(keypath) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k)))
                  for k in keypath)


@pytest.mark.multiprocess
def test_a_step_that_two_processes_saved(tmp_path, run):
  """Orbax's 2-process save (each process its own OCDBT database, merged by
  process 0) converts leaf for leaf, its sharded kernels whole."""
  (worker,) = run_workers("orbax_save", 2, args=[str(tmp_path / "orbax")],
                          timeout=240)[:1]
  saved = worker.json
  assert "params/Dense_0/kernel" in saved["sharded"]
  r = run("import-orbax", tmp_path / "orbax" / "2", tmp_path / "ours")
  assert r.returncode == 0, r.stderr
  with CheckpointManager(tmp_path / "ours", read_only=True) as mgr:
    restored = mgr.restore(None)
  digests = {}
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
    value = np.asarray(leaf)
    h = hashlib.sha256(f"{value.dtype.str}{value.shape}".encode())
    h.update(np.ascontiguousarray(value).tobytes())
    digests[_leaf_path(keypath)] = h.hexdigest()
  assert digests == saved["digests"]


class _Net(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(8, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(nnx.relu(self.bn(self.linear(x)))))


def test_nnx_model_and_optimizer_state(tmp_path, host_copy,
                                       assert_trees_equal):
  def create(seed):
    model = _Net(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)

  model, optimizer = create(0)
  for _ in range(2):
    step(model, optimizer, jnp.ones((4, 8)))
  saved = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
  expected = host_copy(saved)
  standard_save(tmp_path / "orbax" / "2", saved)

  importer.import_orbax(tmp_path / "orbax" / "2", tmp_path / "ours")
  manifest = manifest_lib.read(epath.Path(tmp_path / "ours" / "2"), 2)
  impls = {leaf.path: leaf.key_impl for leaf in manifest.leaves
           if leaf.key_impl is not None}
  assert impls == {"model/dropout/rngs/key/value": "threefry2x32"}

  fresh_model, fresh_optimizer = create(1)
  restored = restore(tmp_path / "ours", {
      "model": nnx.state(fresh_model),
      "optimizer": nnx.state(fresh_optimizer)})
  assert_trees_equal(restored, expected)
  nnx.update(fresh_model, restored["model"])
  assert int(restored["optimizer"]["step"][...]) == 2


# -- errors ----------------------------------------------------------------------


@pytest.fixture
def orbax_step(tmp_path_factory, train_step) -> pathlib.Path:
  directory = tmp_path_factory.mktemp("orbax") / "ckpts"
  orbax_manager_save(directory, 4, trained(train_step, steps=1))
  return directory / "4"


def test_a_step_that_exists_is_refused_and_nothing_is_written(orbax_step,
                                                              tmp_path, run):
  dest = tmp_path / "ours"
  assert run("import-orbax", orbax_step, dest).returncode == 0
  before = files_of(dest)
  r = run("import-orbax", orbax_step, dest)
  assert (r.returncode, r.stdout) == (5, "")
  assert r.stderr == (f"flax-ckpt import-orbax: step 4 is already finalized"
                      f" in {dest}: nothing was written (give another --step,"
                      " or delete that step first)\n")
  assert files_of(dest) == before  # Not even the writer's claim.
  r = run("import-orbax", orbax_step, dest, "--step", 9)
  assert r.returncode == 0, r.stderr
  assert sorted(p.name for p in dest.iterdir()) == ["4", "9", "_WRITER"]


@pytest.mark.parametrize("case", [
    "missing", "not-a-step", "no-step-number", "holds-orbax-steps",
    "inside-source", "no-item", "unfinished"])
def test_errors_name_what_to_do_and_write_nothing(case, orbax_step, tmp_path,
                                                  run):
  orbax_dir = orbax_step.parent
  source, dest, options = orbax_step, tmp_path / "ours", []
  watched = orbax_dir  # What must stay as it was.
  if case == "missing":
    source = tmp_path / "nope"
    code, message = 3, f"Orbax step directory {source} does not exist"
  elif case == "not-a-step":  # Orbax's directory, not one of its steps.
    source = orbax_dir
    code, message = 3, (
        f"no Orbax PyTree checkpoint in {orbax_dir}: no _METADATA file"
        " (StandardSave, PyTreeSave) and no item subdirectory holding one (a"
        " CheckpointManager step); it looks like an Orbax CheckpointManager"
        f" directory: give one of its steps, such as {orbax_step}")
  elif case == "no-step-number":  # An item directory, outside its step.
    source = watched = tmp_path / "default"
    os.rename(orbax_step / "default", source)
    code, message = 2, (
        "cannot tell the step number from the directory name 'default'"
        " (Orbax names steps N or PREFIX_N, e.g. 5 or checkpoint_5): give it"
        " with --step N")
  elif case == "holds-orbax-steps":  # Our manager would delete them.
    dest = watched = tmp_path / "orbax_too"
    orbax_manager_save(dest, 8, {"w": np.ones(2)})
    code, message = 2, (
        f"{dest} holds Orbax steps ['8'], which a checkpoint manager opening"
        " it would delete as unfinished steps of its own: give a destination"
        " of its own to the imported steps")
  elif case == "inside-source":
    dest = orbax_step / "ours"
    code, message = 2, (
        f"the destination {dest} and the Orbax step {orbax_step} overlap:"
        " give a destination outside the Orbax checkpoint directory")
  elif case == "no-item":
    options = ["--item", "state"]
    code, message = 3, (
        f"{orbax_step} has no PyTree item 'state' ({orbax_step}/state/"
        "_METADATA does not exist); its PyTree items: ['default']")
  else:  # A save in flight, or one that a crash interrupted.
    source = orbax_dir / "5.orbax-checkpoint-tmp-123"
    source.mkdir()
    code, message = 3, (f"{source} is a save that Orbax did not finish (its"
                        " name holds '.orbax-checkpoint-tmp')")
  before = files_of(watched)
  r = run("import-orbax", source, dest, *options)
  assert (r.returncode, r.stdout) == (code, ""), r.stderr
  assert r.stderr == f"flax-ckpt import-orbax: {message}\n"
  assert files_of(watched) == before  # Not even our writer's claim.
  assert case == "holds-orbax-steps" or not dest.exists()


def test_without_tensorstore_the_command_says_what_to_install(
    orbax_step, tmp_path, monkeypatch, run):
  monkeypatch.setitem(sys.modules, "tensorstore", None)  # The import fails.
  r = run("import-orbax", orbax_step, tmp_path / "ours")
  assert (r.returncode, r.stdout) == (2, "")
  assert r.stderr.startswith(
      "flax-ckpt import-orbax: import-orbax needs tensorstore (flax installs"
      " it): pip install 'flax_ckpt_plugin[orbax]' (")
  assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("case", ["metadata", "array", "list"])
def test_a_damaged_orbax_step_is_named_and_nothing_is_written(case, tmp_path,
                                                              run):
  """What Orbax's files hold is checked: a damaged `_METADATA`, an array
  whose files are gone, a list whose indices skip one."""
  source = tmp_path / "orbax" / "1"
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)  # A dir per array.
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(source.absolute(), args=ocp.args.PyTreeSave(
        {"w": np.ones(3), "b": [1, 2]}))
  if case == "metadata":
    (source / "_METADATA").write_text('{"tree_metadata": ')
    message = (f"cannot read Orbax's metadata {source}/_METADATA:"
               " JSONDecodeError: Expecting value: line 1 column 19 (char 18)")
  elif case == "array":
    for f in (source / "w").iterdir():
      f.unlink()
    message = f"cannot read leaf ['w'] of {source} (Orbax's array 'w'): "
  else:
    text = (source / "_METADATA").read_text()
    (source / "_METADATA").write_text(text.replace(
        "('b', '1')", "('b', '2')").replace('"key": "1"', '"key": "2"'))
    message = (f"{source}/_METADATA: the list at ['b'] has indices ['0', '2'],"
               " not 0 to 1")
  r = run("import-orbax", source, tmp_path / "ours")
  assert (r.returncode, r.stdout) == (1, "")
  assert r.stderr.startswith(f"flax-ckpt import-orbax: {message}"), r.stderr
  assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("layout", [dict(use_zarr3=True),
                                    dict(use_ocdbt=False)])
def test_zarr3_and_one_directory_per_array(layout, tmp_path, train_step,
                                           host_copy, assert_trees_equal):
  """Orbax's other layouts: zarr 3 arrays, and arrays outside OCDBT."""
  state = trained(train_step, steps=2)
  expected = host_copy(state)
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**layout)) as checkpointer:
    checkpointer.save((tmp_path / "orbax" / "2").absolute(),
                      args=ocp.args.PyTreeSave(state))
  assert ((tmp_path / "orbax" / "2" / "manifest.ocdbt").exists()
          == layout.get("use_ocdbt", True))
  importer.import_orbax(tmp_path / "orbax" / "2", tmp_path / "ours")
  assert_trees_equal(restore(tmp_path / "ours", trained(train_step, 1, 1)),
                     expected)


def test_strings_cannot_be_converted(tmp_path, run):
  ocp.PyTreeCheckpointer().save((tmp_path / "orbax" / "1").absolute(),
                                {"name": "run-7", "w": np.ones(3)})
  r = run("import-orbax", tmp_path / "orbax" / "1", tmp_path / "ours")
  assert (r.returncode, r.stdout) == (1, "")
  assert r.stderr == (
      f"flax-ckpt import-orbax: leaf ['name'] of {tmp_path}/orbax/1 is a"
      " string, which a checkpoint of ours cannot hold (leaves are arrays and"
      " Python int/float/bool)\n")
  assert not (tmp_path / "ours").exists()


_WITHOUT_ORBAX = """
import sys
import numpy as np
import flax_ckpt_plugin
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.tools import cli
with CheckpointManager(sys.argv[1]) as mgr:
  mgr.save(1, {"w": np.ones(3)})
  mgr.wait_until_finished()
  mgr.restore({"w": np.zeros(3)})
codes = [cli.main([command, sys.argv[1]]) for command in ("list", "show",
                                                          "verify")]
try:
  cli.main(["import-orbax", "--help"])
except SystemExit as e:
  codes.append(e.code)
codes.append(cli.main(["import-orbax", sys.argv[2], sys.argv[1] + "-import"]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "orbax")
assert not loaded, f"orbax was imported: {loaded[:5]}"
sys.exit(max(codes))
"""


@pytest.mark.multiprocess
def test_orbax_is_never_imported(orbax_step, tmp_path):
  """Not by the library, not by the CLI, not even by a conversion."""
  r = subprocess.run([sys.executable, "-c", _WITHOUT_ORBAX,
                      str(tmp_path / "ckpt"), str(orbax_step)],
                     capture_output=True, text=True, timeout=120, check=False)
  assert r.returncode == 0, r.stderr
  assert "step 1: ok" in r.stdout and "ORBAX_STEP_DIR DEST_DIR" in r.stdout
  assert f"imported {orbax_step} (Orbax item 'default') as step 4" in r.stdout


# -- docs/converting.md, docs/cli.md and docs/integrations.md --------------------


_PAGE, _SECTION = "converting.md", "## From Orbax: `flax-ckpt import-orbax`"


@pytest.mark.multiprocess
def test_converting_md_commands_print_what_the_page_shows(tmp_path):
  section = doc_section(_PAGE, _SECTION)
  (script,) = doc_blocks(section, "python")
  (tmp_path / "save_with_orbax.py").write_text(script)
  r = subprocess.run([sys.executable, "save_with_orbax.py"], cwd=tmp_path,
                     capture_output=True, text=True, timeout=300, check=False)
  assert r.returncode == 0, r.stderr
  consoles = doc_blocks(section, "console")
  assert len(consoles) == 6
  for block in consoles:
    run_console(block, tmp_path)
  # cli.md's --help block is the real one.
  (help_block,) = [b for b in doc_blocks((REPO / "docs" / "cli.md").read_text(),
                                      "console")
                   if b.startswith("$ flax-ckpt --help\n")]
  run_console(help_block, tmp_path)


@pytest.mark.multiprocess
def test_integrations_md_converts_and_restores(tmp_path, monkeypatch, capsys,
                                               host_copy, assert_trees_equal):
  (script,) = doc_blocks(doc_section(_PAGE, _SECTION), "python")
  section = doc_section("integrations.md", "## Coming from Orbax")
  (console,) = doc_blocks(section, "console")
  (restore_code,) = doc_blocks(section, "python")
  monkeypatch.chdir(tmp_path)
  scope = {}
  exec(compile(script, "docs/converting.md", "exec"), scope)  # pylint: disable=exec-used
  expected = host_copy(scope["state"])
  run_console(console, tmp_path)
  capsys.readouterr()
  exec(compile(restore_code, "docs/integrations.md", "exec"), scope)  # pylint: disable=exec-used
  assert capsys.readouterr().out == "3\n"
  assert_trees_equal(scope["state"], expected)
