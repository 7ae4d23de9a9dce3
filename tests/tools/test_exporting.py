"""`flax-ckpt export` and `flax_ckpt_plugin.export`: safetensors and npz.

The files are read back with the readers a user would use
(`safetensors.numpy.load_file`, `safe_open`, `numpy.load`), and compared
bit for bit with what was saved. The multi-process test exports a
TrainState that 4 processes x 2 devices saved (`mp_workers/topology_write`),
comparing with the digests its writers took of the global arrays.
"""

import hashlib
import io
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import flax_ckpt_plugin
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.tools import export_files
from flax_ckpt_plugin.tools import exporting
from helpers import doc_blocks
from helpers import doc_section
from helpers import run_console
from launcher import run_workers


@pytest.fixture
def saved(ckpt_dir, make_state, train_step):
  """Step 3 of a TrainState (adam), a bfloat16 leaf and a float: host
  copies of what was saved, by dotted name, and the scalars."""
  state = train_step(make_state()).replace(step=3)
  tree = {"state": state, "bf16": jnp.linspace(-2, 2, 1000, dtype=jnp.bfloat16),
          "lr": 0.25}
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(3, tree)
  arrays = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = ".".join(re.findall(r"[\w]+", jax.tree_util.keystr(path)))
    if isinstance(leaf, jax.Array):
      arrays[name] = np.asarray(leaf)
  return arrays, {"state.step": 3, "lr": 0.25}


def _same(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    assert got[name].dtype == value.dtype, name
    assert got[name].shape == value.shape, name
    assert got[name].tobytes() == value.tobytes(), name


def _header(path) -> dict:
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(n))


def test_safetensors_holds_every_array_and_the_scalars(ckpt_dir, saved, run,
                                                       tmp_path):
  arrays, scalars = saved
  out = tmp_path / "export"
  r = run("export", ckpt_dir, out)
  assert r.returncode == 0, r.stderr
  assert r.stdout == (
      f"exported step 3 of {ckpt_dir} to {out} (safetensors): 14 arrays,"
      f" 4.4 KiB\n  {out}/model.safetensors\n"
      "in the metadata: lr = 0.25, state.step = 3\n")
  assert sorted(os.listdir(out)) == ["model.safetensors"]
  path = out / "model.safetensors"
  bf16 = arrays.pop("bf16")
  with safetensors.safe_open(path, framework="flax") as f:
    got = {k: np.asarray(f.get_tensor(k)) for k in f.keys()}
    metadata = f.metadata()
  _same(got, {**arrays, "bf16": bf16})
  header = _header(path)
  assert header["bf16"]["dtype"] == "BF16"
  assert header["state.params.params.Dense_0.kernel"]["dtype"] == "F32"
  assert {k: json.loads(v) for k, v in metadata.items()} == {
      **scalars, "flax_ckpt_plugin.step": 3}


def test_a_split_export_opens_through_its_index(ckpt_dir, saved, tmp_path,
                                                monkeypatch):
  """Files of at most 1000 bytes: the 2000-byte bf16 leaf gets a file of
  its own, streamed in pieces of 64 bytes."""
  monkeypatch.setattr(export_files, "PIECE_BYTES", 64)
  arrays, scalars = saved
  out = tmp_path / "split"
  result = flax_ckpt_plugin.export(ckpt_dir, out, only=["state.params", "bf16"],
                                   max_file_bytes=1000)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  count = len(result.files) - 1
  assert count == 2 and result.files[-1] == "model.safetensors.index.json"
  assert sorted(os.listdir(out)) == sorted(result.files) == [
      "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "model.safetensors.index.json"]
  want = {k: v for k, v in arrays.items()
          if k.startswith("state.params.") or k == "bf16"}
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in
                                                want.values())
  assert index["metadata"]["flax_ckpt_plugin.step"] == 3
  assert set(index["weight_map"]) == set(want)
  got = {}
  for name, file in index["weight_map"].items():
    with safetensors.safe_open(out / file, framework="flax") as f:
      got[name] = np.asarray(f.get_tensor(name))
  _same(got, want)
  for file in result.files[:-1]:
    header = _header(out / file)
    sizes = [h["data_offsets"][1] - h["data_offsets"][0]
             for k, h in header.items() if k != "__metadata__"]
    assert sum(sizes) <= 1000 or len(sizes) == 1, (file, sizes)
  del scalars


