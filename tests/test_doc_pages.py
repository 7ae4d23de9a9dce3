"""The pages of docs/ stay true to the code, to docs/performance.md and to
their own tables of contents (fast: no processes, no JAX work).

- every page over 150 lines has a table of contents, and it names every
  section (`## ` heading) of the page;
- every link to `page.md#anchor` names a heading of that page;
- every field of the option records (`Storage`, `Processes`, `Retention`,
  `FaultTolerance`, `AutoInterval`) has a row in its table in docs/loop.md,
  with the default that the dataclass has;
- every name a page calls exists (see `test_every_name_a_page_uses_exists`);
- every figure quoted outside docs/performance.md stands there or in
  docs/control_plane.md, its simulated many-process part (see `FIGURE`);
- no user page speaks of the package's history or names a private module;
- no page is over 600 lines, but the generated docs/api.md.
"""

from __future__ import annotations

import ast
import dataclasses
import decimal
import inspect
import pathlib
import re

import pytest

import flax_ckpt_plugin

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# Pages a user reads: everything but the contributors' map.
USER_PAGES = [p for p in PAGES if p.name != "architecture.md"]


def _prose(text: str) -> str:
  """`text` without its fenced code blocks (kept as blank lines)."""
  return re.sub(r"^```.*?^```$", lambda m: "\n" * m.group().count("\n"),
                text, flags=re.M | re.S)


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading."""
  text = heading.strip().lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def _headings(text: str, level: str = "#+") -> list[str]:
  return re.findall(rf"^{level} (.+)$", _prose(text), re.M)


# -- tables of contents and links --------------------------------------------


def _toc(text: str) -> str | None:
  """The table of contents: the list of `#anchor` links before the first
  section, or None."""
  head = _prose(text).split("\n## ", 1)[0]
  links = re.findall(r"^\s*- \[.*\]\(#[^)]+\)", head, re.M)
  return head if links else None


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "api.md"],
                         ids=lambda p: p.name)
def test_every_section_is_in_the_table_of_contents(page):
  text = page.read_text()
  toc = _toc(text)
  if toc is None:
    assert text.count("\n") <= 150, f"{page.name}: over 150 lines, no TOC"
    return
  linked = set(re.findall(r"\]\(#([^)]+)\)", toc))
  missing = [h for h in _headings(text, "##") if _slug(h) not in linked]
  assert not missing, f"{page.name}: sections not in its TOC: {missing}"


def test_every_anchor_of_a_link_is_a_heading():
  broken = []
  for page in [REPO / "README.md", *PAGES]:
    text = page.read_text()
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)",
                                     _prose(text)):
      if "://" in target:
        continue
      dest = (page.parent / target) if target else page
      if not dest.exists():
        continue  # test_docs.py reports a missing file.
      slugs = {_slug(h) for h in _headings(dest.read_text())}
      if anchor not in slugs:
        broken.append(f"{page.name} -> {target}#{anchor}")
  assert not broken, broken


# -- the option records' tables -----------------------------------------------


def _format_default(field: dataclasses.Field) -> str:
  if field.default_factory is not dataclasses.MISSING:
    return f"{field.default_factory.__name__}()"
  value = field.default
  if isinstance(value, tuple):
    inner = ", ".join(_format_one(v) for v in value)
    return f"({inner},)" if len(value) == 1 else f"({inner})"
  return _format_one(value)


def _format_one(value) -> str:
  if hasattr(value, "name") and type(value).__module__ == "signal":
    return f"signal.{value.name}"
  if isinstance(value, str):
    return f'"{value}"'
  return repr(value)


@pytest.mark.parametrize("record", ["Retention", "FaultTolerance", "Storage",
                                    "Processes", "AutoInterval"])
def test_every_option_field_is_in_its_table_with_its_default(record):
  text = (DOCS / "loop.md").read_text()
  start = text.index(f"\n### `{record}`")
  section = text[start:text.find("\n##", start + 1)]
  rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, re.M))
  cls = getattr(flax_ckpt_plugin, record)
  expected = {f.name: _format_default(f) for f in dataclasses.fields(cls)}
  assert rows == expected, (
      f"loop.md's {record} table; missing: {expected.keys() - rows.keys()}, "
      f"not fields: {rows.keys() - expected.keys()}, defaults differ: "
      f"{ {k: (rows[k], v) for k, v in expected.items() if rows.get(k, v) != v} }")


# -- names -------------------------------------------------------------------

# What a page's variables stand for.
_VARIABLES = {"cb": "CheckpointCallback", "ckpt": "CheckpointCallback",
              "mngr": "CheckpointManager", "manager": "CheckpointManager",
              "mgr": "CheckpointManager"}
# What an attribute or method gives, where a page goes on from it.
_GIVES = {"manager": "CheckpointManager", "last_save_stats": "SaveStats",
          "last_restore_stats": "RestoreStats", "metadata": "StepMetadata"}


def _has(cls: type, name: str) -> bool:
  """Whether instances of `cls` have `name`: a class attribute, a dataclass
  field, or an attribute its methods set (`self.name = `)."""
  if hasattr(cls, name):
    return True
  if dataclasses.is_dataclass(cls) and name in {
      f.name for f in dataclasses.fields(cls)}:
    return True
  for klass in cls.__mro__:
    try:
      source = inspect.getsource(klass)
    except (OSError, TypeError):
      continue
    if re.search(rf"self\.{name}\b[^\n=]*=(?!=)", source):
      return True
  return False


def _check_chain(chain: list[str]) -> str | None:
  """None if `a.b.c` resolves, else the part that does not."""
  head, rest = chain[0], chain[1:]
  if head == "flax_ckpt_plugin":
    if not rest:
      return None
    if rest[0] not in flax_ckpt_plugin.__all__ and rest[0] not in _NOT_MODULES:
      return f"flax_ckpt_plugin.{rest[0]}"
    head, rest = rest[0], rest[1:]
  if head in _VARIABLES:
    head = _VARIABLES[head]
  elif head not in flax_ckpt_plugin.__all__:
    return None  # Not ours: `jax.jit`, `state.params`.
  if head == "CheckpointAction":
    return None  # Needs clu, which the fast tier may lack.
  obj = getattr(flax_ckpt_plugin, head)
  for name in rest:
    if not inspect.isclass(obj):
      return None  # A constant's attribute: not ours to check.
    if not _has(obj, name):
      return f"{obj.__name__}.{name}"
    if name in _GIVES:
      obj = getattr(flax_ckpt_plugin, _GIVES[name])
    else:
      return None  # Where a value's type is not known, stop.
  return None


_CHAIN = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\(\S*?\))?(?:\.[A-Za-z_]\w*"
                    r"(?:\([^()]*\))?)+)")


def _not_orbax(text: str) -> str:
  """`text` without the first cells of a table whose first column is
  Orbax's calls (the Orbax map names Orbax's `mngr.best_step()`)."""
  out, orbax = [], False
  for line in text.splitlines():
    if line.startswith("| Orbax |"):
      orbax = True
    elif not line.startswith("|"):
      orbax = False
    if orbax and line.startswith("|"):
      line = "|" + line.split("|", 2)[2]
    out.append(line)
  return "\n".join(out)


def _chains(text: str) -> list[list[str]]:
  """Dotted names in inline code and python blocks, calls stripped."""
  text = _not_orbax(text)
  code = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
  code += re.findall(r"`([^`\n]+)`", _prose(text))
  out = []
  for piece in code:
    for m in _CHAIN.finditer(piece):
      parts = re.sub(r"\([^()]*\)", "", m.group(1)).split(".")
      out.append([p for p in parts if p])
  return out


@pytest.mark.parametrize("page", [REPO / "README.md", *USER_PAGES],
                         ids=lambda p: p.name)
def test_every_name_a_page_uses_exists(page):
  """A dotted name in code that starts with an exported name
  (`Storage.pinned_host_bytes`), with `flax_ckpt_plugin.`, or with a variable
  the pages give our objects (`cb`, `mngr`: see `_VARIABLES`) resolves,
  through the attributes that give another of our objects (`_GIVES`)."""
  bad = sorted({b for chain in _chains(page.read_text())
                if (b := _check_chain(chain)) is not None})
  assert not bad, f"{page.name} names what does not exist: {bad}"


# -- figures -----------------------------------------------------------------

# A figure is a measured quantity: a number with a decimal fraction and a
# unit of time, size or ratio ("1.4 ms", "3.22 GB", "0.36x"), or any rate
# ("47.7 GB/s", "25 MB/s"). Whole numbers with a unit of time or size ("300
# s", "64 MB", "5 GB") are settings and limits of the code, not
# measurements, and are not checked; nor is a whole value written with a
# fraction ("300.0 s", a timeout). A range ("0.41-0.60 s") is two figures.
# Only prose counts: code and inline code quote what a program prints (a log
# line's "0.476s"), not a measurement.
FIGURE = re.compile(
    r"(?<![\w.])(\d+\.\d+|\d+)(?:-(\d+\.\d+|\d+))?\s?"
    r"(GB/s|MB/s|ms|s|GB|MB|GiB|MiB|x)(?![\w/])")
_SCALE = {"ms": ("s", "0.001"), "s": ("s", "1"), "GB": ("B", "1e9"),
          "MB": ("B", "1e6"), "GiB": ("B", str(2**30)),
          "MiB": ("B", str(2**20)), "GB/s": ("B/s", "1e9"),
          "MB/s": ("B/s", "1e6"), "x": ("x", "1")}
# The pages checked: README and the pages of tasks and answers (their
# example outputs are code blocks, left out above), and reliability.md but
# its section of trials. That section is a trial log: what the survivors of
# each failure did in its own trials (times after a kill, steps lost), with
# the method beside them, measured nowhere else. Not checked:
# architecture.md (the contributors' map) and api.md (the docstrings).
_QUOTING = ("quickstart.md", "usage.md", "loop.md", "auto_interval.md",
            "retention.md", "restoring.md", "multihost.md",
            "fault_tolerance.md", "troubleshooting.md", "nnx.md",
            "object_storage.md", "format.md", "preemption.md",
            "integrations.md", "cli.md", "converting.md", "reliability.md")
# The pages of measurements: performance.md, and control_plane.md, the
# simulated coordination of many processes, which performance.md links.
MEASURED = ("performance.md", "control_plane.md")


def _quoting_text(page: pathlib.Path) -> str:
  """What of a page the figure check reads: reliability.md without its
  trial log (see `_QUOTING`)."""
  text = page.read_text()
  if page.name == "reliability.md":
    text = _without_section(text, "A process dies: trials")
  return text


def _without_section(text: str, heading: str) -> str:
  """`text` less its `## heading` section (up to the next `## `)."""
  start = text.index(f"\n## {heading}")
  end = text.index("\n## ", start + 1)
  return text[:start] + text[end:]


def _figures(text: str, *, all_numbers: bool = False) -> set[tuple]:
  out = set()
  prose = _prose(text)
  if not all_numbers:
    prose = re.sub(r"`[^`]*`", "", prose)
  for m in FIGURE.finditer(prose):
    unit = m.group(3)
    for number in filter(None, m.group(1, 2)):
      if not all_numbers and "." not in number and not unit.endswith("/s"):
        continue
      kind, scale = _SCALE[unit]
      if not all_numbers and not unit.endswith("/s") and (
          decimal.Decimal(number) == int(decimal.Decimal(number))):
        continue
      value = (decimal.Decimal(number) * decimal.Decimal(scale)).normalize()
      out.add((value, kind, f"{number} {unit}"))
  return out


@pytest.mark.parametrize(
    "page", [REPO / "README.md",
             *[p for p in PAGES if p.name in _QUOTING]],
    ids=lambda p: p.name)
def test_every_figure_quoted_stands_in_performance_md(page):
  measured = {(v, k) for name in MEASURED for v, k, _ in _figures(
      (DOCS / name).read_text(), all_numbers=True)}
  quoted = _figures(_quoting_text(page))
  missing = sorted(text for v, k, text in quoted if (v, k) not in measured)
  assert not missing, f"{page.name} quotes figures not in performance.md " \
      f"or control_plane.md: {missing}"


# -- history and internals -----------------------------------------------------

# Changelog language: what a page would say of an older version of the
# package. Whole words, any case, in prose and inline code alike. Plain
# "before" and "after" are left alone: they order events ("a save after a
# step", and the library's own messages, "timed out after 300.0s"). They
# count where they label a version: followed by a parenthesis ("before
# (main)", "after (this code)"), after one ("(before: a short write"), or as
# a table cell of their own ("| before |", "| after, wait_for_deletes |").
# "no longer than" compares ("blocks no longer than later ones").
CHANGELOG = re.compile(
    r"\b(?:earlier versions?|used to|as before|before these changes|"
    r"no device (?:was )?lent|came after the figures|predates?|previously|"
    r"no longer(?! than)|(?:on )?the old code|main's code)\b"
    r"|\b(?:before|after) \(|\((?:before|after):|\(\d[\d.]* before\b"
    r"|\|\s*(?:before|after)\s*[|,(]", re.I)


def _private_modules() -> tuple[set[str], set[str]]:
  """Dotted paths (`save.staging`) and stems (`shared_read`) of the
  package's modules."""
  package = REPO / "flax_ckpt_plugin"
  dotted, stems = set(), set()
  for path in package.rglob("*.py"):
    if path.name.startswith("__"):
      continue
    parts = path.relative_to(package).with_suffix("").parts
    dotted.add(".".join(parts))
    stems.add(parts[-1])
  return dotted, stems


