"""The typed records of a step's manifest: `Manifest`, `LeafRecord`,
`ShardRecord`, and the dtypes their arrays may have.

`manifest` builds them from a step's `manifest.json`, validated once;
readers then use their attributes and trust them. Nothing here imports JAX
(dtypes come from numpy and `ml_dtypes`, the dtype library JAX itself
uses), so the CLI starts quickly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Iterable, Iterator

import crc32c
import ml_dtypes
import numpy as np

from flax_ckpt_plugin.errors import CheckpointCorruptedError

Index = tuple[tuple[int, int], ...]
SCALAR_KINDS = ("int", "float", "bool")
# Every shard carries a CRC-32C per block of this many bytes (the last block
# may be shorter), so a reader of part of a shard verifies whole blocks only.
CHECKSUM_BLOCK = 4 << 20
ARRAY_KINDS = ("array", "numpy")


def _ml_dtypes_by_name() -> dict[str, np.dtype]:
  """'bfloat16' -> dtype(ml_dtypes.bfloat16), for every type ml_dtypes has."""
  table = {}
  for name in dir(ml_dtypes):
    obj = getattr(ml_dtypes, name)
    if not isinstance(obj, type) or name.startswith("_"):
      continue
    try:
      dtype = np.dtype(obj)
    except TypeError:
      continue  # finfo, iinfo.
    if dtype.name == name:
      table[name] = dtype
  return table


_ML_DTYPES = _ml_dtypes_by_name()


def is_python_scalar(x: Any) -> bool:
  """A Python bool, int or float, which the manifest holds as a value.

  Not a numpy scalar, though `np.float64` is a Python `float` too: it is
  saved as an array of shape () and restored as its numpy type.
  """
  return isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)


# Until this time (2026-11-24 05:40 UTC) the writer stored a big-endian
# numpy leaf as it was, big-endian, under its name ('>f4'); steps created
# since hold every leaf little-endian under its canonical name. Manifests
# record no writer version, so their `created_unix` tells which wrote them.
BIG_ENDIAN_WRITTEN_UNTIL = 1795498842


def parse_dtype(name: Any, where: str, *,
                big_endian_ok: bool = False) -> np.dtype:
  """A numeric dtype from its manifest name; anything else is corruption.

  Accepts what the writer writes, `str(dtype)` of a jax or numpy array
  (little-endian: the data files hold little-endian values): the numpy
  names and those of `ml_dtypes` (`bfloat16`, `float8_e4m3fn`, `int4`,
  ...), and nothing else that numpy would parse: `>f4` would read the
  bytes the other way round, and `f4` or `single` are names no writer
  wrote. `big_endian_ok`: the step predates `BIG_ENDIAN_WRITTEN_UNTIL`,
  and big-endian names such as `>f4` are what its writer wrote.

  Raises:
    CheckpointCorruptedError: `name` names no dtype, or an object,
      structured or zero-size one, or is not a name the format writes; the
      message starts with `where`.
  """
  dtype = _ML_DTYPES.get(name) if isinstance(name, str) else None
  if dtype is None:
    if not isinstance(name, str):  # np.dtype(None) would be float64.
      raise CheckpointCorruptedError(f"{where}: unknown dtype {name!r:.60}")
    try:
      dtype = np.dtype(name)
    except (TypeError, ValueError, SyntaxError) as e:  # "," is parsed.
      raise CheckpointCorruptedError(
          f"{where}: unknown dtype {name!r:.60}") from e
  if dtype.hasobject or dtype.names is not None or dtype.itemsize == 0:
    raise CheckpointCorruptedError(f"{where}: dtype {name!r} is not allowed")
  if dtype.byteorder == ">" and big_endian_ok:
    return dtype
  if dtype.byteorder == ">" or (name not in _ML_DTYPES
                                and str(dtype) != name):
    raise CheckpointCorruptedError(
        f"{where}: dtype {name!r:.60} is not one the format writes (the"
        " little-endian names of numpy and ml_dtypes, such as 'float32' or"
        " 'bfloat16')")
  return dtype


def describe(dtype: np.dtype, shape: Iterable[int]) -> str:
  """'float32[512,10]': how errors and the CLI show an array's type."""
  dtype = np.dtype(dtype)
  name = dtype.str if dtype.byteorder == ">" else dtype.name  # '>f4'.
  return f"{name}[{','.join(str(d) for d in shape)}]"


@dataclasses.dataclass(frozen=True)
class ShardRecord:
  """One block of an array: `index` of the global array, at `offset` of `file`.

  Attributes:
    file: the data file's name, relative to the step directory.
    offset: the block's first byte in `file`.
    nbytes: the block's size in bytes.
    index: [start, stop) per axis of the global array.
    crc32c: the CRC-32C of each `Manifest.checksum_block_bytes` of the block.
  """
  file: str
  offset: int
  nbytes: int
  index: Index
  crc32c: tuple[int, ...]

  @property
  def index_list(self) -> list[list[int]]:
    """`index` as the manifest writes it, for messages: [[0, 16], [0, 4]]."""
    return [list(r) for r in self.index]


