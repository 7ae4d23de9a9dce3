"""The partner plan (`tolerance.partners`): where the copies of a shard that
too few processes hold go, so that any `replicas` lost processes leave
every shard in some survivor's local tier."""

import hashlib
import itertools

import numpy as np
import pytest

from flax_ckpt_plugin.tolerance import partners
from helpers import received_bytes
from launcher import run_workers


def _check(ring, holders, replicas):
  """The copies of `holders`' shard, checked: as many as needed, each to
  a process that holds no copy, along the ring at its step."""
  copies = ring.copies(holders, replicas)
  assert len(copies) == max(0, replicas + 1 - len(holders))
  receivers = [c.receiver for c in copies]
  assert len(set(receivers)) == len(receivers)
  assert not set(receivers) & set(holders)
  for c in copies:
    assert c.sender in holders
    assert ring.partner(c.sender, c.step) == c.receiver
  return copies


def test_neighbours_along_the_ring_sit_in_other_domains():
  ring = partners.Ring(["a", "a", "a", "b", "b", "b", "c", "c", "c"])
  assert sorted(ring.order) == list(range(9))
  doms = [ring.domains[p] for p in ring.order]
  assert all(x != y for x, y in zip(doms, doms[1:] + doms[:1])), doms


def test_fsdp_one_process_a_host_every_process_receives_one_share():
  ring = partners.Ring([f"host{p}" for p in range(8)])
  received = received_bytes(ring, [((p,), 100) for p in range(8)], 1)
  assert received == [100] * 8
  for p in range(8):
    (c,) = _check(ring, (p,), 1)
    assert c.step == 1


def test_partners_are_on_another_host_where_one_exists():
  """4 processes on 2 hosts: every copy leaves its host, so losing a host
  loses no shard."""
  ring = partners.Ring(["A", "A", "B", "B"])
  for p in range(4):
    (c,) = _check(ring, (p,), 1)
    assert ring.domains[c.receiver] != ring.domains[p]
  assert sorted(received_bytes(
      ring, [((p,), 1) for p in range(4)], 1)) == [1, 1, 1, 1]


def test_two_replicas_with_two_hosts_go_to_the_other_host_first():
  ring = partners.Ring(["A", "A", "A", "B", "B", "B"])
  for p in range(6):
    first, second = _check(ring, (p,), 2)
    assert ring.domains[first.receiver] != ring.domains[p]
    assert second.receiver not in (p, first.receiver)


def test_any_two_lost_processes_leave_every_shard_with_replicas_2():
  n = 7
  ring = partners.Ring([f"h{p // 2}" for p in range(n)])
  keep = {p: {p} | {c.receiver for c in _check(ring, (p,), 2)}
          for p in range(n)}
  for lost in itertools.combinations(range(n), 2):
    assert all(keep[p] - set(lost) for p in range(n)), lost


def test_a_shard_held_by_enough_processes_needs_no_copy():
  ring = partners.Ring([f"h{p}" for p in range(6)])
  assert _check(ring, (0, 3), 1) == ()
  (c,) = _check(ring, (0, 3), 2)
  assert c.sender in (0, 3)


def test_holders_share_the_sending():
  """Shards held by the same pair need one copy each with replicas=2:
  the pairs' copies come from both holders, not all from the first."""
  ring = partners.Ring([f"h{p}" for p in range(8)])
  senders = {_check(ring, (p, p + 4), 2)[0].sender for p in range(4)}
  assert senders & {0, 1, 2, 3} and senders & {4, 5, 6, 7}


def test_unbalanced_domains_still_find_the_other_domain():
  """One big domain and a small one: a copy goes to the small one when
  the ring puts it far away, through the search by domain."""
  domains = ["big"] * 200 + ["small"] * 2
  ring = partners.Ring(domains)
  for p in range(0, 202, 7):
    (c,) = _check(ring, (p,), 1)
    if domains[p] == "big" and ring.nearest_step(p, "small") <= 201:
      assert ring.domains[c.receiver] == "small" or all(
          ring.domains[ring.partner(p, k)] == "big"
          for k in range(1, c.step)), c


def test_the_same_labels_give_the_same_plan_on_every_process():
  labels = [f"h{p % 5}" for p in range(23)]
  one, other = partners.Ring(labels), partners.Ring(list(labels))
  assert one.order == other.order
  assert [one.copies((p,), 2) for p in range(23)] == [
      other.copies((p,), 2) for p in range(23)]


def test_too_few_processes_for_the_replicas_is_a_clear_error():
  ring = partners.Ring(["a", "b", "c"])
  with pytest.raises(ValueError, match="replicas=3 needs at least 4"):
    ring.copies((0,), 3)


def _expected_copies(n: int, replicas: int) -> list[dict]:
  """What partner_exchange.py's processes should receive: per receiver,
  per leaf, [region, sha256 of its values]."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ring = partners.Ring([f"host{p}" for p in range(n)])
  values = {
      "fsdp": np.arange(48, dtype=np.float32).reshape(8, 6),
      "grid": np.arange(4 * n * 3, dtype=np.int32).reshape(4 * n, 3),
      "bf16": np.arange(16, dtype=np.float32).astype(jnp.bfloat16)}
  rows = {"fsdp": 8 // (2 * n), "grid": 4, "bf16": 16 // (2 * n)}
  out = [{} for _ in range(n)]
  for path, value in values.items():
    per_process = 2 if path != "grid" else 1  # Regions per process.
    size = rows[path]
    for region in range(value.shape[0] // size):
      holder = region // per_process
      index = [[region * size, (region + 1) * size]] + [
          [0, d] for d in value.shape[1:]]
      block = np.ascontiguousarray(value[region * size:(region + 1) * size])
      digest = hashlib.sha256(block.reshape(-1).view(np.uint8)
                              .tobytes()).hexdigest()
      for c in ring.copies((holder,), replicas):
        assert c.sender == holder
        out[c.receiver].setdefault(path, []).append([index, digest])
  return [{k: sorted(v) for k, v in o.items()} for o in out]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicas", [1, 2])
def test_four_processes_send_partner_copies_of_their_shards(replicas):
  """4 processes x 2 devices, gloo: `Exchange.send` moves every shard that
  one process holds to its partners (an FSDP leaf over 8 devices, a
  bfloat16 one, a 2-D mesh whose model axis spans the processes), by one
  jitted program of collective permutes; each receiver gets, bit for bit,
  the regions the plan gives it, twice in a row, and nothing of the
  replicated leaf or the host scalar."""
  results = run_workers("partner_exchange", 4, args=[str(replicas)],
                        timeout=150)
  got = [r.json["received"] for r in results]
  assert got == _expected_copies(4, replicas)
  assert all(len(g["fsdp"]) == 2 * replicas for g in got)
