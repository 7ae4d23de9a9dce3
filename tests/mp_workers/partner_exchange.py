"""Sends partner copies along the partner plan's first two steps with
`exchange.permute`: each process's bytes differ in content and length (one
sends none), and each receiver reports what arrived.

    partner_exchange.py

Prints {"sent": sha256 of this process's bytes, "received": {step: [sender,
sha256, length]}}.
"""

import hashlib

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

from flax_ckpt_plugin.tolerance import exchange
from flax_ckpt_plugin.tolerance import partners

me, n = _setup.PROCESS_ID, _setup.NUM_PROCESSES
ring = partners.Ring([f"host{p // 2}" for p in range(n)])
length = [1000003, 0, 17, 4096][me % 4]
mine = np.random.default_rng(me).integers(0, 256, length, dtype=np.uint8)
received = {}
for step in (1, 2):
  to = [ring.partner(p, step) for p in range(n)]
  got = exchange.permute(mine, to)
  received[step] = [to.index(me), hashlib.sha256(got.tobytes()).hexdigest(),
                    int(got.size)]
_setup.emit({"sent": hashlib.sha256(mine.tobytes()).hexdigest(),
             "length": length, "received": received})
