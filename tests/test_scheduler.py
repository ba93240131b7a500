"""Scheduler over a real BlockManager and no model: admission, the token budget, chunked
prefill, prefix hits, preemption by recompute, the static mode, finish/abort, and a 64-request
run through a pool of about three sequences that must give the unconstrained tokens.

A step is simulated as the engine does it: `schedule()`, run the chunks on a fake KV cache,
`commit()`, append a sampled token to each chunk that `samples`, and finish sequences at their
`max_tokens`. The "model" sees only what the fake KV cache holds: every slot remembers the
token prefix whose last token's K/V was written there, and the next token is a deterministic
function of the prefix read back from the cache. A sequence given someone else's blocks, a
missed copy-on-write or a wrong recompute after preemption changes the tokens.
"""

from __future__ import annotations

import itertools
import os
import zlib
from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from unittest import mock

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import pagedq.engine.block_manager as bm_module
from pagedq.engine.block_manager import BlockManager
from pagedq.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedq.engine.sequence import Sequence, SequenceStatus
from tests.test_block_manager import FakeKV, Prefix

VOCAB = 40


def next_token(prefix: Seq[int], index: int = 0) -> int:
    """The fake model: a deterministic function of the whole prefix (and the completion index,
    standing in for the sampler's per-completion randomness)."""
    return zlib.crc32(array("q", [index, *prefix]).tobytes()) % VOCAB


def reference(prompt: Seq[int], max_tokens: int, index: int = 0) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, index))
    return tokens


@dataclass
class Sim:
    """A scheduler, its block manager and a fake model; `n` forks a request at its first token."""

    num_blocks: int
    block_size: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1024
    static: bool = False
    caching: bool = True
    chunked: bool = True
    seqs: list[Sequence] = field(default_factory=list)
    outputs: list[SchedulerOutput] = field(default_factory=list)
    n_of: dict[str, int] = field(default_factory=dict)
    samples: list[list[bool]] = field(default_factory=list)  # per step: chunk.samples
    checked: bool = True  # check the invariants after every step (O(num_blocks^2))
    fail_every: int = 0  # > 1: every fail_every-th forward raises and the step is rolled back
    failures: int = 0

    def __post_init__(self) -> None:
        self.bm = BlockManager(self.num_blocks, self.block_size, self.caching)
        config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            static=self.static,
            enable_chunked_prefill=self.chunked,
        )
        self.sched = Scheduler(config, self.bm)
        self.kv = FakeKV(self.num_blocks, self.block_size)
        self.ids = itertools.count()

    def add(self, prompt: Seq[int], max_tokens: int, n: int = 1) -> Sequence:
        seq_id, arrival = next(self.ids), len(self.n_of)
        seq = Sequence(seq_id, f"r{arrival}", 0, arrival, list(prompt), len(prompt), max_tokens)
        self.seqs.append(seq)
        self.n_of[seq.request_id] = n
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        was_running = set(map(id, self.sched.running))
        out = self.sched.schedule()
        if out.preempted:  # nobody is admitted in a step that preempted
            assert all(id(c.seq) in was_running for c in out.chunks)
        if self.fail_every > 1 and (len(self.outputs) + self.failures) % self.fail_every == 1:
            self.failures += 1  # the forward raised: nothing was computed
            self.sched.rollback(out)
            if self.checked:
                self.check()
            return out
        self.outputs.append(out)
        self.samples.append([c.samples for c in out.chunks])
        self.kv.copy(out.blocks_to_copy)
        seen = [self.kv.compute(c.seq, c.start, c.num_tokens) for c in out.chunks]
        self.sched.commit(out)
        for chunk, value in zip(out.chunks, seen, strict=True):
            if chunk.samples:
                for seq in self._forks_of(chunk.seq):
                    self._sample(seq, value)
        if self.checked:
            self.check()
        return out

    def _forks_of(self, seq: Sequence) -> list[Sequence]:
        group = [seq]
        n = self.n_of[seq.request_id]
        if n > 1 and seq.index == 0 and seq.num_output_tokens == 0:
            for index in range(1, n):
                child = Sequence(
                    next(self.ids), seq.request_id, index, seq.arrival, list(seq.token_ids),
                    seq.num_prompt_tokens, seq.max_tokens,
                )  # fmt: skip
                self.bm.fork(seq, child)
                self.sched.add_running(child)
                self.seqs.append(child)
                group.append(child)
        return group

    def _sample(self, seq: Sequence, value: Prefix | None) -> None:
        seq.token_ids.append(VOCAB if value is None else next_token(value, seq.index))
        if seq.num_output_tokens >= seq.max_tokens:
            self.sched.finish(seq, "length")

    def check(self) -> None:
        """Scheduler and pool invariants after a step."""
        sched = self.sched
        self.bm.check_invariants([s.block_table for s in sched.running])
        assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in sched.waiting)
        assert not set(map(id, sched.running)) & set(map(id, sched.waiting))
        order = [(s.arrival, s.seq_id) for s in sched.running]
        assert order == sorted(order)
        assert len(sched.running) <= self.max_num_seqs  # forks without room wait
        for seq in sched.waiting:
            assert seq.num_computed_tokens == 0
        if not self.static:  # a paged sequence holds exactly the blocks of its computed tokens
            assert all(
                len(s.block_table) == self.bm.blocks_for(s.num_computed_tokens)
                for s in sched.running
            )
        kv = self.kv.after(self.bm.pending_copies)  # a static fork's copy is still pending
        for seq in sched.running:
            assert kv.holds(seq), f"seq {seq.seq_id} lost its K/V"

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            out = self.step()
            assert out.chunks, "no progress with requests pending"
            steps += 1
            assert steps < max_steps
        return steps


