"""`flax-ckpt`: look at, verify, prune and export checkpoint directories.

    flax-ckpt list   DIR [--json]
    flax-ckpt show   DIR [STEP] [--json] [--rename PATTERN REPLACEMENT ...]
    flax-ckpt verify DIR [STEP] [--all] [--json] [-q]
    flax-ckpt prune  DIR --keep N [--dry-run] [--unfinished] [--force]
    flax-ckpt export DIR OUT [--step N] [--format safetensors|npz]
                     [--only PREFIX ...] [--max-file-size SIZE] [-q]
    flax-ckpt import-orbax ORBAX_STEP_DIR DEST_DIR [--item NAME] [--step N]
                           [--json]
    flax-ckpt coordinator --port P --num-processes N [--heartbeat-timeout S]
                          [--bind ADDRESS]

Also `python -m flax_ckpt_plugin ...`. Every command only reads, except
`prune`, which deletes through `directory.delete_step` and never claims the
directory as a writer, so it can run beside a training job; `export`,
which writes a new directory OUT of safetensors or npz files
(`exporting`); and `import-orbax`, which saves a step that Orbax wrote as
a new step of DEST_DIR with a `CheckpointManager` (`importer`,
`zarr_tree`); `coordinator` runs a job's coordination service
(`tools.coordinator`). Paths go through
`etils.epath`, so `gs://` and `s3://` directories work too. See docs/cli.md.
This module parses the arguments and maps errors to exit codes; the
commands themselves are in `commands`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from flax_ckpt_plugin.tools import coordinator
from flax_ckpt_plugin.tools.exporting import cmd_export
from flax_ckpt_plugin.tools.importer import cmd_import_orbax
from flax_ckpt_plugin.tools.commands import cmd_list
from flax_ckpt_plugin.tools.commands import cmd_prune
from flax_ckpt_plugin.tools.commands import cmd_show
from flax_ckpt_plugin.tools.commands import cmd_verify
from flax_ckpt_plugin.tools.commands import CliError
from flax_ckpt_plugin.tools.commands import EXIT_CORRUPT
from flax_ckpt_plugin.tools.commands import EXIT_IO
from flax_ckpt_plugin.tools.commands import EXIT_NOT_FOUND
from flax_ckpt_plugin.tools.commands import EXIT_OK
from flax_ckpt_plugin.tools.commands import PROG
from flax_ckpt_plugin.errors import CheckpointCorruptedError

EXIT_CODES_HELP = """\
exit codes:
  0  success
  1  a checkpoint failed verification (corrupt, truncated or missing data
     files) or its manifest is damaged; import-orbax: the Orbax step is
     damaged or holds strings
  2  usage error (bad arguments, --keep 0 without --force, what
     import-orbax needs: --step, --item, tensorstore, or what export
     needs: an --only prefix that matches, safetensors, a folder OUT for
     an export that must be split)
  3  directory or step not found, or no finalized step
  4  could not read or delete (permission denied, I/O error);
     coordinator: its port is in use
  5  import-orbax: DEST_DIR already holds that step; export: OUT exists
     (nothing was written)
