"""SequenceStore: the overlapping-delta/resync rules and idle eviction, with a fake clock."""

from drafter_sdk.server.sequence_store import SequenceStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


K = ("v", "r")


def test_full_context_then_deltas_append():
    store = SequenceStore()
    assert store.sync(K, 0, [1, 2, 3]).tokens.tolist() == [1, 2, 3]
    assert store.sync(K, 3, [4]).tokens.tolist() == [1, 2, 3, 4]
    result = store.sync(K, 4, [])
    assert result.tokens.tolist() == [1, 2, 3, 4] and not result.discarded


def test_full_context_replaces_and_reports_the_discarded_state():
    store = SequenceStore()
    assert not store.sync(K, 0, [1, 2]).discarded
    replaced = store.sync(K, 0, [7])
    assert replaced.tokens.tolist() == [7] and replaced.discarded


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


def test_overlapping_delta_skips_the_tokens_already_held():
    store = SequenceStore()
    store.sync(K, 0, [1, 2, 3, 4])
    # new_tokens[0] sits at offset 2: [3, 4] are held already, [5, 6] are new.
    result = store.sync(K, 2, [3, 4, 5, 6])
    assert result.tokens.tolist() == [1, 2, 3, 4, 5, 6] and not result.discarded
    # An overlap that covers exactly what is held appends nothing.
    assert store.sync(K, 1, [2, 3, 4, 5, 6]).tokens.tolist() == [1, 2, 3, 4, 5, 6]


def test_replica_that_missed_steps_catches_up_from_the_overlap():
    """Two stores as two round-robin replicas: each sees every other call, and catches up."""
    a, b = SequenceStore(), SequenceStore()
    committed = [7, 8, 9]
    lengths = [0, 0]  # committed length after the last two calls (overlap of two steps)
    for step in range(10):
        replica = (a, b)[step % 2]
        ctx = lengths[0]
        result = replica.sync(K, ctx, committed[ctx:])
        assert result.tokens.tolist() == committed
        lengths = [lengths[1], len(committed)]
        committed = committed + [step, step + 1][: 1 + step % 2]  # one or two tokens per step


def test_gap_requires_resync_and_keeps_the_true_prefix():
    store = SequenceStore()
    store.sync(K, 0, [1, 2, 3])
    result = store.sync(K, 4, [5, 6])  # position 3 is missing
    assert result.tokens is None and not result.discarded
    assert K in store
    # The full context that follows extends the held prefix: nothing derived from it is lost.
    full = store.sync(K, 0, [1, 2, 3, 4, 5, 6])
    assert full.tokens.tolist() == [1, 2, 3, 4, 5, 6] and not full.discarded


def test_delta_ending_before_the_held_length_is_inconsistent():
    store = SequenceStore()
    store.sync(K, 0, [1, 2, 3, 4, 5])
    result = store.sync(K, 2, [3, 4])  # ends at 4, but 5 tokens are held
    assert result.tokens is None and result.discarded
    assert K not in store


def test_overlap_that_differs_from_the_held_tokens_is_inconsistent():
    store = SequenceStore()
    store.sync(K, 0, [1, 2, 3, 4])
    result = store.sync(K, 2, [3, 9, 5])  # position 3 holds 4, not 9
    assert result.tokens is None and result.discarded
    assert store.sync(K, 4, [5]).tokens is None  # the stale state is gone


def test_full_context_that_extends_the_held_one_is_an_append():
    store = SequenceStore()
    store.sync(K, 0, [1, 2])
    result = store.sync(K, 0, [1, 2, 3])
    assert result.tokens.tolist() == [1, 2, 3] and not result.discarded
    shorter = store.sync(K, 0, [1, 2])  # a different (shorter) context replaces
    assert shorter.tokens.tolist() == [1, 2] and shorter.discarded


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