def chunks_of(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    """(seq_id, start, num_tokens) of every chunk, in order."""
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks]


# --- admission, budget, chunked prefill ---------------------------------------------------------


def test_admission_is_in_arrival_order_up_to_max_num_seqs() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=2)
    seqs = [sim.add([i, i, i], max_tokens=1 + i) for i in range(5)]
    out = sim.step()
    assert chunks_of(out) == [(0, 0, 3), (1, 0, 3)]
    assert list(sim.sched.waiting) == seqs[2:]
    assert seqs[0].is_finished  # max_tokens 1: done after its first token
    out = sim.step()  # seq 1 decodes; seq 2 takes the freed place
    assert chunks_of(out) == [(1, 3, 1), (2, 0, 3)]
    assert seqs[1].is_finished and list(sim.sched.waiting) == seqs[3:]
    sim.run()
    assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
    # seq 2 finishes at the end of step 4, after that step's admission: seq 4 starts in step 5
    assert [s.admitted_at for s in seqs] == [1, 1, 2, 3, 5]


def test_a_100_token_prompt_with_budget_32_takes_4_steps() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=32)
    seq = sim.add(range(100), max_tokens=2)
    outs = [sim.step() for _ in range(4)]
    assert [chunks_of(o) for o in outs] == [
        [(0, s, n)] for s, n in ((0, 32), (32, 32), (64, 32), (96, 4))
    ]
    assert sim.samples == [[False], [False], [False], [True]]
    assert seq.num_tokens == 101 and seq.num_computed_tokens == 100
    assert len(seq.block_table) == 25


def test_decode_tokens_are_scheduled_before_new_prefill_chunks() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=32)
    a = sim.add([1, 2, 3], max_tokens=10)
    sim.step()
    b = sim.add(range(100), max_tokens=1)
    out = sim.step()
    assert chunks_of(out) == [(a.seq_id, 3, 1), (b.seq_id, 0, 31)]
    out = sim.step()  # b is running now: served after a, still before any newcomer
    c = sim.add([5], max_tokens=1)
    assert chunks_of(out) == [(a.seq_id, 4, 1), (b.seq_id, 31, 31)]
    out = sim.step()
    assert chunks_of(out) == [(a.seq_id, 5, 1), (b.seq_id, 62, 31)]
    out = sim.step()
    assert chunks_of(out) == [(a.seq_id, 6, 1), (b.seq_id, 93, 7), (c.seq_id, 0, 1)]


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=10, chunked=False)
    a = sim.add([1, 2, 3], max_tokens=4)
    sim.step()
    b = sim.add(range(10), max_tokens=1)
    out = sim.step()  # a's decode token leaves 9 < 10
    assert chunks_of(out) == [(a.seq_id, 3, 1)]
    sim.run()
    assert b.is_finished and any((b.seq_id, 0, 10) in chunks_of(o) for o in sim.outputs)


