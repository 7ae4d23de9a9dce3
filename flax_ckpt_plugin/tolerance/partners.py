"""Partner copies: which processes' local tiers also hold a shard that too
few processes hold, so that a lost process's shards outlive it.

With `replicas` r, every shard is to be in the local tiers of at least
r + 1 processes. Each process's local tier holds every distinct shard the
process holds (`local_tier`), so a shard that h <= r processes hold needs
r + 1 - h more copies: its partner copies. This module says where they go;
it moves nothing.

Partners come from a ring of the job's processes in which neighbours sit
in other failure domains where any exist (`ring`: the domains' processes
dealt out in turn, the largest domain first). A copy goes from one of the
shard's holders, its sender, to the process `step` places on along the
ring, the sender's partner at that step: for each copy, the smallest step
at which some holder's partner holds no copy yet and sits in a domain that
no copy is in (any domain, once every domain has one). So at each step the
copies travel along one fixed permutation of the processes (p to its
partner at that step): the shape of one collective permute over the
job's devices, in which a process receives what its predecessor at that
step sends. With one shard per process and one domain per process (FSDP,
a process per host), every copy is at step 1..r and every process
receives as many bytes as its predecessors hold.

Every process works out the same ring from the domains' labels alone,
and the copies of each set of holders once (`copies`, cached): the ring
in O(P log P), a set's copies in O(r) steps where the ring interleaves
the domains, at most `_SCAN` steps and then a search by domain otherwise.
"""

from __future__ import annotations

import bisect
import collections
import functools
from typing import NamedTuple, Sequence

# Steps along the ring tried one by one for a copy in a new domain, before
# searching each remaining domain's nearest process (unbalanced domains).
_SCAN = 64


class Copy(NamedTuple):
  """One partner copy of a shard: from `sender` (a holder) to `receiver`,
  its partner `step` places on along the ring."""
  sender: int
  step: int
  receiver: int


class Ring:
  """The job's processes in partner order; see the module's docstring.

  Attributes:
    order: the processes, in ring order.
    domains: each process's failure domain, by process index.
  """

  def __init__(self, domains: Sequence[str]):
    self.domains = tuple(domains)
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for p, d in enumerate(self.domains):
      groups[d].append(p)
    # The largest domains first (then by name), dealt out in turn: a
    # domain's processes are as far apart as its size allows.
    queues = [collections.deque(groups[d]) for d in
              sorted(groups, key=lambda d: (-len(groups[d]), d))]
    order = []
    while queues:
      queues = [q for q in queues if q]
      for q in queues:
        order.append(q.popleft())
    self.order = tuple(order)
    self._place = [0] * len(order)
    for at, p in enumerate(order):
      self._place[p] = at
    # Per domain: the ring places of its processes, ascending.
    self._places: dict[str, list[int]] = {
        d: sorted(self._place[p] for p in ps) for d, ps in groups.items()}

  def __len__(self) -> int:
    return len(self.order)

  def partner(self, process: int, step: int) -> int:
    """The process `step` places after `process` along the ring."""
    return self.order[(self._place[process] + step) % len(self.order)]

  def nearest_step(self, process: int, domain: str) -> int:
    """The fewest steps from `process` to a process of `domain` (> 0)."""
    places, at = self._places[domain], self._place[process]
    i = bisect.bisect_right(places, at)
    ahead = places[i] if i < len(places) else places[0] + len(self.order)
    return ahead - at

  @functools.lru_cache(maxsize=65536)
  def copies(self, holders: tuple[int, ...], replicas: int
             ) -> tuple[Copy, ...]:
    """The partner copies of a shard that the processes `holders`
    (ascending) hold, with `replicas` (see the module's docstring).

    Raises:
      ValueError: the job has too few processes for `replicas`.
    """
    if not holders:
      raise ValueError("a shard has at least one holder")
    need = replicas + 1 - len(holders)
    if need <= 0:
      return ()
    count = len(self.order)
    if replicas + 1 > count:
      raise ValueError(f"replicas={replicas} needs at least {replicas + 1}"
                       f" processes; the job has {count}")
    have = set(holders)
    used = {self.domains[h] for h in holders}
    every = set(self._places)
    out: list[Copy] = []
    # Senders in turn from a place the set picks (its mean, so that sets
    # such as (p, p + k) for each p start at each of their members in
    # turn), so that the holders of many shards share the sending.
    first = (sum(holders) // len(holders)) % len(holders)
    senders = holders[first:] + holders[:first]

    def take(sender: int, step: int) -> None:
      receiver = self.partner(sender, step)
      out.append(Copy(sender, step, receiver))
      have.add(receiver)
      used.add(self.domains[receiver])

    def fits(sender: int, step: int, new_domain: bool) -> bool:
      receiver = self.partner(sender, step)
      return receiver not in have and (
          not new_domain or self.domains[receiver] not in used)

    while len(out) < need:
      new_domain = not every <= used
      found = None
      for step in range(1, min(count, _SCAN + 1)):
        found = next(((s, step) for s in senders
                      if fits(s, step, new_domain)), None)
        if found is not None:
          break
      if found is None and new_domain:  # Search by domain: the nearest.
        found = min(((self.nearest_step(s, d), s) for s in senders
                     for d in every - used), default=None)
        found = None if found is None else (found[1], found[0])
        if found is not None and not fits(*found, new_domain=False):
          found = None
      if found is None:  # Any process that holds no copy, nearest first.
        found = next(((s, step) for step in range(1, count)
                      for s in senders if fits(s, step, False)))
      take(*found)
    return tuple(out)
