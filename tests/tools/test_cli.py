"""Tests of the `flax-ckpt` command line, run as a user runs it.

Checkpoints are written by a real CheckpointManager; the CLI runs in this
process (`cli.main(argv)`, its output captured by pytest) and, to check the
entry points and that it starts without JAX, a few times in a subprocess
(`python -m flax_ckpt_plugin`, the installed `flax-ckpt` script). The tests
check its output, its exit code and the disk.
"""

import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from conftest import create_state
from flax_ckpt_plugin import CheckpointManager
from flax_ckpt_plugin.tools import cli
from flax_ckpt_plugin.tools.inventory import human_age
from flax_ckpt_plugin.tools.verify import human_size
from flax_ckpt_plugin.tools.verify import Progress
from helpers import adam_train_state as _train_state

KERNEL = "params/params/Dense_0/kernel"  # float32[8,16] in conftest's MLP.


def run_process(*args, script: bool = False) -> subprocess.CompletedProcess:
  """Runs the CLI in a new interpreter; stdout and stderr are kept apart."""
  if script:
    exe = pathlib.Path(sys.executable).parent / "flax-ckpt"
    assert exe.exists(), (
        f"{exe} is missing: install the package (pip install -e .) so that"
        " the [project.scripts] entry point exists")
    cmd = [str(exe)]
  else:
    cmd = [sys.executable, "-m", "flax_ckpt_plugin"]
  return subprocess.run(cmd + [str(a) for a in args], capture_output=True,
                        text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> pathlib.Path:
  """Steps 1, 2, 3 finalized, plus what a crash or a running job leaves."""
  directory = tmp_path_factory.mktemp("cli") / "ckpt"
  state = create_state()
  with CheckpointManager(directory) as mgr:
    for step in (1, 2, 3):
      mgr.save(step, state.replace(step=step),
               extra={"epoch": step, "data_position": 32 * step},
               metrics={"loss": 0.5 / step})
      mgr.wait_until_finished()
  # A save in flight (rename mode), one in commit-file mode, a deletion.
  (directory / "4.partial" / "data").mkdir(parents=True)
  (directory / "4.partial" / "data" / "process_00000.bin").write_bytes(
      b"\0" * 3000)
  (directory / "5").mkdir()
  (directory / "0.deleting").mkdir()
  return directory


@pytest.fixture
def ckpt(source, tmp_path) -> pathlib.Path:
  """A copy of `source` that a test may damage or prune."""
  return pathlib.Path(shutil.copytree(source, tmp_path / "ckpt"))


def _rows(stdout: str) -> dict[str, list[str]]:
  """The `list` table by NAME column."""
  rows = {}
  for line in stdout.splitlines()[1:]:
    cells = re.split(r"\s{2,}", line.strip())
    if len(cells) == 5:
      rows[cells[4]] = cells
  return rows


@pytest.mark.multiprocess
def test_list_shows_finalized_and_unfinished_steps(source, run):
  r = run_process("list", source, script=True)  # The installed console script.
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines()[0].split() == ["STEP", "STATE", "SIZE", "AGE",
                                              "NAME"]
  rows = _rows(r.stdout)
  assert set(rows) == {"0.deleting", "1", "2", "3", "4.partial", "5"}
  assert [rows[n][1] for n in ("1", "2", "3")] == ["finalized"] * 3
  assert rows["4.partial"][:2] == ["4", "unfinished"]
  assert rows["5"][1] == "unfinished"  # No _COMMITTED (commit-file mode).
  assert rows["0.deleting"][1] == "deleting"
  assert rows["4.partial"][2] == "2.9 KiB"
  assert re.fullmatch(r"\d+(\.\d)? KiB", rows["1"][2]), rows["1"]
  assert re.fullmatch(r"\d+[smh] ago", rows["1"][3]), rows["1"]
  assert "3 finalized, 2 unfinished, 1 deleting" in r.stdout
  assert "pid " in r.stdout and "claimed the directory" in r.stdout

  r = run("list", source, "--json")
  assert r.returncode == 0, r.stderr
  listing = json.loads(r.stdout)
  by_name = {e["name"]: e for e in listing["steps"]}
  assert by_name["4.partial"]["bytes"] == 3000
  assert by_name["3"]["state"] == "finalized" and by_name["3"]["step"] == 3
  assert 0 <= by_name["3"]["age_secs"] < 600
  assert listing["writer"]["pid"] == os.getpid()


@pytest.mark.multiprocess
def test_show_prints_leaves_extra_and_metadata(source, run):
  r = run_process("show", source)  # The newest: 3, not 4 or 5. python -m.
  assert r.returncode == 0, r.stderr
  out = r.stdout
  assert out.startswith(f"step 3 in {source}\n")
  assert re.search(rf"^  {KERNEL}\s+float32\[8,16\]\s+512 B\s+1$", out, re.M)
  assert re.search(r"^  opt_state/0/count\s+int32\[\] = 0\s+4 B", out, re.M)
  assert re.search(r"^  step\s+int = 3$", out, re.M)
  assert 'extra:     {"data_position": 96, "epoch": 3}' in out
  assert 'metrics:   {"loss": 0.16666' in out
  assert "flax_ckpt_plugin version 1, written by 1 process" in out

  r = run("show", source, 1, "--json")
  assert r.returncode == 0, r.stderr
  info = json.loads(r.stdout)
  assert info["step"] == 1 and info["format_version"] == 1
  assert info["process_count"] == 1
  assert info["extra"] == {"epoch": 1, "data_position": 32}
  assert info["metrics"] == {"loss": 0.5}
  leaves = {leaf["path"]: leaf for leaf in info["leaves"]}
  assert leaves[KERNEL] == {"path": KERNEL, "kind": "array",
                            "dtype": "float32", "shape": [8, 16],
                            "nbytes": 512, "shards": 1}
  assert leaves["step"] == {"path": "step", "kind": "int", "value": 1}
  assert info["total_bytes"] == sum(l.get("nbytes", 0) for l in leaves.values())


def test_verify_passes_then_names_the_damaged_step_and_file(ckpt, run):
  r = run("verify", ckpt)
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines() == [
      f"step {s}: ok (2.5 KiB checked)" for s in (1, 2, 3)]
  # stderr is a pipe here: plain progress lines, no carriage returns.
  assert "\r" not in r.stderr
  assert re.search(r"^verify: 7\.5 KiB / 7\.5 KiB \(100%\)", r.stderr, re.M)

  # One flipped byte in step 2; step 3 loses the end of its data file.
  data2 = ckpt / "2" / "data" / "process_00000.bin"
  raw = bytearray(data2.read_bytes())
  raw[100] ^= 0x01
  data2.write_bytes(bytes(raw))
  data3 = ckpt / "3" / "data" / "process_00000.bin"
  data3.write_bytes(data3.read_bytes()[:-10])
  r = run("verify", ckpt, "--all")
  assert r.returncode == 1, (r.stdout, r.stderr)
  lines = r.stdout.splitlines()
  assert lines[0] == "step 1: ok (2.5 KiB checked)"
  assert lines[1] == "step 2: CORRUPT"
  assert lines[2].startswith(f"  {data2}: checksum mismatch at bytes [64, 576)")
  assert f"in leaf '{KERNEL}'" in lines[2]
  assert lines[3] == "step 3: CORRUPT"
  assert f"data file {data3} is truncated" in lines[4]
  errors = [l for l in r.stderr.splitlines() if l.startswith("flax-ckpt")]
  assert errors == [f"flax-ckpt verify: 2 of 3 steps in {ckpt} failed"
                    " verification: steps [2, 3]"]
  assert "Traceback" not in r.stderr

  r = run("verify", ckpt, 1, "--json", "--quiet")
  assert r.returncode == 0 and r.stderr == ""
  assert json.loads(r.stdout)["results"] == [
      {"step": 1, "status": "ok", "problems": [], "bytes": 2548}]


def test_prune_keeps_newest_without_claiming_the_directory(ckpt, run):
  # A training job holds the directory: prune must not take it over.
  job = CheckpointManager(ckpt)  # Claims it (and cleans unfinished steps).
  (ckpt / "4.partial").mkdir()  # The job's next save, in flight.
  writer = (ckpt / "_WRITER").read_bytes()
  size = human_size(sum(f.stat().st_size for f in (ckpt / "1").rglob("*")
                        if f.is_file()))

  r = run("prune", ckpt, "--keep", 2, "--dry-run")
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines() == [
      f"would delete step 1 ({size})", "kept 2 finalized steps: [2, 3]"]
  assert (ckpt / "1").is_dir()

  r = run("prune", ckpt, "--keep", 2)
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines() == [
      f"deleted step 1 ({size})", "kept 2 finalized steps: [2, 3]"]
  assert sorted(os.listdir(ckpt)) == ["2", "3", "4.partial", "_WRITER"]
  assert (ckpt / "_WRITER").read_bytes() == writer
  # The job goes on saving: it still owns the directory.
  job.save(6, create_state().replace(step=6))
  job.close()

  r = run("list", ckpt, "--json")
  assert [(e["name"], e["state"]) for e in json.loads(r.stdout)["steps"]] == [
      ("2", "finalized"), ("3", "finalized"), ("4.partial", "unfinished"),
      ("6", "finalized")]

  r = run("prune", ckpt, "--keep", 1, "--unfinished")
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines() == [  # Steps 1, 2 and 3 are alike.
      f"deleted step 2 ({size})", f"deleted step 3 ({size})",
      "deleted unfinished 4.partial", "kept 1 finalized step: [6]"]
  assert "warning: removing unfinished steps ['4.partial']" in r.stderr
  assert sorted(os.listdir(ckpt)) == ["6", "_WRITER"]


@pytest.mark.parametrize("args,code,message", [
    (["show", "{missing}"], 3, "flax-ckpt show: directory {missing} does"
     " not exist"),
    (["verify", "{dir}", "4"], 3, "flax-ckpt verify: step 4 in {dir}: it is"
     " not finalized (found 4.partial); finalized steps: [1, 2, 3]"),
    (["show", "{empty}"], 3, "flax-ckpt show: no finalized step in {empty}"),
    (["prune", "{dir}", "--keep", "0"], 2, "flax-ckpt prune: --keep 0 would"
     " delete every finalized step; add --force if that is what you want"),
    (["show", "{dir}", "latest"], 2, "flax-ckpt show: error: argument STEP:"
     " invalid int value: 'latest'"),
], ids=["no-directory", "unfinished-step", "no-finalized-step", "keep-0",
        "bad-step"])
def test_errors_are_one_line_with_an_exit_code(source, tmp_path, args, code,
                                               message, run):
  names = {"dir": source, "missing": tmp_path / "nope",
           "empty": tmp_path / "empty"}
  (tmp_path / "empty").mkdir()
  r = run(*[a.format(**names) for a in args])
  assert r.returncode == code, (r.stdout, r.stderr)
  assert r.stderr.splitlines()[-1] == message.format(**names)
  assert "Traceback" not in r.stderr
  assert r.stdout == ""


def test_help_lists_exit_codes_and_sizes_are_human():
  help_text = cli._parser().format_help()
  for line in ("0  success", "1  a checkpoint failed verification",
               "2  usage error", "3  directory or step not found"):
    assert line in help_text
  assert [human_size(n) for n in (0, 1023, 1536, 5 << 20, 3 << 30)] == [
      "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB"]
  assert [human_age(s) for s in (5, 200, 7300, 200000, -3)] == [
      "5s ago", "3m ago", "2h ago", "2d ago", "in the future"]


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_progress_redraws_on_a_terminal_and_prints_lines_elsewhere():
  tty, log = _Terminal(), io.StringIO()
  for stream in (tty, log):
    progress = Progress(3 << 20, stream)
    progress.update(1 << 20, label="step 7")
    progress.finish()
  assert tty.getvalue().startswith(
      "\r\033[Kverify [##########....................] 1.0 MiB / 3.0 MiB"
      " (33%) step 7")
  assert "\r" not in log.getvalue()
  assert re.fullmatch(r"verify: 1\.0 MiB / 3\.0 MiB \(33%\) in \d+\.\ds\n",
                      log.getvalue())


def test_prune_beside_a_job_whose_retention_deletes_the_same_steps(ckpt,
                                                                   run):
  """The job's retention finds the pruned steps gone and goes on."""
  job = CheckpointManager(ckpt, max_to_keep=2)  # Knows steps 1, 2, 3.
  r = run("prune", ckpt, "--keep", 1)
  assert r.returncode == 0, r.stderr
  assert sorted(os.listdir(ckpt)) == ["3", "_WRITER"]
  job.save(6, create_state().replace(step=6))  # Retention: delete 1 and 2.
  job.close()  # Raises if that retention failed.
  assert job.all_steps() == [3, 6]
  assert sorted(os.listdir(ckpt)) == ["3", "6", "_WRITER"]


def test_list_shows_a_step_set_aside_as_damaged_and_prune_keeps_it(ckpt,
                                                                  run):
  (ckpt / "3").rename(ckpt / "3.damaged")  # What a fallback restore does.
  r = run("list", ckpt)
  assert r.returncode == 0, r.stderr
  row = _rows(r.stdout)["3.damaged"]
  assert row[:2] == ["3", "damaged"]
  assert "1 damaged" in r.stdout
  r = run("prune", ckpt, "--keep", 1, "--unfinished")
  assert r.returncode == 0, r.stderr
  assert (ckpt / "3.damaged" / "_COMMITTED").exists()  # For a person.
  assert sorted(os.listdir(ckpt)) == ["2", "3.damaged", "_WRITER"]


_WITHOUT_JAX = """
import sys
from flax_ckpt_plugin.tools import cli
assert "jax" not in sys.modules, "importing flax_ckpt_plugin.tools.cli imported jax"
codes = [cli.main([command, sys.argv[1]]) for command in ("list", "show",
                                                          "verify")]
loaded = sorted(m for m in sys.modules if m == "jax" or m.startswith("jax."))
assert not loaded, f"the commands imported {loaded[:5]}"
sys.exit(max(codes))
"""


@pytest.mark.multiprocess
def test_cli_starts_and_reads_without_importing_jax(source):
  """`flax-ckpt list/show/verify` need numpy alone, so they start quickly."""
  r = subprocess.run([sys.executable, "-c", _WITHOUT_JAX, str(source)],
                     capture_output=True, text=True, timeout=120, check=False)
  assert r.returncode == 0, r.stderr
  assert "3 finalized, 2 unfinished, 1 deleting" in r.stdout
  assert f"step 3 in {source}" in r.stdout
  assert "step 3: ok (2.5 KiB checked)" in r.stdout


def test_nan_metrics_are_stored_as_null_and_show_json_stays_valid(
    ckpt_dir, capsys):
  with CheckpointManager(ckpt_dir) as m:
    m.save(1, _train_state(1), metrics={"loss": float("nan"), "acc": 0.5,
                                        "grad": float("inf")})
    m.wait_until_finished()
    assert m.metadata(1).metrics == {"loss": None, "acc": 0.5, "grad": None}
  raw = (ckpt_dir / "1" / "manifest.json").read_text()
  assert "NaN" not in raw and "Infinity" not in raw
  assert cli.main(["show", str(ckpt_dir), "--json"]) == 0
  shown = json.loads(capsys.readouterr().out)  # Strict JSON.
  assert shown["metrics"]["loss"] is None


def test_show_prints_the_value_of_0_d_arrays_such_as_the_step(
    ckpt_dir, capsys):
  with CheckpointManager(ckpt_dir) as m:
    m.save(1, _train_state(42))
  assert cli.main(["show", str(ckpt_dir)]) == 0
  out = capsys.readouterr().out
  assert "int32[] = 42" in out and "float32[3] " in out
  assert cli.main(["show", str(ckpt_dir), "--json"]) == 0
  leaves = {leaf["path"]: leaf for leaf in json.loads(
      capsys.readouterr().out)["leaves"]}
  assert leaves["step"]["value"] == 42
  assert "value" not in leaves["params/w"]


def test_show_with_rename_shows_where_a_restore_puts_each_leaf(source, run):
  """`show --rename` lists each leaf under the path `restore(rename=)`
  gives it, beside its checkpoint path; '' drops a leaf."""
  r = run("show", source, "--rename", r"params/params/Dense_(\d+)/(.*)",
          r"params/encoder/layer_\1/\2", "--rename", "opt_state/.*", "")
  assert r.returncode == 0, r.stderr
  out = r.stdout
  assert re.search(r"^  PATH\s+CHECKPOINT PATH\s+TYPE\s+BYTES\s+SHARDS$",
                   out, re.M)
  assert re.search(rf"^  params/encoder/layer_0/kernel\s+{KERNEL}\s+"
                   r"float32\[8,16\]\s+512 B\s+1$", out, re.M)
  assert re.search(r"^  \(dropped\)\s+opt_state/0/count\s+int32", out, re.M)
  assert re.search(r"^  step\s+int = 3$", out, re.M)  # Kept as it is.

  r = run("show", source, "--json", "--rename",
          r"params/params/Dense_(\d+)/(.*)", r"params/encoder/layer_\1/\2")
  assert r.returncode == 0, r.stderr
  leaves = {leaf["path"]: leaf for leaf in json.loads(r.stdout)["leaves"]}
  assert leaves[KERNEL]["target_path"] == "params/encoder/layer_0/kernel"
  assert leaves["step"]["target_path"] == "step"


def test_show_with_rename_marks_the_rules_that_matched_no_path(source, run):
  """A prefix written as for `re.sub` matches no path whole: `show` names
  it under "rename rules that matched no path", with the rule that would
  match; a rule that matched is not named there."""
  r = run("show", source, "--rename", "^params/", "weights/",
          "--rename", "step", "count")
  assert r.returncode == 0, r.stderr
  out = r.stdout
  assert re.search(r"^  count\s+step\s+int = 3$", out, re.M)
  assert re.search(rf"^  {KERNEL}\s+float32\[8,16\]", out, re.M)
  marked = out.split("rename rules that matched no path:\n")[1]
  assert marked.startswith(
      "  '^params/' -> 'weights/' (it matches the start of"
      " 'params/params/Dense_0/bias', as re.match reads a pattern;"
      " '^params/(.*)' -> r'weights/\\1' matches it whole)\n"
      "  (a rule's pattern matches a whole checkpoint path (re.fullmatch),"
      " as r'encoder/(.*)' -> r'backbone/\\1' renames 'encoder/x' to"
      " 'backbone/x')\n"), out
  assert "'step' -> 'count'" not in out

  r = run("show", source, "--json", "--rename", "^params/", "weights/",
          "--rename", "step", "count")
  assert r.returncode == 0, r.stderr
  [rule] = json.loads(r.stdout)["unmatched_rules"]
  assert rule["pattern"] == "^params/" and rule["replacement"] == "weights/"
  assert "the start of 'params/params/Dense_0/bias'" in rule["hint"]


def test_show_with_rename_marks_no_rule_where_every_rule_matched(source,
                                                                 run):
  r = run("show", source, "--rename", "step", "count")
  assert r.returncode == 0, r.stderr
  assert "matched no path" not in r.stdout


@pytest.mark.parametrize("rules, message", [
    (["(", "x"], "rename rule '(': not a regular expression"),
    ([r"params/params/Dense_\d/(.*)", r"params/\1"],
     "the same target path 'params/bias'"),
])
def test_show_with_a_wrong_rename_is_a_usage_error(source, run, rules,
                                                   message):
  r = run("show", source, "--rename", *rules)
  assert r.returncode == 2
  assert r.stderr.startswith("flax-ckpt show: ") and message in r.stderr
  assert r.stdout == ""
