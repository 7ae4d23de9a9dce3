"""Does a saved tree fit a restore target? Checked before any data is read.

Every leaf is matched by key path, shape and dtype, and every mismatch is
named in one message (`match_structure`); a Python scalar restores only
into a target of its kind that holds its value; PRNG key data only with
an impl JAX knows (`check_key_impl`). A dtype that differs is a mismatch
unless the restore casts (`cast=True`) and makes that conversion
(`refusal`): floating to floating of any width (bfloat16, float16,
float32, float64, the float8 kinds), complex to complex, and integer to
integer (`casting` makes them while the leaf is read). Nothing else:
floating to integer would drop fractions, complex to real the imaginary
part, and booleans and PRNG keys have no meaningful conversion. A
mismatch depends on the target only, so it is never taken for damage on
disk.
"""

from __future__ import annotations

from typing import Any, Callable

from etils import epath
import jax
import numpy as np

from flax_ckpt_plugin.errors import CheckpointCorruptedError
from flax_ckpt_plugin.errors import StructureMismatchError
from flax_ckpt_plugin.format.records import describe
from flax_ckpt_plugin.format.records import is_python_scalar
from flax_ckpt_plugin.format.records import LeafRecord
from flax_ckpt_plugin.restore.options import RestoreOptions

# A structure mismatch names at most this many leaves of each list, and this
# many leaves whose shape or dtype differs.
_MAX_LISTED = 10
_MAX_MISMATCHES = 20


def _count(names: list[str], limit: int) -> str:
  """The first `limit` of `names` (each as messages show it), and how many
  more there are."""
  more = len(names) - limit
  return ("[" + ", ".join(names[:limit]) + "]"
          + (f" and {more} more" if more > 0 else ""))


def check_key_impl(leaf: LeafRecord, where: str) -> None:
  """Checks that JAX can wrap `leaf`'s key data with its PRNG impl.

  Abstract (no data is read or computed); `restore_tree` calls it for every
  leaf before any data is read, once the structure matched: the impl is
  then the target's, registered with JAX (an impl this JAX lacks is a
  mismatch, since it depends on the environment, not damage).

  Raises:
    CheckpointCorruptedError: the impl is not registered with JAX, or the
      key data's shape or dtype do not fit it; the message starts with
      `where` and names the leaf.
  """
  if leaf.key_impl is None:
    return
  try:
    jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=leaf.key_impl),
                   jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
  except (TypeError, ValueError) as e:
    raise CheckpointCorruptedError(
        f"{where}, leaf {leaf.path!r}: key data of PRNG impl"
        f" {leaf.key_impl!r} cannot be restored: {e!s:.200}") from e


def kind(dtype: Any) -> str:
  """What a dtype's values mean: 'bool', 'int', 'float', 'complex',
  'key' (typed PRNG keys) or the dtype's name."""
  if jax.numpy.issubdtype(dtype, jax.dtypes.prng_key):
    return "key"
  for name, cat in (("bool", jax.numpy.bool_), ("int", jax.numpy.integer),
                    ("float", jax.numpy.floating),
                    ("complex", jax.numpy.complexfloating)):
    if jax.numpy.issubdtype(dtype, cat):
      return name
  return str(dtype)


_NAMES = {"bool": "boolean", "int": "integer", "float": "floating",
          "complex": "complex", "key": "PRNG key"}


def refusal(saved: np.dtype, target: Any) -> str | None:
  """Why a restore with `cast=True` does not convert `saved` to `target`;
  None when it does (equal dtypes included)."""
  src, dst = kind(saved), kind(target)
  if src == dst and src in ("int", "float", "complex"):
    return None
  names = f"{_NAMES.get(src, src)} to {_NAMES.get(dst, dst)}"
  return ("cast=True converts floating to floating and integer to integer"
          f" dtypes only, not {names}")


def _fits(value: bool | int | float, dtype: np.dtype) -> bool:
  """Whether `dtype` holds the Python scalar `value` (of the same kind)."""
  if isinstance(value, bool) or not isinstance(value, int):
    if isinstance(value, float) and np.isfinite(value):
      with np.errstate(over="ignore"):
        return bool(np.isfinite(np.asarray(value).astype(dtype)))
    return True
  info = jax.numpy.iinfo(dtype)
  return int(info.min) <= value <= int(info.max)


def _same_dtype(a: Any, b: np.dtype) -> bool:
  """Equal dtypes; byte order aside (the values are the same)."""
  a = np.dtype(a)
  return a == b or a.newbyteorder("=") == b.newbyteorder("=")


