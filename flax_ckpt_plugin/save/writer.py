"""The save's writer: each process's data file and shard table, the
primary's merge of the tables into the manifest, and the manifest's write.

A process writes its shards' bytes one after another into
`data/process_NNNNN.bin` (`write_process_files`), with the CRC-32C of each
block, and leaves its shard table (`data/process_NNNNN.json`, with a
digest of how it sees every leaf) and that view
(`data/process_NNNNN.views.json`, read only if its digest differs from the
primary's). The primary host merges the tables into the manifest
(`merge_tables`), checking that every process saw the same tree, writes
it (`write_manifest`) and removes both before finalizing. `extra_to_json`
and `metrics_to_json` check what `manager.save` is given before anything
is written. What a step is (its files, records and manifest) is
`format`'s; `docs/format.md` describes it for readers with numpy alone.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import time
import threading
from typing import Any, NamedTuple, Sequence

from etils import epath

from flax_ckpt_plugin import deadlines
from flax_ckpt_plugin.backends import interface
from flax_ckpt_plugin.backends import datafile
from flax_ckpt_plugin.backends.held import Span
from flax_ckpt_plugin.format import datastate
from flax_ckpt_plugin.errors import SaveFailedError
from flax_ckpt_plugin.format.records import CHECKSUM_BLOCK
from flax_ckpt_plugin.format.files import DATA_DIR
from flax_ckpt_plugin.format.files import FORMAT_NAME
from flax_ckpt_plugin.format.files import FORMAT_VERSION
from flax_ckpt_plugin.format.files import MANIFEST
from flax_ckpt_plugin.format.files import data_file
from flax_ckpt_plugin.format.files import index_file
from flax_ckpt_plugin.format.files import MAX_TABLE_BYTES
from flax_ckpt_plugin.format.files import Scope
from flax_ckpt_plugin.format.files import views_file
from flax_ckpt_plugin.save.leaves import LeafSnapshot

def _views(leaves: list[LeafSnapshot]) -> tuple[str, str]:
  """The JSON of every leaf's `_view`, and its SHA-256."""
  text = json.dumps({leaf.path: _view(leaf) for leaf in leaves})
  return text, hashlib.sha256(text.encode()).hexdigest()


def _view(leaf: LeafSnapshot) -> list[Any]:
  """How a process sees one leaf: [kind, dtype, shape, key_impl].

  A numpy leaf and a jax array are alike here: both restore either way.
  """
  kind = "array" if leaf.kind == "numpy" else leaf.kind
  return [kind, leaf.dtype, list(leaf.shape), leaf.key_impl]


def _describe_view(view: list[Any] | None) -> str:
  if view is None:
    return "no such leaf"
  kind, dtype, shape, key_impl = view
  if kind not in ("array", "numpy"):
    return f"a Python {kind}"
  desc = f"{dtype}[{','.join(str(d) for d in shape)}]"
  return desc + (f" (PRNG keys of impl {key_impl})" if key_impl else "")


class Written(NamedTuple):
  """What `write_process_files` wrote."""
  nbytes: int  # The shards' bytes.
  file: str | None  # The data file's name in the step directory, if any.
  size: int  # The data file's size.
  # Where each shard went in the data file, its bytes a view of the
  # snapshot (valid while the snapshot is: see `backends.held`).
  spans: list[Span]


def write_process_files(step_dir: epath.Path, leaves: list[LeafSnapshot],
                        process_index: int, *,
                        identity: interface.Identity | None = None,
                        backend: interface.Backend | None = None,
                        data_state: datastate.Encoded | None = None,
                        in_flight: deadlines.InFlight | None = None
                        ) -> Written:
  """Writes this process's shards and shard table; says what it wrote.

  Called on every process, each into the same temporary step directory. The
  data file is fsynced before the shard table is written.

  Args:
    step_dir: the step's temporary directory.
    leaves: this process's snapshot.
    process_index: names the files.
    identity: the identity of `step_dir` when the primary host made it
      (local disks); a different directory there raises
      `ConcurrentWriterError`.
    backend: the directory's storage backend (default: by its scheme).
    data_state: this process's data state, if it has one (`datastate`).
    in_flight: where each write is recorded, with its deadline (the
      commit's waiters watch it); default: a record of its own.
  """
  backend = backend or interface.for_path(step_dir)
  io = in_flight or deadlines.InFlight(where=str(step_dir))
  views, digest = _views(leaves)
  with io.doing(f"opening {step_dir} to write"):
    out = backend.step_writer(step_dir, identity, DATA_DIR)
  try:
    entries = []
    offset = 0  # The data file's size.
    name = data_file(process_index)
    shards = [(leaf, s) for leaf in leaves for s in leaf.shards]
    if shards:
      offset = _write_data(out, name, shards, entries, io,
                           f"data file {step_dir / name}")
    with io.doing(f"writing {step_dir / views_file(process_index)}"), \
        out.open(views_file(process_index)) as f:  # Read in this save only.
      datafile.write_all(f, memoryview(views.encode()))
    table = {"process_index": process_index, "file": name if shards else None,
             "nbytes": offset, "shards": entries, "views_sha256": digest}
    if data_state is not None:
      with io.doing(f"writing {step_dir / datastate.state_file(process_index)}"
                    ), out.open(datastate.state_file(process_index)) as f:
        datafile.write_all(f, memoryview(data_state.data))
        out.sync(f)
      table["data_state"] = datastate.table_entry(process_index, data_state)
    with io.doing(f"writing {step_dir / index_file(process_index)}"), \
        out.open(index_file(process_index)) as f:
      datafile.write_all(f, memoryview(json.dumps(table).encode()))
      out.sync(f)
  finally:
    with io.doing(f"closing the files of {step_dir}"):
      out.close()
  return Written(sum(e["nbytes"] for e in entries), name if shards else None,
                 offset, [Span(e["offset"], e["nbytes"], s.host_bytes, s.pinned_array)
                          for e, (_, s) in zip(entries, shards)
                          if s.holdable])


