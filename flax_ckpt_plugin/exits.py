"""Work to run when the program exits, before it stops its threads.

`threading._register_atexit` runs a function once the main thread has
returned (or called `sys.exit`), before the interpreter joins non-daemon
threads and before `atexit` handlers, JAX's shutdown of the coordination
service among them (concurrent.futures relies on it too). Plain `atexit`
is the fallback, registered after `jax.distributed` usually is, so it
still runs before JAX's own shutdown.
"""

from __future__ import annotations

import atexit
import threading
from typing import Callable


def before_exit(fn: Callable[[], None]) -> bool:
  """Has `fn()` run when the program exits (see the module's docstring).

  Returns:
    False if the interpreter is exiting already (then `fn` runs with the
    `atexit` handlers, if at all): the caller should start nothing that
    the exit would have to wait for or stop.
  """
  register = getattr(threading, "_register_atexit", None)
  try:
    if register is None:
      atexit.register(fn)  # Another Python: the fallback.
      return True
    register(fn)
    return True
  except RuntimeError:  # "can't register atexit after shutdown"
    atexit.register(fn)
    return False


_once: set[Callable[[], None]] = set()
_once_lock = threading.Lock()


def once_before_exit(fn: Callable[[], None]) -> None:
  """`before_exit(fn)`, the first time it is asked for `fn` only (a module's
  hook that every new object of it asks for)."""
  with _once_lock:
    if fn in _once:
      return
    _once.add(fn)
  before_exit(fn)