def test_npz_gives_back_every_array_and_a_json_beside_it(ckpt_dir, saved,
                                                         run, tmp_path):
  arrays, scalars = saved
  out = tmp_path / "npz"
  r = run("export", ckpt_dir, out, "--format", "npz")
  assert r.returncode == 0, r.stderr
  assert sorted(os.listdir(out)) == ["model.json", "model.npz"]
  with np.load(out / "model.npz") as z:
    got = {k: z[k] for k in z.files}
  side = json.loads((out / "model.json").read_text())
  assert side == {"step": 3, "scalars": scalars,
                  "dtypes": {"bf16": "bfloat16"}}
  # numpy has no bfloat16: its bits, as uint16, and the JSON names it.
  assert got["bf16"].dtype == np.uint16
  got["bf16"] = got["bf16"].view(ml_dtypes.bfloat16)
  _same(got, arrays)


def test_an_out_ending_in_npz_is_one_npz_file_with_its_json_beside(
    ckpt_dir, saved, run, tmp_path):
  """`np.load("out.npz")` opens it, as after `numpy.savez`; once, OUT was a
  folder named out.npz (`IsADirectoryError`)."""
  arrays, scalars = saved
  out = tmp_path / "out.npz"
  r = run("export", ckpt_dir, out)
  assert r.returncode == 0, r.stderr
  assert r.stdout == (
      f"exported step 3 of {ckpt_dir} to {out} (npz): 14 arrays, 4.4 KiB\n"
      f"  {out}\n  {tmp_path / 'out.json'}\n"
      "in out.json: lr = 0.25, state.step = 3\n")
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "out.json", "out.npz"]
  with np.load(out) as z:
    got = {k: z[k] for k in z.files}
  side = json.loads((tmp_path / "out.json").read_text())
  assert side == {"step": 3, "scalars": scalars,
                  "dtypes": {"bf16": "bfloat16"}}
  got["bf16"] = got["bf16"].view(ml_dtypes.bfloat16)
  _same(got, arrays)


def test_an_out_ending_in_safetensors_is_one_file_load_file_opens(
    ckpt_dir, saved, tmp_path):
  arrays, _ = saved
  out = tmp_path / "model_out.safetensors"
  result = flax_ckpt_plugin.export(ckpt_dir, out, only=["state"])
  assert result.format == "safetensors" and result.as_file
  assert result.written == [out]
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "model_out.safetensors"]
  _same(safetensors.numpy.load_file(out),
        {k: v for k, v in arrays.items() if k.startswith("state.")})


def test_a_file_out_that_must_be_split_asks_for_a_folder(ckpt_dir, saved,
                                                         run, tmp_path):
  del saved
  out = tmp_path / "big.safetensors"
  r = run("export", ckpt_dir, out, "--max-file-size", "1000")
  assert r.returncode == 2
  assert r.stderr == (
      "flax-ckpt export: 4.4 KiB of arrays do not fit one safetensors file"
      " of at most 1000 B: give OUT as a folder name (not ending in"
      " .safetensors) to write numbered files and an index there, or raise"
      " the limit (--max-file-size)\n")
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_file_out_whose_suffix_is_not_the_format_is_refused(
    ckpt_dir, saved, run, tmp_path):
  del saved
  r = run("export", ckpt_dir, tmp_path / "x.npz", "--format", "safetensors")
  assert r.returncode == 2
  assert "x.npz ends in .npz, and the format asked is safetensors" in r.stderr
  (tmp_path / "y.json").write_text("mine")
  r = run("export", ckpt_dir, tmp_path / "y.npz")
  assert r.returncode == 5
  assert r.stderr == (f"flax-ckpt export: {tmp_path / 'y.json'} already"
                      " exists: nothing was written\n")
  assert (tmp_path / "y.json").read_text() == "mine"
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "y.json"]


def test_only_params_writes_only_the_params(ckpt_dir, saved, run, tmp_path):
  arrays, _ = saved
  out = tmp_path / "params"
  r = run("export", ckpt_dir, out, "--only", "state/params")
  assert r.returncode == 0, r.stderr
  got = safetensors.numpy.load_file(out / "model.safetensors")
  _same(got, {k: v for k, v in arrays.items()
              if k.startswith("state.params.")})
  assert "in the metadata" not in r.stdout  # The step is not under params.
  r = run("export", ckpt_dir, tmp_path / "none", "--only", "parms")
  assert r.returncode == 2
  assert r.stderr == ("flax-ckpt export: no leaf under 'parms'; the tree's"
                      " top-level keys: ['bf16', 'lr', 'state']\n")
  assert not (tmp_path / "none").exists()


