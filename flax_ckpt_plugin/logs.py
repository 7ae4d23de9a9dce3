"""The package's logger: lines carry `[process=N][thread=NAME]`.

Multi-host logs are merged by line; the prefix says which process and which
thread (the train loop, the commit thread, a restore worker) wrote a line.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("flax_ckpt_plugin")


def _process_index() -> int:
  # Read at each line, not at import: `jax.distributed.initialize` may come
  # after this package is imported. The CLI never logs through here, so it
  # does not import jax.
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index()


class ProcessLogger(logging.LoggerAdapter):
  """Prefixes log lines with `[process=N][thread=NAME]` for merged logs."""

  def process(self, msg, kwargs):
    return (f"[process={_process_index()}]"
            f"[thread={threading.current_thread().name}] {msg}", kwargs)


log = ProcessLogger(logger, {})
