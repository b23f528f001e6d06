"""SequenceStore: the delta/resync rules and idle eviction, with a fake clock."""

from drafter_sdk.sequence_store import SequenceStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


K = ("v", "r")


def test_full_context_then_deltas_append():
    store = SequenceStore()
    assert store.sync(K, 0, [1, 2, 3]).tokens == [1, 2, 3]
    assert store.sync(K, 3, [4]).tokens == [1, 2, 3, 4]
    result = store.sync(K, 4, [])
    assert result.tokens == [1, 2, 3, 4] and not result.discarded


def test_full_context_replaces_and_reports_the_discarded_state():
    store = SequenceStore()
    assert not store.sync(K, 0, [1, 2]).discarded
    replaced = store.sync(K, 0, [7])
    assert replaced.tokens == [7] and replaced.discarded


def test_unknown_key_requires_resync_without_creating_state():
    store = SequenceStore()
    result = store.sync(K, 5, [1])
    assert result.tokens is None and not result.discarded
    assert K not in store


def test_length_mismatch_requires_resync_and_drops_the_stale_state():
    store = SequenceStore()
    store.sync(K, 0, [1, 2, 3])
    result = store.sync(K, 2, [9])  # the verifier thinks we hold 2 tokens; we hold 3
    assert result.tokens is None and result.discarded
    assert K not in store
    # Even the delta that would have matched the old length now needs a resync.
    assert store.sync(K, 3, [4]).tokens is None


def test_release_reports_whether_the_key_was_held():
    store = SequenceStore()
    store.sync(K, 0, [1])
    assert store.release(K)
    assert not store.release(K)
    assert len(store) == 0


def test_idle_eviction_drops_only_entries_untouched_for_the_timeout():
    clock = FakeClock()
    store = SequenceStore(idle_timeout_s=10, clock=clock)
    store.sync(("v", "a"), 0, [1])
    store.sync(("v", "b"), 0, [1])
    clock.now = 6
    store.sync(("v", "a"), 1, [2])  # a delta refreshes "a"
    clock.now = 11
    assert store.evict_idle() == [("v", "b")]
    assert ("v", "a") in store
    clock.now = 16
    assert store.evict_idle() == [("v", "a")]
    assert len(store) == 0