def _write_data(out: interface.StepWriter, name: str,
                shards: list[Any], entries: list[dict],
                in_flight: deadlines.InFlight, shown: str) -> int:
  """Writes the data file (`datafile.DataFile`); returns its size.

  Every shard is placed in the file first (its size and address are known
  while its copy is still in flight, see `leaves.ShardData`), then each
  is waited for just before it is written, so the writes overlap the
  transfers of the shards after it. The checksums are computed by a second
  thread while this one writes (both release the GIL), so a save costs
  about its slower half.
  """
  # A plain thread, not a pool: a commit that finishes while the interpreter
  # exits (see async_commit) may no longer start pool work.
  sums: list[list[int]] = []
  failed: list[BaseException] = []

  def checksum() -> None:
    try:
      for _, shard in shards:
        sums.append(shard.checksums())
    except BaseException as e:  # pylint: disable=broad-except
      failed.append(e)

  summer = threading.Thread(target=checksum, name="flax_ckpt_plugin-checksum")
  summer.start()
  try:
    data = datafile.DataFile(out, name, in_flight, shown)
    try:
      offsets = [data.place(shard.nbytes, shard.address)
                 for _, shard in shards]
      for (_, shard), offset in zip(shards, offsets):
        data.write(shard.host_bytes(), offset)
      data.sync()
    finally:
      data.close()
  finally:
    summer.join()
  if failed:
    raise failed[0]
  entries.extend(
      {"path": leaf.path, "file": name, "offset": offset,
       "nbytes": shard.nbytes, "index": [list(r) for r in shard.index],
       "crc32c": crcs}
      for (leaf, shard), offset, crcs in zip(shards, offsets, sums))
  return data.end


def extra_to_json(value: Any, what: str = "extra") -> Any:
  """`extra` as the JSON it is stored as; TypeError if it cannot be."""
  try:  # (numpy scalars and arrays too: what data loaders hand out.)
    return json.loads(json.dumps(value, allow_nan=False,
                                 default=datastate.to_plain))
  except (TypeError, ValueError) as e:
    raise TypeError(f"{what} must be JSON-serializable (dicts, lists, str,"
                    f" int, finite float, bool, None; numpy scalars are"
                    f" stored as numbers, numpy arrays as lists): {e}"
                    ) from e


