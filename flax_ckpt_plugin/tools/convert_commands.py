"""The commands of `flax-ckpt` (`cli`) that convert checkpoints: export (to
safetensors or npz, `exporting`) and import-orbax (a step Orbax wrote,
`importer`), each `cmd_NAME(args, out) -> exit code` as in `commands`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from flax_ckpt_plugin.tools.commands import check_step
from flax_ckpt_plugin.tools.commands import CliError
from flax_ckpt_plugin.tools.commands import existing_dir
from flax_ckpt_plugin.tools.commands import EXIT_EXISTS
from flax_ckpt_plugin.tools.commands import EXIT_OK
from flax_ckpt_plugin.tools.commands import EXIT_USAGE
from flax_ckpt_plugin.tools.commands import finalized
from flax_ckpt_plugin.tools.commands import leaf_summary
from flax_ckpt_plugin.tools.commands import leaf_type
from flax_ckpt_plugin.tools.commands import PROG
from flax_ckpt_plugin.tools.commands import read_manifest
from flax_ckpt_plugin.tools.inventory import table
from flax_ckpt_plugin.tools.inventory import zero_d_values
from flax_ckpt_plugin.tools.verify import human_size


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
  from flax_ckpt_plugin.tools import exporting  # pylint: disable=g-import-not-at-top
  directory = existing_dir(args.directory)
  if args.step is None:
    finalized(directory, args.directory)
  else:
    check_step(directory, args.directory, args.step)
  try:
    result = exporting.export(
        args.directory, args.out, step=args.step, format=args.format,
        only=args.only or (), max_file_bytes=args.max_file_size,
        progress=None if args.quiet else sys.stderr)
  except (exporting.ExportError,
          exporting.SafetensorsNotInstalledError) as e:
    raise CliError(str(e), EXIT_USAGE) from e
  except FileExistsError as e:
    raise CliError(str(e), EXIT_EXISTS) from e
  plural = "" if result.arrays == 1 else "s"
  out.write(f"exported step {result.step} of {args.directory} to {args.out}"
            f" ({result.format}): {result.arrays} array{plural},"
            f" {human_size(result.nbytes)}\n")
  for path in result.written:
    out.write(f"  {path}\n")
  if result.scalars:
    where = ("the metadata" if result.format == "safetensors"
             else result.written[-1].name)
    out.write(f"in {where}: " + ", ".join(
        f"{k} = {v!r}" for k, v in result.scalars.items()) + "\n")
  return EXIT_OK


# -- import-orbax --------------------------------------------------------------

# Leaves that import-orbax lists; `show` lists them all.
_IMPORT_LEAVES_SHOWN = 30


def _join(directory: str, step: int) -> str:
  return f"{directory.rstrip('/')}/{step}"


def cmd_import_orbax(args: argparse.Namespace, out: TextIO) -> int:
  # The one command that needs JAX (and tensorstore, for Orbax's arrays). It runs on the host, never on an accelerator a job may be using.
  if "jax" not in sys.modules:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from flax_ckpt_plugin.tools import importer  # pylint: disable=g-import-not-at-top
  try:
    result = importer.import_orbax(args.source, args.dest, item=args.item,
                                       step=args.step)
  except (importer.TensorstoreNotInstalledError,
          importer.OrbaxImportError) as e:
    raise CliError(str(e), EXIT_USAGE) from e
  except FileExistsError as e:
    raise CliError(str(e), EXIT_EXISTS) from e
  found, step = result.source, result.source.step
  m = read_manifest(result.directory, step)
  values = zero_d_values(result.path, m)
  if args.json:
    out.write(json.dumps({
        "source": args.source, "item": found.item,
        "tree_dir": os.fspath(found.tree_dir), "directory": args.dest,
        "step": step, "path": _join(args.dest, step),
        "total_bytes": m.total_bytes, "leaf_count": len(m.leaves),
        "leaves": [leaf_summary(leaf, values) for leaf in m.leaves],
    }, indent=1) + "\n")
    return EXIT_OK
  item = "" if found.item is None else f" (Orbax item {found.item!r})"
  out.write(
      f"imported {args.source}{item} as step {step} of {args.dest}\n"
      f"step dir:  {_join(args.dest, step)} (finalized, with"
      f" {m.checksum_algorithm} checksums)\n"
      f"size:      {human_size(m.total_bytes)} of array data"
      f" ({m.total_bytes} bytes)\n"
      f"leaves:    {len(m.leaves)}\n")
  shown = m.leaves[:_IMPORT_LEAVES_SHOWN]
  if shown:
    rows = [["PATH", "TYPE", "BYTES"]]
    rows += [[leaf.path, leaf_type(leaf, values),
              "" if leaf.is_scalar else human_size(leaf.nbytes)]
             for leaf in shown]
    table(rows, out, indent="  ")
  if len(m.leaves) > len(shown):
    out.write(f"  ... and {len(m.leaves) - len(shown)} more: `{PROG} show"
              f" {args.dest} {step}` lists them all\n")
  return EXIT_OK
