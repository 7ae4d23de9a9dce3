"""Renaming on restore: from the names a checkpoint holds to the target's.

Checkpoints outlive code: a module renamed, a layer split, a head
replaced; and weights published by another library name their tensors in
its own way. A rename maps each checkpoint path (`params/dense_1/kernel`;
a safetensors tensor `h.0.attn.c_attn.weight` is the path
`h/0/attn/c_attn/weight`) to the target path it restores into, before the
target is matched (`matching`), so that every later step (matching,
casting, reading) sees target paths, and messages name both.

A rename is given as
* rules, a mapping (or a sequence of pairs) of regular expressions to
  replacements: the first rule whose pattern matches the whole path
  (`re.fullmatch`) gives the new path by `Match.expand(replacement)`
  (`\\1`, `\\g<name>`); a replacement of None drops the leaf; a path no
  rule matches keeps its name (t5x's `assignment_map` reads the same way);
* or a function of a checkpoint path, returning the target path, or None
  to drop the leaf.

`Renaming.of` checks a rename once; `Renaming.apply` renames a set of
leaf records, refusing two checkpoint leaves that become one target leaf.
A rule whose pattern matches no checkpoint path whole renames nothing,
most often a prefix written as for `re.sub` (`^encoder/`):
`Renaming.unmatched` finds such rules, with what would have matched,
and `Renaming.explain` says so at the end of a structure mismatch.
Used by every restore (`tree.restore_tree`, `shared_read`), by
`safetensors_load.load_safetensors`, and by `flax-ckpt show --rename`.
Needs no JAX.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence, Union

from flax_ckpt_plugin.format.records import LeafRecord

# What `restore(..., rename=)` and `load_safetensors(..., rename=)` take.
Rename = Union[Mapping[str, Union[str, None]],
               Sequence[tuple[str, Union[str, None]]],
               Callable[[str], Union[str, None]]]


class RenameError(ValueError):
  """A rename that cannot be applied: a pattern that does not compile, a
  result that is not a path, or two checkpoint leaves given one name."""


# How a message writes the rule that matches whole paths.
WHOLE_PATH = ("a rule's pattern matches a whole checkpoint path"
              " (re.fullmatch), as r'encoder/(.*)' -> r'backbone/\\1' renames"
              " 'encoder/x' to 'backbone/x'")


def _shown(text: str | None) -> str:
  """A pattern or replacement as a user writes it in Python: a raw string
  where it holds a backslash, so that a group reads as written, not with
  the backslash doubled as `repr` shows it."""
  if (text is not None and "\\" in text and "'" not in text
      and not text.endswith("\\")):
    return f"r'{text}'"
  return repr(text)


class UnmatchedRule(NamedTuple):
  """A rule whose pattern matches no checkpoint path whole.

  Attributes:
    pattern: the rule's pattern, as given.
    replacement: its replacement (None: drops).
    hint: where the pattern matches part of a path (as `re.match` or
      `re.search` read it), which path and how, with a rule that matches
      that path whole where one is simple to give; else "".
  """
  pattern: str
  replacement: str | None
  hint: str

  def describe(self) -> str:
    """The rule and its hint, as messages show them."""
    rule = f"{_shown(self.pattern)} -> {_shown(self.replacement)}"
    return f"{rule} ({self.hint})" if self.hint else rule


def _hint(pattern: re.Pattern, replacement: str | None,
          paths: Sequence[str]) -> str:
  """What `UnmatchedRule.hint` says of a rule that matches no path whole."""
  start = next((p for p in paths if pattern.match(p)), None)
  if start is not None:
    hint = (f"it matches the start of {start!r}, as re.match reads a"
            " pattern")
    # The same rule with the rest of the path as one more group: given
    # only where it compiles and matches that path whole.
    head = pattern.pattern if "|" not in pattern.pattern else (
        f"(?:{pattern.pattern})")
    try:
      whole = re.compile(head + "(.*)", pattern.flags)
    except re.error:
      return hint
    if whole.fullmatch(start) is None:
      return hint
    n = whole.groups
    rest = f"\\{n}" if n < 10 else f"\\g<{n}>"
    new = None if replacement is None else replacement + rest
    return (f"{hint}; {_shown(whole.pattern)} -> {_shown(new)} matches it"
            " whole")
  inside = next((p for p in paths if pattern.search(p)), None)
  if inside is not None:
    return f"it matches inside {inside!r}, as re.search reads a pattern"
  return ""


@dataclasses.dataclass(frozen=True)
class Renaming:
  """A checked rename (see the module doc); `Renaming.of(None)` keeps
  every name.

  Attributes:
    rules: (compiled pattern, replacement or None), tried in order.
    function: the user's function, where a rename is one (then no rules).
  """
  rules: tuple[tuple[re.Pattern, str | None], ...] = ()
  function: Callable[[str], str | None] | None = None

  @classmethod
  def of(cls, rename: Rename | Renaming | None) -> Renaming:
    """Checks `rename` once: every pattern compiles, every replacement is
    a string or None.

    Raises:
      RenameError: names the rule that is wrong.
    """
    if rename is None:
      return cls()
    if isinstance(rename, Renaming):
      return rename
    if callable(rename) and not isinstance(rename, Mapping):
      return cls(function=rename)
    pairs = list(rename.items() if isinstance(rename, Mapping) else rename)
    rules = []
    for n, pair in enumerate(pairs):
      try:
        pattern, replacement = pair
      except (TypeError, ValueError):
        raise RenameError(
            f"rename rule {n} is {pair!r:.80}: a rule is a (pattern,"
            " replacement) pair") from None
      if not isinstance(pattern, str) or not (
          replacement is None or isinstance(replacement, str)):
        raise RenameError(
            f"rename rule {pattern!r:.80}: the pattern must be a string and"
            f" the replacement a string or None, got {replacement!r:.80}")
      try:
        compiled = re.compile(pattern)
      except re.error as e:
        raise RenameError(
            f"rename rule {pattern!r}: not a regular expression: {e}"
        ) from None
      rules.append((compiled, replacement))
    return cls(rules=tuple(rules))

  @property
  def renames(self) -> bool:
    """Whether any name may change."""
    return bool(self.rules) or self.function is not None

  def target_path(self, path: str) -> str | None:
    """The target path of checkpoint path `path`; None: dropped.

    Raises:
      RenameError: a replacement refers to a group its pattern lacks, or
        the result is not a path (not a non-empty string).
    """
    if self.function is not None:
      new = self.function(path)
      what = "the rename function"
    else:
      for pattern, replacement in self.rules:
        found = pattern.fullmatch(path)
        if found is None:
          continue
        if replacement is None:
          return None
        try:
          new = found.expand(replacement)
        except (re.error, IndexError) as e:
          raise RenameError(
              f"rename rule {pattern.pattern!r} -> {replacement!r} on"
              f" {path!r}: {e}") from None
        what = f"rename rule {pattern.pattern!r} -> {replacement!r}"
        break
      else:
        return path
    if new is None:
      return None
    if not isinstance(new, str) or not new or "" in new.split("/"):
      raise RenameError(f"{what} gives checkpoint leaf {path!r} the name"
                        f" {new!r:.80}: a target path is a non-empty string"
                        " of non-empty names between slashes (or None, to"
                        " drop the leaf)")
    return new

  def names(self, paths: Iterable[str]) -> dict[str, str]:
    """Target path -> checkpoint path, of every path not dropped.

    Raises:
      RenameError: two checkpoint paths get one target path (names both),
        or as `target_path`.
    """
    out: dict[str, str] = {}
    for path in paths:
      new = self.target_path(path)
      if new is None:
        continue
      if new in out:
        raise RenameError(
            f"rename gives checkpoint leaves {out[new]!r} and {path!r} the"
            f" same target path {new!r}")
      out[new] = path
    if self.renames:
      # A leaf's path may not be a folder of another's ('x' and 'x/y').
      for b in out:
        parts = b.split("/")
        a = next((a for a in ("/".join(parts[:k])
                              for k in range(1, len(parts))) if a in out),
                 None)
        if a is not None:
          raise RenameError(
              f"rename gives checkpoint leaf {out[a]!r} the target path"
              f" {a!r} and {out[b]!r} the path {b!r} inside it: a leaf"
              " cannot also hold leaves")
    return out

  def unmatched(self, paths: Iterable[str]) -> list[UnmatchedRule]:
    """The rules, in order, whose pattern matches none of the checkpoint
    paths `paths` whole (a function: none), each with its hint."""
    if not self.rules:
      return []
    paths = sorted(paths)
    return [UnmatchedRule(pattern.pattern, replacement,
                          _hint(pattern, replacement, paths))
            for pattern, replacement in self.rules
            if not any(pattern.fullmatch(p) for p in paths)]

  def explain(self, paths: Iterable[str]) -> str:
    """What a structure mismatch under this rename adds to its message:
    the rules that matched none of the checkpoint paths `paths`, and that
    a rule matches a whole path; "" where every rule matched one."""
    unmatched = self.unmatched(paths)
    if not unmatched:
      return ""
    return ("rename rules that matched no checkpoint path: "
            + "; ".join(u.describe() for u in unmatched)
            + f"; {WHOLE_PATH}")

  def apply(self, leaves: Iterable[LeafRecord]) -> dict[str, LeafRecord]:
    """The records by target path (dropped leaves left out). Each record
    keeps its checkpoint path (`LeafRecord.path`): readers name what they
    read by it, and `matching` shows both names where they differ.

    Raises:
      RenameError: as `names`.
    """
    by_path = {leaf.path: leaf for leaf in leaves}
    if not self.renames:
      return by_path
    return {new: by_path[old] for new, old in self.names(by_path).items()}