def _public_words() -> set[str]:
  """Names of the public API that may equal a module's stem (`directory`,
  `retention`): parameters, fields and attributes of what `__all__` names,
  and the fields of the on-disk format."""
  words = set(flax_ckpt_plugin.__all__)
  # `CheckpointAction` needs clu, which the fast tier may lack, yet api.md
  # documents it (its `callback` argument, its `manager` property): its
  # names are read from its module's source.
  clu_hooks = ast.parse((REPO / "flax_ckpt_plugin" / "clu_hooks.py"
                         ).read_text())
  for node in ast.walk(clu_hooks):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      words.add(node.name)
      words.update(a.arg for a in [*node.args.args, *node.args.kwonlyargs])
    elif isinstance(node, ast.Attribute) and isinstance(
        node.value, ast.Name) and node.value.id == "self":
      words.add(node.attr)
  for name in flax_ckpt_plugin.__all__:
    if name == "CheckpointAction":
      continue
    obj = getattr(flax_ckpt_plugin, name)
    words.update(n for n in dir(obj) if not n.startswith("_"))
    for fn in [obj, getattr(obj, "__init__", None),
               *[getattr(obj, n) for n in dir(obj) if not n.startswith("_")]]:
      try:
        words.update(inspect.signature(fn).parameters)
      except (TypeError, ValueError):
        pass
    if inspect.isclass(obj):
      try:
        source = inspect.getsource(obj)
      except (OSError, TypeError):
        continue
      # `self.x = ...`, and each target of `self.manager, self.local = ...`
      # (the callback's `manager` attribute).
      for targets in re.findall(
          r"^\s*(self\.\w+(?:\s*,\s*self\.\w+)*)\s*(?::[^=\n]*)?=(?!=)",
          source, re.M):
        words.update(re.findall(r"self\.(\w+)", targets))
  # The command line's commands and options.
  cli = (DOCS / "cli.md").read_text() + (DOCS / "converting.md").read_text()
  words.update(re.findall(r"^flax-ckpt (\S+)", cli, re.M))
  words.update(w.replace("-", "_") for w in re.findall(r"--([\w-]+)", cli))
  # The fields of the on-disk format (the first column of format.md's
  # tables): a leaf's `keys` is the user's word, not the module's.
  words.update(re.findall(r"^\| `(\w+)` \|", (DOCS / "format.md").read_text(),
                          re.M))
  return words


