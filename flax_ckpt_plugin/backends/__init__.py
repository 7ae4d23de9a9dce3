"""Where steps live: one storage interface and its implementations (local disks, file systems in memory, object stores), their files and the names of things in a checkpoint directory."""

# The implementations register in the interface's table by scheme.
from flax_ckpt_plugin.backends import registry as _registry  # noqa: E402,F401
