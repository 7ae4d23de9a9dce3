"""The partner plan (`tolerance.partners`): where the copies of a shard that
too few processes hold go, so that any `replicas` lost processes leave
every shard in some survivor's local tier."""

import itertools

import pytest

from flax_ckpt_plugin.tolerance import partners
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
  received = partners.received_bytes(ring, [((p,), 100) for p in range(8)], 1)
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
  assert sorted(partners.received_bytes(
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


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_four_processes_send_partner_copies_by_collective_permute():
  """4 processes x 2 devices, gloo: at each of the plan's first two steps
  every process receives, bit for bit, the bytes of the process whose
  partner it is, whatever their lengths (0 bytes and an odd length too)."""
  results = run_workers("partner_exchange", 4, timeout=150)
  out = [r.json for r in results]
  ring = partners.Ring([f"host{p // 2}" for p in range(4)])
  for me, o in enumerate(out):
    for step in ("1", "2"):
      sender, digest, length = o["received"][step]
      assert ring.partner(sender, int(step)) == me
      assert digest == out[sender]["sent"], (me, step)
      assert length == out[sender]["length"]