def metrics_to_json(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
  """Metrics as stored: str keys, float values (None for NaN and
  infinities); TypeError otherwise."""
  if metrics is None:
    return None
  out = {}
  for k, v in metrics.items():
    try:
      value = float(v)  # jax and numpy scalars too.
    except (TypeError, ValueError) as e:
      raise TypeError(f"metric {k!r} is not a number: {v!r}") from e
    # JSON has no NaN nor infinity: such a value is stored as null (no
    # value), which best-metric retention treats as a step without it.
    out[str(k)] = value if math.isfinite(value) else None
  return out


def _read_table(step_dir: epath.Path, p: int,
                backend: interface.Backend) -> dict[str, Any]:
  path = step_dir / index_file(p)
  if not path.exists():
    raise RuntimeError(f"process {p} left no shard table at {path}")
  try:
    table = json.loads(backend.read_small(path, within=step_dir,
                                          limit=MAX_TABLE_BYTES))
    table["file"], table["nbytes"], table["shards"], table["views_sha256"]
  except (ValueError, TypeError, KeyError) as e:
    raise RuntimeError(f"the shard table {path} of process {p} is not"
                       f" whole: {e!s:.200}") from e
  if table["file"]:
    size, _ = backend.size_and_mtime(step_dir / table["file"])
    if size < table["nbytes"]:
      raise RuntimeError(
          f"the data file {step_dir / table['file']} of process {p} has"
          f" {size} bytes; its shard table says {table['nbytes']}")
  return table


def _check_views(mine: dict[str, list[Any]], theirs: dict[str, list[Any]],
                 primary: int, p: int) -> None:
  """Raises naming the leaves that process `p` sees otherwise than `primary`.

  Both save one tree: a leaf with another dtype, shape or kind on one
  process (a user bug) would finalize a step that cannot be restored.
  """
  if theirs == mine:
    return
  differ = [k for k in list(mine) + [k for k in theirs if k not in mine]
            if mine.get(k) != theirs.get(k)]
  shown = "; ".join(
      f"leaf {k!r}: process {primary} (primary) saves"
      f" {_describe_view(mine.get(k))}, process {p} saves"
      f" {_describe_view(theirs.get(k))}" for k in differ[:5])
  more = f"; and {len(differ) - 5} more" if len(differ) > 5 else ""
  raise SaveFailedError(
      f"processes disagree about the state they save: {shown}{more}. Every"
      " process must save the same tree, with the same dtypes and shapes.")


def merge_tables(step_dir: epath.Path, *, step: int,
                 leaves: list[LeafSnapshot], process_count: int,
                 primary: int, extra: Any, metrics: dict[str, Any] | None,
                 backend: interface.Backend, scope: Scope | None = None,
                 writers: Sequence[int] | None = None,
                 retention: dict[str, Any] | None = None
                 ) -> tuple[dict[str, Any], dict[str, dict[int, list]]]:
  """Merges every process's shard table into the manifest (primary host).

  After all processes wrote. Checks that every process saw each leaf as the
  primary does and that its data file holds what its table says. With
  `scope`, the step holds one process's shards only (see `Scope`). Only
  `writers` wrote (default: every process). `retention` is the directory's
  retention policy, recorded for `flax-ckpt list`.

  Returns:
    The manifest, and per leaf path the shard indices each process wrote.

  Raises:
    RuntimeError: a table is missing or short, or a data file is short.
    SaveFailedError: the processes disagree about a leaf.
    (The save is abandoned either way.)
  """
  by_path = {leaf.path: dict(leaf.meta(), shards=[]) for leaf in leaves}
  writers = range(process_count) if writers is None else writers
  tables = {p: _read_table(step_dir, p, backend) for p in writers}
  digest = tables[primary]["views_sha256"]
  files, origins = {}, {}
  for p, table in tables.items():
    if table["views_sha256"] != digest:  # Only then read the whole views.
      mine, theirs = (json.loads(backend.read_small(
          step_dir / views_file(q), within=step_dir, limit=MAX_TABLE_BYTES))
                      for q in (primary, p))
      _check_views(mine, theirs, primary, p)
    if table["file"]:
      files[table["file"]] = table["nbytes"]
    for entry in table["shards"]:
      path = entry.pop("path")
      by_path[path]["shards"].append(entry)
      origins.setdefault(path, {}).setdefault(p, []).append(entry["index"])
  for leaf in by_path.values():
    if leaf["kind"] in ("array", "numpy"):
      leaf["shards"].sort(key=lambda e: e["index"])
    else:
      del leaf["shards"]
  now = time.time()
  held = {} if scope is None else {"scope": scope._asdict()}
  states = {str(p): t["data_state"] for p, t in tables.items()
            if t.get("data_state")}
  return {
      **held,
      "format": FORMAT_NAME,
      "format_version": FORMAT_VERSION,
      "step": step,
      "created_unix": now,
      "created": datetime.datetime.fromtimestamp(
          now, datetime.timezone.utc).isoformat(),
      "process_count": process_count,
      "byte_order": "little",
      "files": files,
      "checksum": {"algorithm": "crc32c", "block_bytes": CHECKSUM_BLOCK},
      "leaves": list(by_path.values()),
      "extra": extra,
      "metrics": metrics,
      **({"data_states": states} if states else {}),
      **({"retention": retention} if retention else {}),
  }, origins


def write_manifest(step_dir: epath.Path, *, text: str, process_count: int,
                   backend: interface.Backend,
                   writers: Sequence[int] | None = None) -> None:
  """Writes a manifest (checked by the caller) durably and removes the
  shard tables (of `writers`, default all). Primary host only."""
  backend.write_small(step_dir / MANIFEST, text)
  for p in range(process_count) if writers is None else writers:
    (step_dir / index_file(p)).unlink(missing_ok=True)
    (step_dir / views_file(p)).unlink(missing_ok=True)
  backend.fsync(step_dir / DATA_DIR)
  backend.fsync(step_dir)