# --- prefix hits --------------------------------------------------------------------------------


def test_prefix_hits_are_free_and_capped_to_leave_one_token() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompt = list(range(16))
    a = sim.add(prompt, max_tokens=8)
    sim.step()  # a's 16 tokens: 4 full blocks registered
    b = sim.add(prompt, max_tokens=8)
    c = sim.add([*range(8), 30, 31, 32, 33, 34], max_tokens=8)
    out = sim.step()
    # a decodes 1; b hits 3 blocks (not 4: its last token's logits are needed) and computes 4;
    # c hits 2 blocks and computes 5; 10 of 16 tokens of budget for 29 prompt tokens.
    assert chunks_of(out) == [(a.seq_id, 16, 1), (b.seq_id, 12, 4), (c.seq_id, 8, 5)]
    assert (b.num_cached_tokens, c.num_cached_tokens, a.num_cached_tokens) == (12, 8, 0)
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert c.block_table[:2] == a.block_table[:2]
    assert (sim.bm.stats.queried_tokens, sim.bm.stats.hit_tokens) == (16 + 16 + 13, 20)
    sim.run()
    assert b.token_ids == a.token_ids == reference(prompt, 8)
    assert c.token_ids == reference(c.prompt_token_ids, 8)


def test_identical_prompts_admitted_in_one_step_share_the_blocks_being_computed() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=24)
    prompt = list(range(16))
    a, b, c = (sim.add(prompt, max_tokens=3) for _ in range(3))
    out = sim.step()
    # a's blocks are registered as a is scheduled (the forward writes every K/V of a layer
    # before any attention of it reads), so b and c hit 3 of them in the same step.
    assert chunks_of(out) == [(a.seq_id, 0, 16), (b.seq_id, 12, 4), (c.seq_id, 12, 4)]
    assert b.block_table[:3] == c.block_table[:3] == a.block_table[:3]
    assert len({a.block_table[3], b.block_table[3], c.block_table[3]}) == 3
    assert sim.bm.stats.hit_tokens == 24
    sim.run()
    assert a.token_ids == b.token_ids == c.token_ids == reference(prompt, 3)


def test_hits_do_not_count_against_the_budget() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=5)
    prompt = list(range(41))
    a = sim.add(prompt, max_tokens=1)
    sim.run()
    b = sim.add(prompt, max_tokens=1)
    out = sim.step()
    assert chunks_of(out) == [(b.seq_id, 40, 1)] and b.num_cached_tokens == 40
    assert b.token_ids == a.token_ids


# --- preemption ---------------------------------------------------------------------------------