@dataclasses.dataclass(frozen=True)
class LeafRecord:
  """One leaf of the saved tree.

  Attributes:
    path: the key path joined with '/', e.g. 'params/dense_1/kernel'.
    keys: the exact key path, one single-key dict per level (docs/format.md).
    kind: 'array', 'numpy' (array kinds) or 'int', 'float', 'bool'.
    dtype: the array kinds' dtype; None for Python scalars.
    shape: the global shape; () for Python scalars.
    shards: where the array kinds' values are, sorted by index.
    value: a Python scalar's value; None for arrays.
    key_impl: the PRNG impl of typed key data, e.g. 'threefry2x32', or None.
  """
  path: str
  keys: tuple[Any, ...]
  kind: str
  dtype: np.dtype | None
  shape: tuple[int, ...]
  shards: tuple[ShardRecord, ...] = ()
  value: bool | int | float | None = None
  key_impl: str | None = None

  @property
  def is_array(self) -> bool:
    return self.kind in ARRAY_KINDS

  @property
  def is_scalar(self) -> bool:
    return self.kind in SCALAR_KINDS

  @property
  def nbytes(self) -> int:
    """Bytes of array data (0 for Python scalars)."""
    if self.dtype is None:
      return 0
    return math.prod(self.shape) * self.dtype.itemsize

  def describe(self) -> str:
    """'float32[512,10]', or 'Python int 3', for messages."""
    if self.is_scalar:
      return f"Python {self.kind} {self.value!r}"
    desc = describe(self.dtype, self.shape)
    if self.key_impl is not None:
      desc += f" (key data of PRNG impl {self.key_impl})"
    return desc


@dataclasses.dataclass(frozen=True)
class DataStateRecord:
  """A manifest's entry for one process's data state file (see
  `datastate`)."""
  file: str
  encoding: str
  nbytes: int
  crc32c: int


@dataclasses.dataclass(frozen=True)
class Manifest:
  """A step's validated `manifest.json` (see docs/format.md for each field).

  Informational fields that are absent or of the wrong type (`created`,
  `created_unix`, `process_count`, `byte_order`) are None: they never stop
  a restore.
  """
  format: str
  format_version: int
  step: int
  created: str | None
  created_unix: float | None
  process_count: int | None
  byte_order: str | None
  files: dict[str, int]
  checksum_algorithm: str
  checksum_block_bytes: int
  leaves: tuple[LeafRecord, ...]
  extra: Any = None
  metrics: Any = None
  # For a step of one process's shards (the local tier): that process's
  # index and the job's process count; None for a whole step.
  scope: tuple[int, int] | None = None
  # Per process index, its data state's file (see `datastate`); None if
  # the step has none.
  data_states: dict[int, DataStateRecord] | None = None
  # The writer's retention policy when it saved the step, as its JSON
  # (informational; `retention.Policy.from_json` reads it).
  retention: Any = None

  @property
  def total_bytes(self) -> int:
    """Bytes of array data of the whole checkpoint (all processes)."""
    return sum(leaf.nbytes for leaf in self.leaves)

  @property
  def leaf_by_path(self) -> dict[str, LeafRecord]:
    return {leaf.path: leaf for leaf in self.leaves}


def chunk_regions(region: Index, itemsize: int, limit: int
                  ) -> Iterator[Index]:
  """`region` cut into pieces of at most `limit` bytes (at least one
  element each), consecutive in C order: each piece's values follow the
  previous piece's in the region's flattened order, so a writer can stream
  them one after the other.

  Pieces are slabs along the first axis whose trailing part fits `limit`,
  for each index of the axes before it.
  """
  shape = [hi - lo for lo, hi in region]
  if math.prod(shape) == 0:
    return
  k = 0  # The first axis whose trailing slab of one index fits `limit`.
  while k < len(shape) and math.prod(shape[k + 1:]) * itemsize > limit:
    k += 1
  if k == len(shape):  # A scalar, or one element is over the limit.
    k = max(len(shape) - 1, 0)
  if not shape:
    yield region
    return
  step = max(1, limit // (math.prod(shape[k + 1:]) * itemsize))
  for outer in itertools.product(*(range(lo, hi) for lo, hi in region[:k])):
    head = tuple((i, i + 1) for i in outer)
    lo, hi = region[k]
    for a in range(lo, hi, step):
      yield head + ((a, min(a + step, hi)),) + tuple(region[k + 1:])


def intersect(a: Index, b: Index) -> Index | None:
  """The region two regions share; None if they do not overlap."""
  out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
  if any(lo >= hi for lo, hi in out):
    return None
  return out


def held_elements(shards: Iterable[ShardRecord], region: Index) -> int:
  """How many elements of `region` the (non-overlapping) `shards` hold."""
  return sum(math.prod(hi - lo for lo, hi in inter) for inter in (
      intersect(s.index, region) for s in shards) if inter is not None)


def block_checksums(buf: memoryview, block: int = CHECKSUM_BLOCK) -> list[int]:
  """CRC-32C of each `block`-byte block of `buf` (one for an empty buffer)."""
  if not buf:
    return [crc32c.crc32c(b"")]
  return [crc32c.crc32c(buf[i:i + block]) for i in range(0, len(buf), block)]
