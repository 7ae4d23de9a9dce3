"""`load_safetensors` of GPT-2 weights on N processes x 2 devices.

    safetensors_load.py FOLDER WIDTH LAYERS VOCAB POSITIONS

FOLDER holds GPT-2's tensors as `_gpt2.write` wrote them (any width);
every process loads them into an abstract Flax target of linen names
(`_gpt2.RENAME`), every leaf split over all devices along its first axis
that divides evenly (else replicated), and reports what it read against
its share. Prints {"nbytes": bytes this process read (the log line of
`load_safetensors`), "share": the bytes of the regions its devices hold,
"total": the target's bytes, "same": whether every shard it holds is bit
for bit `safetensors.numpy.load_file` of the files under the mapping,
"secs": the load's seconds, "rss_before_mb" and "rss_peak_mb": this
process's resident memory before and at its peak during the load (before
the reference is read)}.
"""

import logging
import os
import resource
import sys
import time

import _setup

_setup.init()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import _gpt2
import flax_ckpt_plugin

FOLDER = sys.argv[1]
WIDTH, LAYERS, VOCAB, POSITIONS = (int(a) for a in sys.argv[2:6])
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
n = mesh.size


def spec(shape):
  for axis, d in enumerate(shape):
    if d % n == 0:
      return P(*([None] * axis + ["fsdp"]))
  return P()


def nest(flat):
  root = {}
  for path, leaf in flat.items():
    node = root
    *head, last = path.split("/")
    for k in head:
      node = node.setdefault(k, {})
    node[last] = leaf
  return root


shapes = _gpt2.flax_shapes(width=WIDTH, layers=LAYERS, vocab=VOCAB,
                           positions=POSITIONS)
flat_target = {p: jax.ShapeDtypeStruct(s, np.float32,
                                       sharding=NamedSharding(mesh, spec(s)))
               for p, s in shapes.items()}
target = nest(flat_target)


class _Reads(logging.Handler):
  nbytes: list[int] = []

  def emit(self, record):
    # "[process=N][thread=...] safetensors FOLDER: read %d bytes of ...".
    if "] safetensors " in record.getMessage() and " bytes of " in (
        record.getMessage()):
      self.nbytes.append(record.args[1])


logging.getLogger("flax_ckpt_plugin").addHandler(_Reads())


def rss_mb():
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


rss_before = rss_mb()
t0 = time.perf_counter()
loaded = flax_ckpt_plugin.load_safetensors(FOLDER, target,
                                           rename=_gpt2.RENAME)
jax.block_until_ready(loaded)
secs = time.perf_counter() - t0
rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

share = 0
for path, t in flat_target.items():
  regions = {tuple(s.indices(d)[:2] for s, d in zip(index, t.shape))
             for index in t.sharding.addressable_devices_indices_map(
                 t.shape).values()}
  share += sum(int(np.prod([hi - lo for lo, hi in r])) for r in regions) * 4

from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
reference = {}
for name in sorted(os.listdir(FOLDER)):
  if name.endswith(".safetensors"):
    for tensor, value in load_file(os.path.join(FOLDER, name)).items():
      if _gpt2.flax_path(tensor) is not None:
        reference[_gpt2.flax_path(tensor)] = value
flat_loaded = dict(zip(
    ("/".join(str(k.key) for k in kp) for kp, _ in
     jax.tree_util.tree_flatten_with_path(loaded)[0]),
    jax.tree_util.tree_leaves(loaded)))
same = sorted(flat_loaded) == sorted(reference) and all(
    np.asarray(s.data).tobytes() == reference[p][s.index].tobytes()
    for p, arr in flat_loaded.items() for s in arr.addressable_shards)
_setup.emit({"nbytes": _Reads.nbytes[-1] if _Reads.nbytes else None,
             "share": share,
             "total": sum(int(np.prod(s)) * 4 for s in shapes.values()),
             "same": bool(same), "secs": secs,
             "rss_before_mb": rss_before, "rss_peak_mb": rss_peak})
