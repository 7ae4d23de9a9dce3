"""`python -m flax_ckpt_plugin`: the `flax-ckpt` command line (see cli.py)."""

import sys

from flax_ckpt_plugin.tools.cli import main

if __name__ == "__main__":
  sys.exit(main())