def test_the_newest_running_sequence_is_preempted_first_and_goes_to_the_front() -> None:
    sim = Sim(num_blocks=5, block_size=4)
    a = sim.add(range(7), max_tokens=5)  # blocks 0 1
    b = sim.add(range(10, 17), max_tokens=4)  # blocks 2 3
    c = sim.add([20, 21, 22], max_tokens=5)  # block 4
    d = sim.add([30], max_tokens=1)  # no block left for d
    sim.step()
    assert [s.block_table for s in (a, b, c)] == [[0, 1], [2, 3], [4]]
    assert list(sim.sched.waiting) == [d]
    sim.step()  # every sequence fills its last slot: no new block yet
    assert (a.num_tokens, b.num_tokens, c.num_tokens) == (9, 9, 5)
    out = sim.step()
    # a needs a 3rd block: c (newest) is preempted and its block evicted for a; then b needs
    # one and is the newest left, so b preempts itself. Both go back before d, oldest first.
    assert [s.seq_id for s in out.preempted] == [c.seq_id, b.seq_id]
    assert chunks_of(out) == [(a.seq_id, 8, 1)]
    assert list(sim.sched.waiting) == [b, c, d]
    assert sim.sched.running == [a] and a.block_table == [0, 1, 4]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.status is SequenceStatus.WAITING
    assert sim.sched.num_preemptions == 2
    assert sim.bm.num_free_blocks == 2  # b's blocks, cached: no admission in this step though
    out = sim.step()  # b would hit its cached blocks 2 3 but needs a 3rd: it waits
    assert chunks_of(out) == [(a.seq_id, 9, 1)] and list(sim.sched.waiting) == [b, c, d]
    out = sim.step()  # a's 5th token: a finishes, freeing 4 (partial: plain), 1, 0 (cached)
    assert chunks_of(out) == [(a.seq_id, 10, 1)] and a.is_finished
    out = sim.step()
    # b hits its own blocks and takes the plain one: only its newest token is computed. c's
    # block was evicted for a: it recomputes all 5 tokens in a's cached blocks, LRU order.
    assert chunks_of(out) == [(b.seq_id, 8, 1), (c.seq_id, 0, 5)]
    assert b.block_table == [2, 3, 4] and c.block_table == [1, 0]
    assert b.num_cached_tokens == 0  # counted at the first admission only
    assert sim.bm.stats.hit_tokens == 0 and sim.bm.stats.evicted_blocks == 3
    assert list(sim.sched.waiting) == [d]
    sim.run()
    for seq in (a, b, c, d):
        assert seq.token_ids == reference(seq.prompt_token_ids, seq.max_tokens)
    assert sim.bm.num_used_blocks == 0


def test_no_admission_in_a_step_that_preempted() -> None:
    sim = Sim(num_blocks=4, block_size=4, max_num_batched_tokens=5, caching=False)
    a = sim.add(range(8), max_tokens=6)
    v = sim.add([9, 9, 9, 9, 9], max_tokens=3)
    out = sim.step()  # a's first 5 tokens (blocks 0 1); v waits for the budget
    assert chunks_of(out) == [(a.seq_id, 0, 5)]
    out = sim.step()  # a's last 3; v admitted with the 2 tokens of budget left (block 2)
    assert chunks_of(out) == [(a.seq_id, 5, 3), (v.seq_id, 0, 2)]
    out = sim.step()
    # a's decode takes the last free block (3); v's next 3 tokens need a 2nd block and v is
    # the newest running sequence: it preempts itself, freeing block 2.
    assert chunks_of(out) == [(a.seq_id, 8, 1)]
    assert [s.seq_id for s in out.preempted] == [v.seq_id]
    assert list(sim.sched.waiting) == [v] and v.status is SequenceStatus.WAITING
    assert sim.bm.num_free_blocks == 1  # v's next 4-token chunk would fit, but waits a step
    out = sim.step()
    assert chunks_of(out) == [(a.seq_id, 9, 1), (v.seq_id, 0, 4)]
    assert v.block_table == [2]
    sim.run()
    assert v.token_ids == reference(v.prompt_token_ids, 3)
    assert a.token_ids == reference(a.prompt_token_ids, 6)


# --- finish / abort ----------------------------------------------------------------------------


def test_finish_or_abort_of_waiting_and_running_sequences_frees_blocks() -> None:
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=1)
    a = sim.add(range(9), max_tokens=10)
    w = sim.add([1, 2], max_tokens=10)
    sim.step()
    assert sim.bm.num_used_blocks == 3
    sim.sched.finish(w, "abort")
    assert w.status is SequenceStatus.FINISHED and w.finish_reason == "abort"
    assert not sim.sched.waiting
    sim.sched.finish(a, "abort")
    assert a.finish_reason == "abort" and a.block_table == [] and not sim.sched.running
    assert sim.bm.num_used_blocks == 0 and not sim.sched.has_unfinished()
    assert sim.bm.num_cached_free_blocks == 2  # a's two full blocks stay reusable
    sim.sched.finish(a, "abort")  # a second finish is harmless
    sim.bm.check_invariants([])


# --- static mode --------------------------------------------------------------------------------


