"""Block manager: exact block ids, eviction order, copy-on-write, the hit cap, counters, and
property-based invariants (with and without forced hash collisions) over a simulated KV cache.

The "KV cache" of these tests is `FakeKV`: every slot remembers the token prefix whose last
token's K/V was written there (a real K/V depends on the whole prefix). A sequence reads its
own slots through its block table, so any block handed to the wrong sequence, any write into a
block another sequence still reads, and any missed copy-on-write shows up as a wrong prefix.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import pagedq.engine.block_manager as bm_module
from pagedq.engine.block_manager import BlockManager, hash_block
from pagedq.engine.sequence import Sequence

Prefix = tuple[int, ...]


def make_seq(seq_id: int, tokens: Seq[int]) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        index=0,
        arrival=seq_id,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        max_tokens=100,
    )


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What the scheduler does for a whole prefill: allocate, run, commit, register."""
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Look the prompt up, take the hits and the rest; returns the hits."""
    hits = bm.match_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(hits) * bm.block_size, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hits


def state_of(bm: BlockManager, *seqs: Sequence) -> Any:
    """Everything `allocate` may change, for "a failed allocate changes nothing"."""
    return (
        [(b.ref_count, b.block_hash, b.token_ids, b.parent, b.version) for b in bm.blocks],
        list(bm._free_plain),
        list(bm._free_cached),
        dict(bm._cached),
        dataclasses.astuple(bm.stats),
        list(bm.pending_copies),
        [(list(s.block_table), s.num_computed_tokens, s.num_hashed_blocks) for s in seqs],
    )


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


# --- exact expectations ----------------------------------------------------------------------


def test_block_manager_does_not_import_torch() -> None:
    code = (
        "import sys, pagedq.engine.block_manager, pagedq.engine.scheduler\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rejects_an_empty_pool_or_block() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4, True)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0, True)


def test_fresh_blocks_are_handed_out_in_id_order() -> None:
    bm = BlockManager(8, 4, True)
    a = make_seq(0, range(10))
    assert bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    bm.check_invariants([a.block_table])


def test_common_prefix_of_two_full_blocks_shares_ids_0_and_1() -> None:
    bm = BlockManager(8, 4, True)
    a = make_seq(0, range(10))  # blocks [0 1 2 3] [4 5 6 7] [8 9 . .]
    assert admit(bm, a) == []
    assert [bm.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]
    assert bm.blocks[0].token_ids == (0, 1, 2, 3) and bm.blocks[1].token_ids == (4, 5, 6, 7)
    assert bm.blocks[1].parent == (0, 0) and bm.blocks[0].parent is None
    b = make_seq(1, [*range(8), 100, 101, 102])
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    bm.check_invariants([a.block_table, b.block_table])


def test_hash_is_chained_and_keyed() -> None:
    h0 = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == h0
    assert hash_block(h0, [3, 4]) != hash_block(None, [3, 4])
    assert hash_block(None, [1, 2], extra_key=5) != h0
    assert hash_block(None, [2, 1]) != h0


def test_a_different_extra_key_does_not_hit() -> None:
    bm = BlockManager(8, 2, True)
    a = make_seq(0, [1, 2, 3, 4, 5])
    compute_all(bm, a)
    assert bm.match_prefix(make_seq(1, [1, 2, 3, 4, 5])) == [0, 1]
    assert bm.match_prefix(make_seq(2, [1, 2, 3, 4, 5]), extra_key=9) == []


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(4, []), (5, [0]), (8, [0]), (9, [0, 1]), (12, [0, 1]), (13, [0, 1, 2])],
)
def test_hit_cap_leaves_at_least_one_token_to_compute(num_tokens: int, expected: list[int]) -> None:
    bm = BlockManager(8, 4, True)
    compute_all(bm, make_seq(0, range(16)))  # 4 full registered blocks
    seq = make_seq(1, range(num_tokens))
    hits = bm.match_prefix(seq)
    assert hits == expected
    assert len(hits) * 4 < num_tokens


def test_exactly_k_full_blocks_hit_k_minus_one_and_compute_the_last() -> None:
    bm = BlockManager(8, 4, True)
    compute_all(bm, make_seq(0, range(8)))
    b = make_seq(1, range(8))
    hits = bm.match_prefix(b)
    assert hits == [0]
    assert bm.allocate(b, 4, hits)
    assert b.num_computed_tokens == 4 and b.block_table == [0, 2]


def test_hits_stop_at_the_first_different_block() -> None:
    bm = BlockManager(8, 2, True)
    compute_all(bm, make_seq(0, [1, 2, 3, 4, 5, 6, 7]))
    assert bm.match_prefix(make_seq(1, [1, 2, 9, 4, 5, 6, 7])) == [0]
    # Same tokens in block 1 but after another block 0: the chained hash differs.
    assert bm.match_prefix(make_seq(2, [0, 2, 3, 4, 5])) == []


def test_disabled_prefix_caching_registers_and_hits_nothing() -> None:
    bm = BlockManager(4, 2, False)
    a = make_seq(0, [1, 2, 3, 4, 5])
    compute_all(bm, a)
    assert all(b.block_hash is None for b in bm.blocks)
    assert bm.match_prefix(make_seq(1, [1, 2, 3, 4, 5])) == []
    bm.free(a)
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 4


def test_eviction_takes_plain_blocks_first_then_lru_cached_tails_before_heads() -> None:
    bm = BlockManager(8, 2, True)
    a = make_seq(0, [1, 2, 3, 4, 5])  # blocks 0 1 full, 2 partial
    b = make_seq(1, [6, 7, 8, 9, 10])  # blocks 3 4 full, 5 partial
    compute_all(bm, a)
    compute_all(bm, b)
    bm.free(a)  # last block first: 2 -> plain, then 1, 0 -> cached
    bm.free(b)  # 5 -> plain, then 4, 3 -> cached
    assert list(bm._free_plain) == [6, 7, 2, 5]
    assert list(bm._free_cached) == [1, 0, 4, 3]
    c = make_seq(2, range(20, 30))  # 5 blocks: the 4 plain ones, then evict a's tail (1)
    compute_all(bm, c)
    assert c.block_table == [6, 7, 2, 5, 1]
    assert bm.stats.evicted_blocks == 1
    assert bm.blocks[1].version == 1 and bm.blocks[1].token_ids == (28, 29)  # c's now
    d = make_seq(3, [1, 2, 3, 4, 5])  # a's head survived; 2 more blocks evict b's tail, head
    assert admit(bm, d) == [0]
    assert d.block_table == [0, 4, 3]
    assert bm.stats.evicted_blocks == 3
    assert bm.num_free_blocks == 0
    bm.check_invariants([c.block_table, d.block_table])


def test_a_hit_refreshes_a_cached_block_in_the_lru_order() -> None:
    bm = BlockManager(3, 2, True)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [4, 5, 6])
    compute_all(bm, a)  # [0, 1]
    bm.free(a)  # plain [2, 1], cached [0]
    compute_all(bm, b)  # takes 2, 1
    bm.free(b)  # plain [1], cached [0, 2]
    again = make_seq(2, [1, 2, 7])
    assert admit(bm, again) == [0]
    bm.free(again)  # cached [2, 0]: 0 was used last
    assert list(bm._free_cached) == [2, 0]
    fresh = make_seq(3, [9, 9, 9, 9])
    compute_all(bm, fresh)  # plain 1, then evicts 2 (least recently used), not 0
    assert fresh.block_table == [1, 2]
    assert bm.match_prefix(make_seq(4, [1, 2, 3])) == [0]
    assert bm.match_prefix(make_seq(5, [4, 5, 6])) == []


def test_a_reused_block_is_a_valid_parent_at_its_new_version() -> None:
    bm = BlockManager(2, 2, True)
    a = make_seq(0, [1, 2, 3, 4])
    compute_all(bm, a)
    bm.free(a)  # cached [1, 0]
    b = make_seq(1, [5, 6, 7])
    compute_all(bm, b)  # evicts 1, then 0: both at version 1
    assert b.block_table == [1, 0] and [x.version for x in bm.blocks] == [1, 1]
    b.token_ids.append(8)
    compute_all(bm, b)
    assert bm.blocks[0].parent == (1, 1)
    assert bm.match_prefix(make_seq(2, [5, 6, 7, 8, 9])) == [1, 0]
    assert bm.match_prefix(make_seq(3, [1, 2, 3, 4, 5])) == []


def test_forget_step_unregisters_only_this_steps_blocks() -> None:
    """A failed forward: blocks registered since begin_step are never hit again (a freed one
    becomes a plain free block); blocks registered in earlier steps stay shareable."""
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    old = make_seq(0, [1, 2, 3, 4])
    compute_all(bm, old)  # blocks 0, 1 registered in an earlier step
    bm.begin_step()
    new = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8])
    assert admit(bm, new) == [0, 1]  # the hits, then blocks 2, 3 registered in this step
    assert bm.match_prefix(make_seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])) == [0, 1, 2, 3]
    forgotten = bm.forget_step()
    assert forgotten == {new.block_table[2], new.block_table[3]}
    assert bm.match_prefix(make_seq(3, [1, 2, 3, 4, 5, 6, 7, 8, 9])) == [0, 1]
    bm.free(new)
    bm.check_invariants([old.block_table])
    assert bm.num_cached_free_blocks == 0  # the forgotten ones went back as plain blocks
    assert bm.forget_step() == set()  # nothing registered since


def test_fork_shares_every_block_and_copies_the_partial_one_on_write() -> None:
    bm = BlockManager(8, 4, True)
    a = make_seq(0, range(6))  # [0 1 2 3] [4 5 . .]
    compute_all(bm, a)
    b = make_seq(1, range(6))
    bm.fork(a, b)
    assert b.block_table == [0, 1] and b.num_computed_tokens == 6
    assert ref_counts(bm)[:2] == [2, 2]
    a.token_ids.append(50)
    b.token_ids.append(60)
    assert bm.allocate(a, 1)  # a writes slot 2 of block 1: it gets its own copy first
    assert a.block_table == [0, 2]
    assert bm.take_copies() == [(1, 2)]
    assert bm.take_copies() == []
    assert ref_counts(bm)[:3] == [2, 1, 1]
    assert bm.allocate(b, 1)  # block 1 is b's alone now: written in place
    assert b.block_table == [0, 1]
    assert bm.take_copies() == []
    bm.check_invariants([a.block_table, b.block_table])


def test_fork_copies_when_the_child_writes_first() -> None:
    bm = BlockManager(8, 4, True)
    a = make_seq(0, range(5))
    compute_all(bm, a)
    b = make_seq(1, range(5))
    bm.fork(a, b)
    b.token_ids.append(7)
    assert bm.allocate(b, 1)
    assert b.block_table == [0, 2] and a.block_table == [0, 1]
    assert bm.take_copies() == [(1, 2)]


def test_fork_shares_only_the_computed_blocks_not_reserved_ones() -> None:
    bm = BlockManager(8, 4, False)
    a = make_seq(0, range(5))
    assert bm.allocate(a, 12)  # a static slot: 3 blocks reserved for 12 tokens
    a.num_computed_tokens = 5
    b = make_seq(1, range(5))
    bm.fork(a, b)
    assert b.block_table == [0, 1] and ref_counts(bm)[:3] == [2, 2, 1]


@pytest.mark.parametrize("caching", [True, False])
def test_full_shared_blocks_are_never_copied(caching: bool) -> None:
    bm = BlockManager(8, 4, caching)
    a = make_seq(0, range(8))
    compute_all(bm, a)
    b = make_seq(1, range(8))
    bm.fork(a, b)
    for seq, token in ((a, 1), (b, 2)):
        seq.token_ids.append(token)
        assert bm.allocate(seq, 1)
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert bm.take_copies() == []
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]


def test_a_copy_on_write_without_a_free_block_fails_and_changes_nothing() -> None:
    bm = BlockManager(2, 4, True)
    a = make_seq(0, range(6))
    compute_all(bm, a)
    b = make_seq(1, range(6))
    bm.fork(a, b)
    a.token_ids.append(9)
    before = state_of(bm, a, b)
    assert not bm.allocate(a, 1)
    assert state_of(bm, a, b) == before
    bm.free(b)  # the partial block is a's alone: no copy needed any more
    assert bm.allocate(a, 1)
    assert a.block_table == [0, 1] and bm.take_copies() == []


def test_a_failed_allocate_changes_nothing() -> None:
    bm = BlockManager(4, 2, True)
    a = make_seq(0, [1, 2, 3, 4, 5])
    compute_all(bm, a)  # [0 1 2]: 0, 1 registered
    bm.free(a)  # plain [3, 2], cached [1, 0]
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # hits [0, 1], then needs 3 more of 2
    hits = bm.match_prefix(b)
    assert hits == [0, 1]
    before = state_of(bm, b)
    assert not bm.allocate(b, 6, hits)
    assert state_of(bm, b) == before
    assert bm.allocate(b, 4, hits)  # two fresh blocks: exactly what is left
    assert b.block_table == [0, 1, 3, 2] and bm.num_free_blocks == 0
    assert bm.stats.evicted_blocks == 0
    c = make_seq(2, [7])
    before = state_of(bm, b, c)
    assert not bm.allocate(c, 1)
    assert state_of(bm, b, c) == before


def test_counters() -> None:
    bm = BlockManager(6, 2, True)
    a = make_seq(0, [1, 2, 3, 4, 5])
    assert admit(bm, a) == []
    bm.count_hit(5, 0)
    b = make_seq(1, [1, 2, 3, 4, 6])
    assert admit(bm, b) == [0, 1]
    bm.count_hit(5, 4)
    assert (bm.stats.queried_tokens, bm.stats.hit_tokens) == (10, 4)
    assert bm.stats.peak_used_blocks == 4 and bm.num_used_blocks == 4
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.stats.peak_used_blocks == 4
    assert bm.num_cached_free_blocks == 2  # blocks 0, 1; the partial ones are plain
    c = make_seq(2, range(10, 22))  # 6 blocks: 4 plain, then both cached ones evicted
    compute_all(bm, c)
    assert bm.stats.evicted_blocks == 2 and bm.stats.peak_used_blocks == 6


def test_free_resets_the_sequence_and_keeps_its_hashes() -> None:
    bm = BlockManager(4, 2, True)
    a = make_seq(0, [1, 2, 3, 4, 5])
    compute_all(bm, a)
    hashes = list(a.block_hashes)
    a.hash_chain_broken = True
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0 and a.num_hashed_blocks == 0
    assert not a.hash_chain_broken  # its next admission may register blocks again
    assert a.block_hashes == hashes
    assert admit(bm, a) == [0, 1]  # a preempted sequence re-prefills from its own blocks


def test_a_forced_collision_never_hands_out_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda p, t, e=0: 7)
    bm = BlockManager(8, 2, True)
    a = make_seq(0, [1, 2, 3, 4, 5])
    compute_all(bm, a)
    assert bm.blocks[0].block_hash == 7
    assert a.hash_chain_broken  # block 1 has the same hash as block 0: not registered
    assert bm.match_prefix(make_seq(1, [9, 9, 3, 4, 5])) == []
    assert bm.match_prefix(make_seq(2, [1, 2, 3, 4, 5])) == [0]


def test_a_colliding_block_after_another_parent_is_not_a_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A block's hash ignores its parent here: only the stored parent tells [A B] from [C B].
    monkeypatch.setattr(bm_module, "hash_block", lambda p, t, e=0: sum(t) % 3)
    bm = BlockManager(8, 2, True)
    ab = make_seq(0, [1, 2, 1, 0, 5])  # A = (1, 2): hash 0, B = (1, 0): hash 1
    c = make_seq(1, [0, 2, 5])  # C = (0, 2): hash 2
    compute_all(bm, ab)
    compute_all(bm, c)
    assert [b.block_hash for b in bm.blocks[:4]] == [0, 1, None, 2]
    assert bm.match_prefix(make_seq(2, [0, 2, 1, 0, 5])) == [3]
    assert bm.match_prefix(make_seq(3, [1, 2, 1, 0, 5])) == [0, 1]


# --- property-based: random operations over a simulated KV cache -------------------------------


class FakeKV:
    """Per slot, the token prefix whose last token's K/V was written there (None: never)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[list[Prefix | None]] = [[None] * block_size for _ in range(num_blocks)]

    def copy(self, pairs: Seq[tuple[int, int]]) -> None:
        for src, dst in pairs:
            self.slots[dst] = list(self.slots[src])

    def after(self, pairs: Seq[tuple[int, int]]) -> FakeKV:
        """The cache once the pending copies are done (they run before the next forward)."""
        done = FakeKV(0, self.bs)
        done.slots = list(self.slots)
        done.copy(pairs)
        return done

    def read(self, seq: Sequence, pos: int) -> Prefix | None:
        return self.slots[seq.block_table[pos // self.bs]][pos % self.bs]

    def compute(self, seq: Sequence, start: int, num_tokens: int) -> Prefix | None:
        """Tokens [start, start + num_tokens): each reads the K/V before it and writes its own.
        Returns what the last one saw (None if the cache held garbage)."""
        value: Prefix | None = self.read(seq, start - 1) if start else ()
        for pos in range(start, start + num_tokens):
            value = None if value is None else (*value, seq.token_ids[pos])
            self.slots[seq.block_table[pos // self.bs]][pos % self.bs] = value
        return value

    def holds(self, seq: Sequence) -> bool:
        """Every computed token of `seq` has its own K/V in its blocks."""
        return all(
            self.read(seq, p) == tuple(seq.token_ids[: p + 1])
            for p in range(seq.num_computed_tokens)
        )


TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class BlockManagerMachine(RuleBasedStateMachine):
    """Allocate / append / step / fork / free at random; check the invariants after each."""

    hash_fn: Callable[..., int] | None = None  # a colliding hash_block, patched in for a run

    def __init__(self) -> None:
        super().__init__()
        self._saved_hash = bm_module.hash_block
        if self.hash_fn is not None:
            bm_module.hash_block = self.hash_fn
        self.live: list[Sequence] = []  # sequences holding blocks
        self.freed: list[Sequence] = []  # freed (preempted) ones that may come back
        self.next_id = 0

    def teardown(self) -> None:
        bm_module.hash_block = self._saved_hash

    @initialize(num_blocks=st.integers(8, 24), block_size=st.integers(2, 4), caching=st.booleans())
    def make_pool(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.kv = FakeKV(num_blocks, block_size)

    def _new_seq(self, tokens: Seq[int]) -> Sequence:
        self.next_id += 1
        return make_seq(self.next_id, tokens)

    def _pick(self, i: int) -> Sequence:
        return self.live[i % len(self.live)]

    def _run(self, seq: Sequence, num_new: int, early: bool, hits: Seq[int] = ()) -> bool:
        """allocate + forward + commit; on failure check that nothing changed. `early`: the
        blocks are registered when scheduled (as the scheduler does), else after the forward."""
        before = state_of(self.bm, *self.live, seq)
        if not self.bm.allocate(seq, num_new, hits):
            assert state_of(self.bm, *self.live, seq) == before
            return False
        start = seq.num_computed_tokens
        if early:
            self.bm.cache_full_blocks(seq, start + num_new)
        self.kv.copy(self.bm.take_copies())
        seen = self.kv.compute(seq, start, num_new)
        assert seen == tuple(seq.token_ids[: start + num_new]), f"seq {seq.seq_id} read foreign KV"
        seq.num_computed_tokens = start + num_new
        if not early:
            self.bm.cache_full_blocks(seq)
        return True

    def _admit(self, seq: Sequence, chunk: int, early: bool) -> None:
        """Prefix lookup (every hit must hold exactly this sequence's prefix), then a chunk."""
        hits = self.bm.match_prefix(seq)
        bs, tokens = self.bm.block_size, seq.token_ids
        assert len(hits) * bs < seq.num_tokens  # the cap: at least one token to compute
        for i, block_id in enumerate(hits):
            block = self.bm.blocks[block_id]
            assert block.token_ids == tuple(tokens[i * bs : (i + 1) * bs])
            assert block.parent == (
                None if i == 0 else (hits[i - 1], self.bm.blocks[hits[i - 1]].version)
            )
            for j in range(bs):
                assert self.kv.slots[block_id][j] == tuple(tokens[: i * bs + j + 1])
        num_new = min(chunk, seq.num_tokens - len(hits) * bs)
        if self._run(seq, num_new, early, hits):
            self.live.append(seq)
        elif seq not in self.freed:
            self.freed.append(seq)

    @rule(tokens=TOKENS, chunk=st.integers(1, 10), early=st.booleans())
    def add(self, tokens: list[int], chunk: int, early: bool) -> None:
        self._admit(self._new_seq(tokens), chunk, early)

    @precondition(lambda self: self.freed)
    @rule(i=st.integers(0, 99), chunk=st.integers(1, 10), early=st.booleans())
    def readmit(self, i: int, chunk: int, early: bool) -> None:
        """A preempted sequence comes back, with its tokens and hashes so far."""
        seq = self.freed.pop(i % len(self.freed))
        self._admit(seq, chunk, early)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), tokens=TOKENS)
    def append(self, i: int, tokens: list[int]) -> None:
        self._pick(i).token_ids.extend(tokens)

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.live))
    @rule(i=st.integers(0, 99), chunk=st.integers(1, 10), early=st.booleans())
    def step(self, i: int, chunk: int, early: bool) -> None:
        behind = [s for s in self.live if s.num_computed_tokens < s.num_tokens]
        seq = behind[i % len(behind)]
        self._run(seq, min(chunk, seq.num_tokens - seq.num_computed_tokens), early)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        parent = self._pick(i)
        child = self._new_seq(parent.token_ids)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        seq = self._pick(i)
        self.bm.free(seq)
        self.live.remove(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        self.freed.append(seq)

    @invariant()
    def pool_is_consistent(self) -> None:
        bm = self.bm
        bm.check_invariants([s.block_table for s in self.live])
        assert bm.num_free_blocks == sum(b.ref_count == 0 for b in bm.blocks)
        assert len(set(bm._free_plain)) == len(bm._free_plain)
        assert bm.stats.peak_used_blocks >= bm.num_used_blocks
        for seq in self.live:
            assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens)

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        for seq in self.live:
            assert self.kv.holds(seq), f"seq {seq.seq_id} lost its K/V"

    @invariant()
    def hashed_blocks_hold_their_tokens_after_their_parent(self) -> None:
        bs = self.bm.block_size
        for block in self.bm.blocks:
            if block.block_hash is None:
                continue
            assert block.token_ids is not None and len(block.token_ids) == bs
            last = self.kv.slots[block.block_id][-1]
            assert last is not None and last[-bs:] == block.token_ids
            if block.parent is None:
                assert len(last) == bs
                continue
            parent_id, version = block.parent
            if self.bm.blocks[parent_id].version == version:
                assert self.kv.slots[parent_id][-1] == last[:-bs]


# PAGEDQ_PROPERTY_EXAMPLES=2000 for a thorough run; the default keeps the suite fast.
SETTINGS = settings(
    max_examples=int(os.environ.get("PAGEDQ_PROPERTY_EXAMPLES", "50")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class ConstantHashMachine(BlockManagerMachine):
    hash_fn = staticmethod(lambda p, t, e=0: 7)


class SumHashMachine(BlockManagerMachine):
    hash_fn = staticmethod(lambda p, t, e=0: sum(t) % 3)


TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = SETTINGS
TestConstantHashCollisions = ConstantHashMachine.TestCase
TestConstantHashCollisions.settings = SETTINGS
TestSumHashCollisions = SumHashMachine.TestCase
TestSumHashCollisions.settings = SETTINGS