def _leftovers(parent) -> list[str]:
  return sorted(p for p in os.listdir(parent) if ".partial-" in p)


def test_a_damaged_file_fails_the_export_and_leaves_nothing(ckpt_dir, saved,
                                                            run, tmp_path):
  del saved
  data = ckpt_dir / "3" / "data" / "process_00000.bin"
  raw = bytearray(data.read_bytes())
  raw[100] ^= 1
  data.write_bytes(bytes(raw))
  for fmt in ("safetensors", "npz"):
    out = tmp_path / f"out_{fmt}"
    r = run("export", ckpt_dir, out, "--format", fmt)
    assert r.returncode == 1, r.stderr
    assert re.fullmatch(
        rf"flax-ckpt export: step 3 in {re.escape(str(ckpt_dir / '3'))},"
        r" leaf '[\w/]+': checksum mismatch in data/process_00000\.bin at"
        r" bytes \[\d+, \d+\) .*damaged after it was written\.\n", r.stderr)
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_an_existing_out_is_refused_and_kept(ckpt_dir, saved, run, tmp_path):
  del saved
  out = tmp_path / "taken"
  out.mkdir()
  (out / "mine.txt").write_text("keep me")
  r = run("export", ckpt_dir, out)
  assert r.returncode == 5
  assert r.stderr == (f"flax-ckpt export: {out} already exists: nothing was"
                      " written\n")
  assert os.listdir(out) == ["mine.txt"]


def test_without_safetensors_the_cli_names_what_to_install(ckpt_dir, saved,
                                                           run, tmp_path,
                                                           monkeypatch):
  del saved
  monkeypatch.setitem(sys.modules, "safetensors", None)  # Import fails.
  r = run("export", ckpt_dir, tmp_path / "out")
  assert r.returncode == 2
  assert r.stderr.startswith(
      "flax-ckpt export: export to safetensors needs the safetensors"
      " package: pip install 'flax_ckpt_plugin[export]' (or use --format"
      " npz, which needs numpy only)")
  assert not (tmp_path / "out").exists()
  r = run("export", ckpt_dir, tmp_path / "out", "--format", "npz")
  assert r.returncode == 0, r.stderr


def test_a_dtype_safetensors_lacks_is_named(ckpt_dir, run, tmp_path):
  with CheckpointManager(ckpt_dir) as manager:
    manager.save(1, {"q": np.arange(4, dtype=ml_dtypes.int4)})
  r = run("export", ckpt_dir, tmp_path / "out")
  assert r.returncode == 2
  assert r.stderr == ("flax-ckpt export: leaf 'q' is int4[4], which"
                      " safetensors cannot hold; export it with --format"
                      " npz\n")
  assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_a_large_export_draws_progress(ckpt_dir, saved, tmp_path,
                                       monkeypatch):
  del saved
  monkeypatch.setattr(exporting, "PROGRESS_MIN_BYTES", 1000)
  stream = io.StringIO()
  flax_ckpt_plugin.export(ckpt_dir, tmp_path / "a", progress=stream)
  assert re.fullmatch(r"export: 4\.4 KiB / 4\.4 KiB \(100%\) in \d+\.\ds\n",
                      stream.getvalue())
  monkeypatch.setattr(exporting, "PROGRESS_MIN_BYTES", 10**6)
  stream = io.StringIO()
  flax_ckpt_plugin.export(ckpt_dir, tmp_path / "b", progress=stream)
  assert stream.getvalue() == ""


# -- 4 processes x 2 devices -----------------------------------------------------

RUN_TIMEOUT = 120


def _digest(value: np.ndarray) -> str:
  """As `mp_workers/_setup.leaf_digests` takes it."""
  h = hashlib.sha256()
  h.update(f"{value.dtype.str}{value.shape}".encode())
  h.update(np.ascontiguousarray(value).tobytes())
  return h.hexdigest()