"""

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def _size(text: str) -> int:
  """'5GB', '100MiB', '4096' -> bytes (argparse type)."""
  digits = text.rstrip("BbKkMmGgIi")
  unit = text[len(digits):].upper()
  try:
    value = int(float(digits) * _SIZE_UNITS[unit])
  except (ValueError, KeyError):
    raise argparse.ArgumentTypeError(
        f"not a size: {text!r} (e.g. 5GB, 500MB, 100MiB)") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
  return value


# -- entry point ---------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=PROG, description="Inspect, verify, prune and export"
      " flax_ckpt_plugin checkpoint directories (local paths, gs://, s3://),"
      " and import steps that Orbax wrote.",
      epilog=EXIT_CODES_HELP,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

  def add(name: str, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text,
                       epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", metavar="DIR", help="checkpoint directory")
    return p

  p = add("list", "List every step: finalized, unfinished and being deleted,"
          " with size and age.")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p.set_defaults(func=cmd_list)

  p = add("show", "Show one finalized step: leaves, dtypes, shapes, extra,"
          " metrics and metadata.")
  p.add_argument("step", metavar="STEP", type=int, nargs="?",
                 help="step to show (default: the newest finalized)")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p.add_argument("--rename", metavar=("PATTERN", "REPLACEMENT"), nargs=2,
                 action="append", default=[],
                 help="show each leaf under the path a restore with this"
                 " rename gives it: the first PATTERN (a regular expression)"
                 " that matches a whole path is replaced by REPLACEMENT"
                 " (\\1 for groups; '' drops the leaf); repeat for more"
                 " rules, tried in order")
  p.set_defaults(func=cmd_show)

  p = add("verify", "Read every shard and check its CRC-32C checksums.")
  p.add_argument("step", metavar="STEP", type=int, nargs="?",
                 help="step to verify (default: every finalized step)")
  p.add_argument("--all", action="store_true",
                 help="verify every finalized step (the default without STEP)")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p.add_argument("-q", "--quiet", action="store_true",
                 help="no progress on stderr")
  p.set_defaults(func=cmd_verify)

  p = add("prune", "Delete all but the newest N finalized steps. Does not"
          " claim the directory, so a training job writing there goes on.")
  p.add_argument("--keep", metavar="N", type=int, required=True,
                 help="finalized steps to keep (0 needs --force)")
  p.add_argument("--dry-run", action="store_true",
                 help="only print what would be deleted")
  p.add_argument("--unfinished", action="store_true",
                 help="also remove unfinished steps (.partial, no _COMMITTED,"
                 " .deleting); this fails the save of a job writing now")
  p.add_argument("--force", action="store_true", help="allow --keep 0")
  p.set_defaults(func=cmd_prune)

  p = add("export", "Write a step's arrays to safetensors or npz files in a"
          " new directory OUT, or to the one file OUT where it ends in .npz"
          " or .safetensors (safetensors needs the [export] extra).")
  p.add_argument("out", metavar="OUT",
                 help="the directory or file to create (local; must not"
                 " exist); an npz file gets its JSON beside it, OUT with"
                 " .json for .npz")
  p.add_argument("--step", metavar="N", type=int,
                 help="step to export (default: the newest finalized)")
  p.add_argument("--format", choices=("safetensors", "npz"),
                 default=None, help="default: the one OUT's suffix names,"
                 " else safetensors")
  p.add_argument("--only", metavar="PREFIX", nargs="+",
                 help="export only the leaves under these key paths (e.g."
                 " params, or params.Dense_0)")
  p.add_argument("--max-file-size", metavar="SIZE", type=_size,
                 default="5GB", help="split safetensors exports into files"
                 " of at most SIZE bytes of arrays, with an index (default:"
                 " 5GB)")
  p.add_argument("-q", "--quiet", action="store_true",
                 help="no progress on stderr")
  p.set_defaults(func=cmd_export)

  text = ("Convert a step that Orbax wrote (StandardSave, PyTreeSave) into a"
          " finalized step of DEST_DIR (needs the [orbax] extra).")
  p = sub.add_parser("import-orbax", help=text, description=text,
                     epilog=EXIT_CODES_HELP,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("source", metavar="ORBAX_STEP_DIR",
                 help="an Orbax step directory (e.g. ckpts/5), or one item"
                 " of it (ckpts/5/default); only read")
  p.add_argument("dest", metavar="DEST_DIR",
                 help="the flax_ckpt_plugin checkpoint directory to add the"
                 " step to")
  p.add_argument("--item", metavar="NAME",
                 help="the item of a CheckpointManager step to convert"
                 " (needed when it holds several PyTree items)")
  p.add_argument("--step", metavar="N", type=int,
                 help="the step number (default: from the directory's name,"
                 " e.g. 5 or checkpoint_5)")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p.set_defaults(func=cmd_import_orbax)
  coordinator.add_parser(sub, EXIT_CODES_HELP)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `flax-ckpt` (the console script and `python -m flax_ckpt_plugin`).

  Args:
    argv: the arguments after the program name; None reads `sys.argv`.

  Returns:
    The exit code: `EXIT_OK`, `EXIT_CORRUPT`, `EXIT_NOT_FOUND`, `EXIT_IO`,
    `EXIT_EXISTS` (`import-orbax` into a step that exists, `export` to an
    OUT that exists), or `EXIT_USAGE` for `prune --keep 0` without
    `--force`, for what `import-orbax` needs (`--step`, `--item`,
    tensorstore) and for what `export` needs (an `--only` prefix that
    matches a leaf, safetensors). Other bad
    arguments exit with `EXIT_USAGE` through argparse (`SystemExit`).
  """
  parser = _parser()
  args = parser.parse_args(argv)
  if getattr(args, "all", False) and args.step is not None:
    parser.error("verify: give STEP or --all, not both")
  try:
    return args.func(args, sys.stdout)
  except CliError as e:
    print(f"{PROG} {args.command}: {e}", file=sys.stderr)
    return e.code
  except BrokenPipeError:  # `flax-ckpt list DIR | head`.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK
  except CheckpointCorruptedError as e:
    print(f"{PROG} {args.command}: {e}", file=sys.stderr)
    return EXIT_CORRUPT
  except FileNotFoundError as e:
    print(f"{PROG} {args.command}: {e}", file=sys.stderr)
    return EXIT_NOT_FOUND
  except OSError as e:
    where = f": {e.filename}" if e.filename else ""
    print(f"{PROG} {args.command}: {e.strerror or e}{where}", file=sys.stderr)
    return EXIT_IO
  except KeyboardInterrupt:
    print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
    return 130
