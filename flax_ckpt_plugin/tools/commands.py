"""The commands of `flax-ckpt` (`cli`) that read or prune a directory: list,
show, verify and prune, each `cmd_NAME(args, out) -> exit code`; and what
every command shares (`CliError`, the exit codes, finding a step). export
and import-orbax are beside what they run (`exporting.cmd_export`,
`importer.cmd_import_orbax`).

Each writes its report to `out` and raises `CliError` for an expected
failure (one line on stderr, an exit code); `cli.main` parses the arguments
and turns the other errors into exit codes. `inventory`, `manifest`,
`reader` and `verify` read the steps without JAX (`exporting` too, with
the `safetensors` package for that format); only import-orbax imports JAX,
and tensorstore to read Orbax's arrays (`importer`, `zarr_tree`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from etils import epath

from flax_ckpt_plugin.format import directory as directory_lib
from flax_ckpt_plugin.save import atomicity
from flax_ckpt_plugin.backends import registry
from flax_ckpt_plugin.format import manifest as manifest_lib
from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.tools.inventory import committed_unix
from flax_ckpt_plugin.tools.inventory import human_age
from flax_ckpt_plugin.tools.inventory import retention_view
from flax_ckpt_plugin.tools.inventory import scan
from flax_ckpt_plugin.tools.inventory import size_and_mtime
from flax_ckpt_plugin.tools.inventory import table
from flax_ckpt_plugin.tools.inventory import zero_d_values
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.format.records import describe
from flax_ckpt_plugin.restore import renaming
from flax_ckpt_plugin.tools.verify import Progress
from flax_ckpt_plugin.tools.verify import human_size
from flax_ckpt_plugin.tools.verify import verify_step

PROG = "flax-ckpt"
EXIT_OK = 0  # Success.
EXIT_CORRUPT = 1  # A checkpoint failed verification or its manifest is bad.
EXIT_USAGE = 2  # argparse's own code for bad arguments.
EXIT_NOT_FOUND = 3  # No such directory or step, or no finalized step.
EXIT_IO = 4  # Could not read or delete (permission denied, I/O error).
EXIT_EXISTS = 5  # import-orbax, export: the destination already exists.

class CliError(Exception):
  """An expected failure: one line on stderr and an exit code."""

  def __init__(self, message: str, code: int):
    super().__init__(message)
    self.code = code

# -- formatting ----------------------------------------------------------------


def _dumps(value: Any) -> str:
  return json.dumps(value, sort_keys=True)


# -- reading a directory -------------------------------------------------------


def existing_dir(name: str) -> epath.Path:
  # Object stores go through fsspec (see object_store).
  directory, _ = registry.make_path(name)
  if not directory.exists():
    raise CliError(f"directory {name} does not exist", EXIT_NOT_FOUND)
  if not directory.is_dir():
    raise CliError(f"{name} is not a directory", EXIT_NOT_FOUND)
  return directory


def finalized(directory: epath.Path, name: str) -> list[int]:
  steps = directory_lib.finalized_steps(directory)
  if not steps:
    raise CliError(f"no finalized step in {name}", EXIT_NOT_FOUND)
  return steps


def check_step(directory: epath.Path, name: str, step: int) -> None:
  if directory_lib.is_finalized(directory / str(step)):
    return
  others = [name for name in (str(step), f"{step}{atomicity.TMP_SUFFIX}",
                               f"{step}{atomicity.DELETING_SUFFIX}")
            if (directory / name).exists()]
  why = (f"it is not finalized (found {', '.join(others)})" if others
         else "no such step")
  raise CliError(f"step {step} in {name}: {why}; finalized steps:"
                 f" {directory_lib.finalized_steps(directory)}", EXIT_NOT_FOUND)


def read_manifest(directory: epath.Path, step: int) -> manifest_lib.Manifest:
  """The validated manifest of a finalized step."""
  step_dir = directory / str(step)
  try:
    return manifest_lib.read(step_dir, step)
  except FileNotFoundError as e:
    if not directory_lib.is_finalized(step_dir):  # Deleted since it was listed.
      raise CliError(f"step {step} in {directory} was deleted meanwhile"
                     " (retention of a running job?)", EXIT_NOT_FOUND) from e
    raise CheckpointCorruptedError(str(e)) from e  # Finalized: damaged.


# -- list ----------------------------------------------------------------------


def cmd_list(args: argparse.Namespace, out: TextIO) -> int:
  directory = existing_dir(args.directory)
  entries = scan(directory)
  now = time.time()
  for e in entries:
    e["age_secs"] = (None if e["time_unix"] is None
                     else round(now - e["time_unix"], 1))
  writer = directory_lib.current_writer(directory)
  policy = retention_view(directory, entries)
  if args.json:
    out.write(json.dumps({
        "directory": args.directory, "steps": entries, "writer": writer,
        "retention": policy and policy.to_json()}, indent=1) + "\n")
    return EXIT_OK
  if not entries:
    out.write(f"no checkpoints in {args.directory}\n")
  else:
    metric = policy.best_metric if policy and policy.keep_best else None
    rows = [["STEP", "STATE", "SIZE", "AGE", "NAME"]
            + ([metric.upper()] if metric else [])
            + (["KEPT BY"] if policy else [])]
    for e in entries:
      row = [str(e["step"]), e["state"], human_size(e["bytes"]),
             human_age(e["age_secs"]), e["name"]]
      if metric:
        value = policy.metric_of(e.get("metrics"))
        row.append("-" if value is None else f"{value:.6g}")
      if policy:
        kept_by = e.get("kept_by")
        row.append("" if kept_by is None else
                   ", ".join(kept_by) or "none: retention deletes it")
      rows.append(row)
    table(rows, out)
    counts = {s: sum(e["state"] == s for e in entries)
              for s in ("finalized", "unfinished", "deleting", "damaged")}
    out.write(", ".join(f"{n} {s}" for s, n in counts.items() if n)
              + f"; {human_size(sum(e['bytes'] for e in entries))} in all\n")
  if writer:
    opened = writer.get("opened", "?")
    count = writer.get("process_count", "?")
    out.write(f"last writer: pid {writer.get('pid', '?')} on"
              f" {writer.get('host', '?')} ({count} process"
              f"{'' if count == 1 else 'es'}) claimed the directory at"
              f" {opened}\n")
  return EXIT_OK


# -- show ----------------------------------------------------------------------


def leaf_summary(leaf: LeafRecord, values: dict[str, Any]) -> dict[str, Any]:
  out = {"path": leaf.path, "kind": leaf.kind}
  if leaf.is_scalar:
    out["value"] = leaf.value
    return out
  out.update(dtype=leaf.dtype.name, shape=list(leaf.shape),
             nbytes=leaf.nbytes, shards=len(leaf.shards))
  if leaf.path in values:
    out["value"] = values[leaf.path]
  if leaf.key_impl is not None:
    out["key_impl"] = leaf.key_impl
  return out


def leaf_type(leaf: LeafRecord, values: dict[str, Any]) -> str:
  if leaf.is_scalar:
    return f"{leaf.kind} = {leaf.value!r}"
  if leaf.path in values:
    return (f"{describe(leaf.dtype, leaf.shape)} ="
            f" {values[leaf.path]!r}")
  desc = describe(leaf.dtype, leaf.shape)
  if leaf.kind == "numpy":
    desc += " (numpy)"
  if leaf.key_impl is not None:
    desc += f" (PRNG key data, {leaf.key_impl})"
  return desc


def _renaming(rules: list[list[str]]) -> renaming.Renaming:
  """`--rename PATTERN REPLACEMENT` rules; an empty REPLACEMENT drops."""
  try:
    return renaming.Renaming.of([(pattern, replacement or None)
                                 for pattern, replacement in rules])
  except renaming.RenameError as e:
    raise CliError(str(e), EXIT_USAGE) from e


def cmd_show(args: argparse.Namespace, out: TextIO) -> int:
  rename = _renaming(getattr(args, "rename", None) or [])
  directory = existing_dir(args.directory)
  if args.step is None:
    step = finalized(directory, args.directory)[-1]
  else:
    step = args.step
    check_step(directory, args.directory, step)
  m = read_manifest(directory, step)
  values = zero_d_values(directory / str(step), m)
  leaves = [leaf_summary(leaf, values) for leaf in m.leaves]
  if rename.renames:  # Where a restore with this rename puts each leaf.
    try:
      new = {old: p for p, old in rename.names(
          leaf.path for leaf in m.leaves).items()}
    except renaming.RenameError as e:
      raise CliError(str(e), EXIT_USAGE) from e
    for summary in leaves:
      summary["target_path"] = new.get(summary["path"])
  # Rules that rename nothing: most often a prefix written as for re.sub.
  unmatched = rename.unmatched(leaf.path for leaf in m.leaves)
  created = m.created_unix
  checksum = {"algorithm": m.checksum_algorithm,
              "block_bytes": m.checksum_block_bytes}
  info = {
      "directory": args.directory, "step": step,
      "format": m.format, "format_version": m.format_version,
      "created": m.created, "created_unix": created,
      "committed_unix": committed_unix(directory / str(step)),
      "process_count": m.process_count, "byte_order": m.byte_order,
      "checksum": checksum, "files": m.files,
      "total_bytes": m.total_bytes, "leaves": leaves,
      "extra": m.extra, "metrics": m.metrics,
  }
  if rename.renames:
    info["unmatched_rules"] = [u._asdict() for u in unmatched]
  if args.json:
    out.write(json.dumps(info, indent=1) + "\n")
    return EXIT_OK
  age = human_age(time.time() - created) if created is not None else "?"
  count, files = m.process_count, m.files
  out.write(
      f"step {step} in {args.directory}\n"
      f"created:   {'?' if m.created is None else m.created} ({age})\n"
      f"format:    {m.format} version {m.format_version}, written by"
      f" {count} process{'' if count == 1 else 'es'}\n"
      f"size:      {human_size(m.total_bytes)} of array data"
      f" ({m.total_bytes} bytes) in {len(files)}"
      f" file{'' if len(files) == 1 else 's'}\n"
      f"checksums: {m.checksum_algorithm} per"
      f" {human_size(m.checksum_block_bytes)} block\n"
      f"leaves:    {len(leaves)}\n")
  if leaves and rename.renames:
    rows = [["PATH", "CHECKPOINT PATH", "TYPE", "BYTES", "SHARDS"]]
    for leaf, summary in zip(m.leaves, leaves):
      target = summary["target_path"]
      rows.append([
          "(dropped)" if target is None else target,
          "" if target == leaf.path else leaf.path, leaf_type(leaf, values),
          "" if leaf.is_scalar else human_size(leaf.nbytes),
          "" if leaf.is_scalar else str(len(leaf.shards))])
    table(rows, out, indent="  ")
  elif leaves:
    rows = [["PATH", "TYPE", "BYTES", "SHARDS"]]
    rows += [[leaf.path, leaf_type(leaf, values),
              "" if leaf.is_scalar else human_size(leaf.nbytes),
              "" if leaf.is_scalar else str(len(leaf.shards))]
             for leaf in m.leaves]
    table(rows, out, indent="  ")
  if unmatched:
    out.write("rename rules that matched no path:\n")
    for rule in unmatched:
      out.write(f"  {rule.describe()}\n")
    out.write(f"  ({renaming.WHOLE_PATH})\n")
  for key in ("extra", "metrics"):
    text = _dumps(info[key])
    if len(text) > 70:
      text = "\n  " + json.dumps(info[key], sort_keys=True,
                                 indent=2).replace("\n", "\n  ")
    out.write(f"{key + ':':<10} {text}\n")
  return EXIT_OK


# -- verify --------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
  directory = existing_dir(args.directory)
  if args.step is None:
    steps = finalized(directory, args.directory)
  else:
    check_step(directory, args.directory, args.step)
    steps = [args.step]
  # Manifests first: the progress bar needs the total.
  manifests, results = {}, []
  for step in steps:
    try:
      manifests[step] = read_manifest(directory, step)
    except CliError:  # Deleted since it was listed.
      results.append({"step": step, "status": "gone", "problems": []})
    except CheckpointCorruptedError as e:
      results.append({"step": step, "status": "corrupt", "problems": [str(e)]})
    except OSError as e:
      results.append({"step": step, "status": "error",
                      "problems": [f"{directory / str(step)}: {e}"]})
  total = sum(s.nbytes for m in manifests.values()
              for leaf in m.leaves for s in leaf.shards)
  progress = Progress(total, sys.stderr, enabled=not args.quiet)

  def report(result: dict) -> None:
    if args.json:
      return
    progress.clear()
    step, status, nbytes = result["step"], result["status"], result.get("bytes")
    if status == "ok":
      out.write(f"step {step}: ok ({human_size(nbytes)} checked)\n")
    elif status == "gone":
      out.write(f"step {step}: deleted while it was verified (retention of a"
                " running job?); skipped\n")
    else:
      out.write(f"step {step}: {status.upper()}\n")
      for p in result["problems"]:
        out.write(f"  {p}\n")
    out.flush()

  for result in results:
    report(result)
  for step, manifest in manifests.items():
    before = progress.done
    status, problems = verify_step(directory, step, manifest, progress)
    if status != "ok" and not directory_lib.is_finalized(directory / str(step)):
      status, problems = "gone", []
    result = {"step": step, "status": status, "problems": problems,
              "bytes": progress.done - before}
    results.append(result)
    report(result)
  progress.finish()
  results.sort(key=lambda r: r["step"])
  if args.json:
    out.write(json.dumps({"directory": args.directory, "results": results},
                         indent=1) + "\n")
  corrupt = [r["step"] for r in results if r["status"] == "corrupt"]
  failed = [r["step"] for r in results if r["status"] == "error"]
  if corrupt:
    raise CliError(f"{len(corrupt)} of {len(steps)} steps in"
                   f" {args.directory} failed verification: steps {corrupt}",
                   EXIT_CORRUPT)
  if failed:
    raise CliError(f"could not read steps {failed} of {args.directory}",
                   EXIT_IO)
  return EXIT_OK


# -- prune ---------------------------------------------------------------------


def cmd_prune(args: argparse.Namespace, out: TextIO) -> int:
  if args.keep < 0:
    raise CliError(f"--keep must be >= 0, got {args.keep}", EXIT_USAGE)
  if args.keep == 0 and not args.force:
    raise CliError("--keep 0 would delete every finalized step; add --force"
                   " if that is what you want", EXIT_USAGE)
  directory = existing_dir(args.directory)
  steps = directory_lib.finalized_steps(directory)
  doomed = steps[:len(steps) - args.keep] if args.keep < len(steps) else []
  kept = [s for s in steps if s not in doomed]
  verb = "would delete" if args.dry_run else "deleted"
  for step in doomed:
    nbytes, _ = size_and_mtime(directory / str(step))
    if not args.dry_run:
      try:
        directory_lib.delete_step(directory, step)
      except FileNotFoundError:  # Retention of a running job was faster.
        out.write(f"step {step}: already gone\n")
        continue
      except OSError as e:
        raise CliError(f"could not delete step {step} in {args.directory}:"
                       f" {e}", EXIT_IO) from e
    out.write(f"{verb} step {step} ({human_size(nbytes)})\n")
    out.flush()
  if args.unfinished:
    entries = directory_lib.unfinished_entries(directory)
    if entries and not args.dry_run:
      print(f"{PROG} prune: warning: removing unfinished steps"
            f" {[e.name for e in entries]} of {args.directory}; a job saving"
            " there right now will fail its save", file=sys.stderr)
      entries = directory_lib.remove_unfinished(directory)
    for entry in entries:
      out.write(f"{verb} unfinished {entry.name}\n")
  out.write(f"kept {len(kept)} finalized step{'' if len(kept) == 1 else 's'}:"
            f" {kept}\n")
  return EXIT_OK


# -- export --------------------------------------------------------------------
