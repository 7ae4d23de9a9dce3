"""`flax-ckpt coordinator`: JAX's coordination service in a process of its
own, so that any trainer, process 0 included, may die and the others go on.

    flax-ckpt coordinator --port P --num-processes N
                          [--heartbeat-timeout S] [--bind ADDRESS]

The trainers join it with `flax_ckpt_plugin.initialize(ADDRESS:P, N, i)`
instead of `jax.distributed.initialize` (see `multihost.runtime`). It has
no devices and does nothing else: it says where it listens and with what
settings, refuses a port in use before anything binds, and ends with
status 0 on SIGTERM or SIGINT. A launcher runs it on a host of its own, or
beside the job on a node that outlives the trainers (docs/fault_tolerance.md).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import threading
from typing import TextIO

from flax_ckpt_plugin.tools.commands import CliError
from flax_ckpt_plugin.tools.commands import EXIT_IO
from flax_ckpt_plugin.tools.commands import EXIT_OK
from flax_ckpt_plugin.tools.commands import PROG

SHUTDOWN_SECS = 5.0  # The most the service's shutdown is waited for.


def add_parser(sub: argparse._SubParsersAction, epilog: str) -> None:  # pylint: disable=protected-access
  text = ("Run JAX's coordination service for a job, in this process alone"
          " (the trainers call flax_ckpt_plugin.initialize), so that any"
          " trainer, process 0 included, may die and the others go on.")
  p = sub.add_parser("coordinator", help=text, description=text,
                     epilog=epilog,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--port", type=int, required=True, help="the TCP port")
  p.add_argument("--num-processes", type=int, required=True, metavar="N",
                 help="the trainer processes of the job")
  p.add_argument("--heartbeat-timeout", type=int, default=100, metavar="S",
                 help="seconds without a heartbeat after which a process"
                 " counts as lost (default 100; give initialize() the same)")
  p.add_argument("--bind", default="[::]", metavar="ADDRESS",
                 help="the address to listen on (default [::], every"
                 " address)")
  p.set_defaults(func=cmd_coordinator)


def cmd_coordinator(args: argparse.Namespace, out: TextIO) -> int:
  """Serves until SIGTERM or SIGINT; `EXIT_IO` if the port is in use."""
  # JAX is imported here alone: the other commands start without it.
  from flax_ckpt_plugin.multihost import runtime  # pylint: disable=g-import-not-at-top
  if args.num_processes < 1:
    raise CliError("--num-processes must be at least 1", code=2)
  stop = threading.Event()
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda *_: stop.set())
  try:
    service = runtime.serve(args.port, args.num_processes, bind=args.bind,
                            heartbeat_timeout_secs=args.heartbeat_timeout)
  except OSError as e:
    if e.errno != errno.EADDRINUSE:
      raise
    raise CliError(str(e.strerror), code=EXIT_IO) from None
  print(f"{PROG} coordinator: the coordination service of"
        f" {args.num_processes} processes listens on {args.bind}:{args.port}"
        f" (heartbeat timeout {args.heartbeat_timeout} s; recoverable: a"
        " process that dies does not end the others, and one relaunched"
        " rejoins). SIGTERM ends it.", file=out, flush=True)
  while not stop.wait(1.0):
    pass
  # The service's shutdown may wait for clients that never said goodbye
  # (a process killed): at most SHUTDOWN_SECS, then the process ends
  # anyway (nothing of the service outlives it).
  ending = threading.Thread(target=service.shutdown, daemon=True)
  ending.start()
  ending.join(SHUTDOWN_SECS)
  print(f"{PROG} coordinator: stopped", file=out, flush=True)
  if ending.is_alive():
    out.flush()
    os._exit(EXIT_OK)  # pylint: disable=protected-access
  return EXIT_OK