def _cli(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "flax_ckpt_plugin", "export",
                         *map(str, args)], capture_output=True, text=True,
                        timeout=RUN_TIMEOUT, check=False)


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT * 2)
def test_a_state_saved_by_4_processes_x_2_devices_exports_bit_identical(
    tmp_path):
  ckpt = tmp_path / "ckpt"
  out = [r.json for r in run_workers(
      "topology_write", 4, args=[ckpt, "2x4"], timeout=RUN_TIMEOUT,
      devices_per_process=2)]
  # '.opt_state[0].mu['Dense_0']['kernel']' -> 'opt_state.0.mu.Dense_0.kernel'
  want = {".".join(re.findall(r"\w+", k)): d
          for k, d in out[0]["digests"].items()}
  manifest = json.loads((ckpt / "2" / "manifest.json").read_text())
  assert manifest["process_count"] == 4 and len(want) == 20
  assert all(len(leaf["shards"]) > 1 for leaf in manifest["leaves"]
             if leaf["path"].endswith("Dense_0/kernel"))  # Really sharded.

  r = _cli(ckpt, tmp_path / "st", "-q")
  assert r.returncode == 0, r.stderr
  got = safetensors.numpy.load_file(tmp_path / "st" / "model.safetensors")
  assert {k: _digest(v) for k, v in got.items()} == want

  r = _cli(ckpt, tmp_path / "npz", "--format", "npz", "-q")
  assert r.returncode == 0, r.stderr
  with np.load(tmp_path / "npz" / "model.npz") as z:
    assert {k: _digest(z[k]) for k in z.files} == want

  r = _cli(ckpt, tmp_path / "split", "--max-file-size", "1KiB", "-q")
  assert r.returncode == 0, r.stderr
  index = json.loads(
      (tmp_path / "split" / "model.safetensors.index.json").read_text())
  files = set(index["weight_map"].values())
  assert len(files) > 3 and len(files) == len(os.listdir(tmp_path / "split")) - 1
  got = {}
  for file in files:
    got.update(safetensors.numpy.load_file(tmp_path / "split" / file))
  assert {k: _digest(v) for k, v in got.items()} == want

  r = _cli(ckpt, tmp_path / "params", "--only", "params", "-q")
  assert r.returncode == 0, r.stderr
  got = safetensors.numpy.load_file(tmp_path / "params" / "model.safetensors")
  assert {k: _digest(v) for k, v in got.items()} == {
      k: d for k, d in want.items() if k.startswith("params.")}
  assert len(got) == 6


_NO_JAX = """
import sys
from flax_ckpt_plugin.tools import cli
code = cli.main(["export", sys.argv[1], sys.argv[2], "--format", "npz"])
assert code == 0, code
assert "jax" not in sys.modules, "export imported jax"
"""


@pytest.mark.multiprocess
def test_the_export_runs_without_jax(ckpt_dir, saved, tmp_path):
  del saved
  r = subprocess.run([sys.executable, "-c", _NO_JAX, str(ckpt_dir),
                      str(tmp_path / "out")], capture_output=True, text=True,
                     timeout=120, check=False)
  assert r.returncode == 0, r.stderr
  assert (tmp_path / "out" / "model.npz").exists()


# -- the docs -----------------------------------------------------------------


def test_restoring_md_cast_and_export_blocks_print_what_the_page_shows(
    tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  workdir = str(tmp_path / "run")
  for heading in ("## Restoring into other dtypes: `cast=True`",
                  "## Exporting to safetensors or npz"):
    section = doc_section("restoring.md", heading)
    (code,) = doc_blocks(section, "python")
    (printed,) = doc_blocks(section, "text")[:1]
    capsys.readouterr()
    exec(compile(code, "docs/restoring.md", "exec"), {"workdir": workdir})  # pylint: disable=exec-used
    assert capsys.readouterr().out == printed.replace("WORKDIR", workdir)


@pytest.mark.multiprocess
def test_converting_md_export_commands_print_what_the_page_shows(tmp_path):
  # They run in the directory that cli.md's example makes.
  (script,) = doc_blocks(doc_section("cli.md", "## The example directory"),
                         "python")
  (tmp_path / "make_ckpts.py").write_text(script)
  work = tmp_path / "work"
  work.mkdir()
  r = subprocess.run([sys.executable, str(tmp_path / "make_ckpts.py")],
                     cwd=work, capture_output=True, text=True, timeout=300,
                     check=False)
  assert r.returncode == 0, r.stderr
  consoles = doc_blocks(doc_section(
      "converting.md", "## To safetensors or npz: `flax-ckpt export`"),
      "console")
  assert len(consoles) == 8
  for block in consoles:
    run_console(block, work)