def _mismatch(path: str, saved: LeafRecord, target: Any,
              cast: bool = False) -> str | None:
  """Where `saved` cannot restore into `target`: both sides, else None.
  (`_castable` tells which of these `cast=True` would convert.)

  Depends on the target only, so a mismatch is never damage. A scalar
  restores only into a target of the same kind (bool, int, float) that
  holds its value: 0.7 never becomes an int 0, nor 2**40 an int32. An
  array of another dtype restores with `cast` where `casting` converts it.
  """
  def head() -> str:  # Only for a mismatch: 5000 leaves match in 0.1 s.
    return (f"leaf {_named(path, saved)}: checkpoint has {saved.describe()},"
            " target has")

  saved_cat = saved.kind if saved.is_scalar else kind(saved.dtype)
  if is_python_scalar(target):
    t_cat = {bool: "bool", int: "int", float: "float"}[type(target)]
    if saved.shape != () or saved.key_impl is not None or saved_cat != t_cat:
      return f"{head()} Python {type(target).__name__}"
    return None
  t_dtype = target.dtype
  is_key = jax.numpy.issubdtype(t_dtype, jax.dtypes.prng_key)
  if is_key != (saved.key_impl is not None):
    return f"{head()} {t_dtype}"
  if is_key:
    t_shape = tuple(jax.eval_shape(jax.random.key_data, target).shape)
    t_desc = lambda: f"{t_dtype}{list(target.shape)}"
    if t_dtype._impl.name != saved.key_impl:  # pylint: disable=protected-access
      return f"{head()} {t_desc()}"
  else:
    t_shape = tuple(np.shape(target))
    t_desc = lambda: describe(t_dtype, t_shape)
  if saved.dtype is None:  # A Python scalar saved; an array of shape () wanted.
    ok = t_shape == () and not is_key and kind(t_dtype) == saved_cat
    if ok and not _fits(saved.value, np.dtype(t_dtype)):
      return f"{head()} {t_desc()}, which cannot hold that value"
  else:
    ok = t_shape == saved.shape and (is_key
                                     or _same_dtype(t_dtype, saved.dtype))
    if not ok and cast and t_shape == saved.shape and not is_key:
      why = refusal(saved.dtype, t_dtype)
      return None if why is None else f"{head()} {t_desc()}: {why}"
  return None if ok else f"{head()} {t_desc()}"


def _named(path: str, saved: LeafRecord) -> str:
  """A leaf as messages name it: its target path, and its checkpoint path
  where a rename (`renaming`) gave it another."""
  if saved.path == path:
    return repr(path)
  return f"{path!r} (checkpoint {saved.path!r})"


def _castable(saved: LeafRecord, target: Any) -> bool:
  """Whether `saved` and `target` differ in a dtype alone, in a way that
  `cast=True` converts (for the hint of a mismatch without it)."""
  dtype = getattr(target, "dtype", None)
  return (saved.dtype is not None and saved.key_impl is None
          and dtype is not None and tuple(np.shape(target)) == saved.shape
          and not jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)
          and not _same_dtype(dtype, saved.dtype)
          and refusal(saved.dtype, dtype) is None)


def match_structure(saved: dict[str, LeafRecord],
                    targets: list[tuple[str, Any]],
                    step_dir: epath.Path | str,
                    options: RestoreOptions = RestoreOptions(), *,
                    call: str = "restore",
                    explain: Callable[[], str] | None = None) -> list[str]:
  """Raises StructureMismatchError naming every leaf that does not fit.

  Leaves missing on either side, and every leaf whose shape or dtype
  differs, all in one message (each list cut at `_MAX_LISTED`, the
  differing leaves at `_MAX_MISMATCHES`), before any data is read. Of the
  `options`: with `partial`, checkpoint leaves that the target lacks are
  no mismatch; with `missing="keep"`, target leaves that the checkpoint
  lacks are not either, if the target gives them a value (not a
  `ShapeDtypeStruct`).
  With `cast`, a leaf whose dtype alone differs is no mismatch where
  `refusal` allows the conversion; without it, the message says
  that `cast=True` would convert those leaves. `saved` is keyed by target
  path (after a rename, `renaming.Renaming.apply`): a leaf whose record
  has another path is named by both. `step_dir` says where the tree is,
  `call` which function the hints name; `explain`, called for a mismatch
  only, what its message adds at the end (after a rename, the rules that
  matched no checkpoint path: `renaming.Renaming.explain`).

  Returns:
    The target leaves that the checkpoint lacks and that keep the target's
    value (only with `missing="keep"`).
  """
  partial, cast = options.partial, options.cast
  keep = options.missing == "keep"
  target_paths = [p for p, _ in targets]
  kept = [p for p, t in targets if keep and p not in saved
          and not isinstance(t, jax.ShapeDtypeStruct)]
  missing = [p for p in target_paths if p not in saved and p not in kept]
  unexpected = [] if partial else [
      _named(p, saved[p]) for p in sorted(set(saved) - set(target_paths))]
  differ = [m for m in (_mismatch(p, saved[p], t, cast) for p, t in targets
                        if p in saved) if m is not None]
  castable = 0 if cast or not differ else sum(
      _castable(saved[p], t) for p, t in targets if p in saved)
  cast_hint = "" if not castable else (
      f"; {call}(..., cast=True) converts the dtype" if len(differ) == 1
      else f"; {call}(..., cast=True) converts the dtypes of {castable}"
      " of these leaves")
  if not missing and not unexpected and len(differ) <= 1:
    if differ:
      raise StructureMismatchError(differ[0] + cast_hint
                                   + _explained(explain))
    return kept
  parts = []
  if missing:
    hint = (" (abstract in the target: give them a value to keep)" if keep
            else f" ({call}(..., missing='keep') keeps the target's values)")
    parts.append("target leaves not in the checkpoint:"
                 f" {_count([repr(p) for p in missing], _MAX_LISTED)}{hint}")
  if unexpected:
    parts.append("checkpoint leaves not in the target:"
                 f" {_count(unexpected, _MAX_LISTED)} ({call}(...,"
                 " partial=True) restores the target's leaves alone)")
  if differ:
    more = len(differ) - _MAX_MISMATCHES
    parts.append(f"{len(differ)} leaves differ in shape or dtype: "
                 + "; ".join(differ[:_MAX_MISMATCHES])
                 + (f"; and {more} more" if more > 0 else "") + cast_hint)
  raise StructureMismatchError(
      f"the tree in {step_dir} does not match the restore target; "
      + "; ".join(parts) + _explained(explain))


def _explained(explain: Callable[[], str] | None) -> str:
  """What `explain` adds to a mismatch message, after a '; '."""
  text = "" if explain is None else explain()
  return f"; {text}" if text else ""