def test_static_slots_reserve_max_model_len_and_batches_do_not_mix() -> None:
    sim = Sim(num_blocks=10, block_size=4, max_num_seqs=8, max_model_len=10, static=True)
    assert sim.sched.slot_blocks == 3 and sim.sched.num_static_slots == 3  # 10 // ceil(10 / 4)
    prompt = [1, 2, 3, 4, 5]
    s = [sim.add(prompt, max_tokens=m) for m in (2, 5, 3, 2, 2)]
    out = sim.step()
    assert chunks_of(out) == [(0, 0, 5), (1, 0, 5), (2, 0, 5)]
    assert [x.block_table for x in s[:3]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [x.num_cached_tokens for x in s[:3]] == [0, 0, 0]  # no sharing of the same prompt
    assert list(sim.sched.waiting) == s[3:]
    while sim.sched.running:
        out = sim.step()
        assert all(c.seq in s[:3] for c in out.chunks)  # nobody joins mid-batch
        assert s[3].status is SequenceStatus.WAITING
    assert all(b.block_hash is None for b in sim.bm.blocks)
    out = sim.step()
    assert chunks_of(out) == [(3, 0, 5), (4, 0, 5)]
    # Free order: 9 never used, then each finished sequence's blocks, last block first.
    assert [x.block_table for x in s[3:]] == [[9, 2, 1], [0, 8, 7]]
    sim.run()
    assert all(x.token_ids == reference(prompt, x.max_tokens) for x in s)
    assert sim.sched.num_preemptions == 0


def test_static_slots_are_capped_by_max_num_seqs() -> None:
    sim = Sim(num_blocks=100, block_size=4, max_num_seqs=3, max_model_len=16, static=True)
    assert sim.sched.num_static_slots == 3
    sim = Sim(num_blocks=100, block_size=16, max_num_seqs=300, max_model_len=17, static=True)
    assert sim.sched.num_static_slots == 50


def test_a_static_fork_gets_its_own_slot_and_a_copy_of_the_partial_block() -> None:
    sim = Sim(num_blocks=12, block_size=4, max_model_len=12, static=True)
    a = sim.add([1, 2, 3, 4, 5], max_tokens=6, n=2)
    sim.step()  # a's prompt fills blocks 0 and 1 of its slot [0 1 2]; the fork joins the batch
    child = sim.seqs[1]
    assert a.block_table == [0, 1, 2] and child.block_table == [0, 3, 4]
    assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == 5
    out = sim.step()
    assert out.blocks_to_copy == ((1, 3),)
    sim.run()
    assert a.token_ids == reference(a.prompt_token_ids, 6, 0)
    assert child.token_ids == reference(a.prompt_token_ids, 6, 1)


def test_a_static_fork_without_a_free_slot_waits_for_the_next_batch() -> None:
    sim = Sim(num_blocks=5, block_size=4, max_model_len=12, static=True)  # one slot
    a = sim.add([1, 2, 3, 4, 5], max_tokens=6, n=2)
    b = sim.add([7, 7], max_tokens=2)
    sim.step()
    child = sim.seqs[2]
    assert child.status is SequenceStatus.WAITING and child.block_table == []
    assert list(sim.sched.waiting) == [child, b]  # it arrived with a, before b
    assert child.num_tokens == 6  # its first token is kept: the next batch recomputes 6
    sim.run()
    assert a.token_ids == reference(a.prompt_token_ids, 6, 0)
    assert child.token_ids == reference(a.prompt_token_ids, 6, 1)
    assert b.token_ids == reference(b.prompt_token_ids, 2)


# --- a pool of about three sequences, 64 requests ------------------------------------------------


def make_requests(count: int, seed: int) -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, n): a shared 8-token system prompt plus 1..12 unique tokens."""
    system = [next_token([seed, i], 7) for i in range(8)]
    requests = []
    for i in range(count):
        unique = [next_token([seed, i, j], 5) for j in range(1 + (i * 7 + seed) % 12)]
        requests.append((system + unique, 2 + (i * 5 + seed) % 14, 2 if i % 9 == 4 else 1))
    return requests


Key = tuple[str, int]  # (request id, completion index)


def completions(sim: Sim) -> dict[Key, list[int]]:
    return {(s.request_id, s.index): s.token_ids for s in sim.seqs}


def expected_completions(requests: list[tuple[list[int], int, int]]) -> dict[Key, list[int]]:
    return {
        (f"r{i}", k): reference(p, m, k) for i, (p, m, n) in enumerate(requests) for k in range(n)
    }


def run_requests(sim: Sim, requests: list[tuple[list[int], int, int]]) -> None:
    """Half arrive at once, the rest one per step while the first half runs."""
    half = len(requests) // 2
    for prompt, max_tokens, n in requests[:half]:
        sim.add(prompt, max_tokens, n)
    for prompt, max_tokens, n in requests[half:]:
        sim.step()
        sim.add(prompt, max_tokens, n)
    sim.run()


@pytest.mark.parametrize("caching", [True, False])
def test_64_requests_through_a_pool_of_three_sequences_give_the_unconstrained_tokens(
    caching: bool,
) -> None:
    requests = make_requests(64, seed=1)
    free = Sim(num_blocks=4096, block_size=4, caching=caching, checked=False)
    run_requests(free, requests)
    tight = Sim(
        num_blocks=27,  # the longest sequence (20 + 15 tokens) takes 9 blocks
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=24,
        caching=caching,
    )
    run_requests(tight, requests)
    expected = expected_completions(requests)
    assert completions(free) == expected
    assert completions(tight) == expected
    assert all(s.is_finished and s.finish_reason == "length" for s in tight.seqs)
    assert tight.sched.num_preemptions > 0 and tight.bm.num_used_blocks == 0
    assert free.sched.num_preemptions == 0
    assert any(o.blocks_to_copy for o in tight.outputs)
    if caching:
        assert tight.bm.stats.hit_tokens > 0 and tight.bm.stats.evicted_blocks > 0
    assert all(out.num_batched_tokens <= 24 for out in tight.outputs)


def test_64_requests_in_static_mode_give_the_same_tokens() -> None:
    requests = make_requests(64, seed=2)  # with forks: each needs a slot of its own
    sim = Sim(num_blocks=27, block_size=4, max_model_len=36, static=True, max_num_batched_tokens=24)
    run_requests(sim, requests)
    assert completions(sim) == expected_completions(requests)
    assert sim.sched.num_preemptions == 0 and sim.bm.stats.peak_used_blocks == 27


def test_64_requests_with_colliding_hashes_give_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda p, t, e=0: sum(t) % 3)
    requests = make_requests(64, seed=3)
    sim = Sim(num_blocks=27, block_size=4, max_num_seqs=16, max_num_batched_tokens=24)
    run_requests(sim, requests)
    expected = expected_completions(requests)
    assert completions(sim) == expected


def fit_to_pool(
    requests: list[tuple[list[int], int, int]], num_tokens: int
) -> list[tuple[list[int], int, int]]:
    """Trim every request to at most `num_tokens` tokens, so that it fits alone."""
    fitted = []
    for prompt, max_tokens, n in requests:
        prompt = prompt[: num_tokens - 1]
        fitted.append((prompt, min(max_tokens, num_tokens - len(prompt)), n))
    return fitted


@settings(max_examples=int(os.environ.get("PAGEDQ_PROPERTY_EXAMPLES", "30")), deadline=None)
@given(
    num_blocks=st.integers(6, 16),
    block_size=st.integers(2, 4),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 16),
    mode=st.sampled_from(["paged", "no-prefix-cache", "colliding-hash", "static"]),
    seed=st.integers(0, 1000),
    fail_every=st.sampled_from([0, 0, 2, 5]),
)
def test_random_small_configurations_finish_every_request_correctly(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    mode: str,
    seed: int,
    fail_every: int,
) -> None:
    """Any pool, budget and mode, with or without forwards that fail and are rolled back."""
    requests = fit_to_pool(make_requests(12, seed), num_blocks * block_size)
    longest = max(len(p) + m for p, m, _ in requests)
    sim = Sim(
        num_blocks,
        block_size,
        max_num_seqs,
        budget,
        max_model_len=longest,
        static=mode == "static",
        caching=mode != "no-prefix-cache",
        fail_every=fail_every,
    )
    colliding = (lambda p, t, e=0: sum(t) % 3) if mode == "colliding-hash" else bm_module.hash_block
    with mock.patch.object(bm_module, "hash_block", colliding):
        run_requests(sim, requests)
    assert completions(sim) == expected_completions(requests)
    assert sim.bm.num_used_blocks == 0
