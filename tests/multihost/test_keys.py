"""The keys of the coordination service, as every process spells them."""

from __future__ import annotations

import threading

import pytest

from flax_ckpt_plugin.multihost import groups
from flax_ckpt_plugin.multihost import keys
from flax_ckpt_plugin.multihost.coordinator import JaxCoordinator


def test_a_process_entry_and_a_meetings_parts_are_slash_joined():
  assert keys.of_process("job/leaving", 3) == "job/leaving/3"
  assert keys.child("job/tiers/0", "local") == "job/tiers/0/local"
  assert keys.child("elastic/j", "groups", 2) == "elastic/j/groups/2"


def test_a_listing_is_read_back_by_the_number_at_each_keys_end():
  listed = {keys.of_process("k/failed", p): f"error {p}" for p in (0, 12, 3)}
  assert keys.by_index(listed) == {0: "error 0", 12: "error 12", 3: "error 3"}
  assert keys.index("elastic/j/lists/7") == 7
  with pytest.raises(ValueError):
    keys.index("k/settings")


def test_a_generations_keys_are_under_its_number():
  at = keys.Generation("flax_ckpt_plugin/elastic/j", 2)
  assert at.key == "flax_ckpt_plugin/elastic/j/2"
  assert [at.lost, at.recover, at.votes, at.watch] == [
      f"flax_ckpt_plugin/elastic/j/2/{name}"
      for name in ("lost", "recover", "votes", "watch")]


def test_every_coordinator_of_a_process_counts_the_same_rounds():
  """A coordinator made anew, or a group's view of the job's, never gets
  a round an earlier one got."""
  first = keys.fresh(JaxCoordinator(), "test_keys/shared")
  survivors = groups.Survivors(JaxCoordinator(), [0])
  assert [keys.fresh(JaxCoordinator(), "test_keys/shared"),
          keys.fresh(survivors, "test_keys/shared")] == [
              f"test_keys/shared/{keys.index(first) + n}" for n in (1, 2)]


def test_a_process_by_itself_counts_its_own_rounds():
  solo = groups.SoloCoordinator()
  assert [keys.fresh(solo, "a"), keys.fresh(solo, "a")] == ["a/0", "a/1"]
  assert keys.fresh(groups.SoloCoordinator(), "a") == "a/0"


def test_rounds_taken_from_many_threads_are_each_taken_once():
  rounds = keys.Rounds()
  taken: list[int] = []
  lock = threading.Lock()

  def take():
    for _ in range(100):
      n = rounds.take("x")
      with lock:
        taken.append(n)

  threads = [threading.Thread(target=take) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(taken) == list(range(400))