# What follows a dot in a file's name (`manifest.json`), not a module's name.
_FILE_SUFFIXES = ("json", "md", "py", "npz", "safetensors", "txt", "log")
# `flax_ckpt_plugin.X` that are no modules: an export's metadata key.
_NOT_MODULES = ("step",)


def _module_names(text: str) -> list[str]:
  dotted, stems = _private_modules()
  public = _public_words()
  prose = _prose(text)  # The library's own messages may name a class's module.
  found = []
  for m in re.finditer(r"flax_ckpt_plugin\.([\w.]+)", prose):
    first = m.group(1).split(".")[0]
    if first not in flax_ckpt_plugin.__all__ and first not in _NOT_MODULES:
      found.append(m.group())
  for span in re.findall(r"`([^`\n]+)`", prose):
    for name in re.findall(r"(?<![\w/])([a-z_]+(?:\.[a-z_]+)+)", span):
      if name in dotted or any(name.startswith(d + ".") for d in dotted):
        found.append(name)
    if span in stems and span not in public:
      found.append(span)
    # `local_tier.LocalTier`, `casting.CHUNK_BYTES`: a name reached through
    # a module's stem (not a file name such as `manifest.json`, nor a
    # public name's attribute such as `storage.backend`).
    for m in re.finditer(r"(?<![\w/.])([a-z_]\w*)\.([A-Za-z_]\w*)", span):
      if (m.group(1) in stems and m.group(1) not in public
          and m.group(2) not in _FILE_SUFFIXES):
        found.append(m.group())
  found += re.findall(r"flax_ckpt_plugin/[\w/]+\.py", prose)
  # A module's path inside the package (`tolerance/exchange.py`); not a
  # test's or a benchmark's (`tests/save/test_crash.py`).
  paths = {f"{d.replace('.', '/')}.py" for d in dotted}
  found += [p for p in re.findall(r"(?<![\w/.])(\w+/[\w/]+\.py)", prose)
            if p in paths]
  return found


def _user_text(page: pathlib.Path) -> str:
  """The page a user reads: performance.md without its method section."""
  text = page.read_text()
  if page.name == "performance.md":
    text = _without_section(text, "Reproducing the figures")
  return text


@pytest.mark.parametrize("page", [REPO / "README.md", *USER_PAGES],
                         ids=lambda p: p.name)
def test_no_user_page_speaks_of_history_or_private_modules(page):
  text = _user_text(page)
  history = [m.group() for m in CHANGELOG.finditer(text)]
  assert not history, f"{page.name}: changelog language: {history}"
  modules = _module_names(text)
  assert not modules, f"{page.name}: names private modules: {modules}"


def test_no_page_is_over_600_lines_but_the_api_reference():
  long = {p.name: n for p in PAGES
          if (n := p.read_text().count("\n")) > 600 and p.name != "api.md"}
  assert not long, long
