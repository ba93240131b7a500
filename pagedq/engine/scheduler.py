"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

Principle: every sequence has `num_computed_tokens` (K/V in the cache) and `num_tokens`; each
step hands out a token budget so that the first catches up with the second. Decode (one token
behind), prefill and chunked prefill are the same case. Running sequences are served first,
oldest first; waiting ones are then admitted in arrival order while blocks, budget and
`max_num_seqs` last, their prefix-cache hits costing nothing. When a running sequence needs a
block and none is free, the newest running sequence is preempted by recompute: its blocks are
freed (hashed ones stay cached, so the re-prefill mostly hits) and it returns to the front of
the queue. Requests that could never fit alone are rejected before they get here, so the
oldest running sequence always makes progress.

The static mode is the preallocated baseline: a batch of slots, each reserving
`max_model_len` tokens of blocks at admission, nobody joining until the whole batch is done,
no sharing. Only the memory policy differs; the steps and kernels are the same.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from pagedq.engine.block_manager import BlockManager
from pagedq.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step (validated by the engine config that builds it)."""

    max_num_seqs: int  # sequences running at once
    max_num_batched_tokens: int  # tokens computed per step
    max_model_len: int  # longest sequence, prompt and output together
    static: bool = False  # preallocated slots and static batches instead of paging
    enable_chunked_prefill: bool = True  # split prompts longer than the remaining budget


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens `seq.token_ids[start : start + num_tokens]` are computed this step. Read-only by
    convention: one is built per row per step, and a frozen dataclass costs three times as
    much to build."""

    seq: Sequence
    start: int  # seq.num_computed_tokens when scheduled
    num_tokens: int  # >= 1
    samples: bool  # the chunk reaches the end of the sequence: its last logits give a new token

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        """The next `num_tokens` tokens of `seq` after its computed ones."""
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == len(seq.token_ids))


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # running sequences first, then newly admitted ones
    preempted: tuple[Sequence, ...]  # sent back to the queue this step
    blocks_to_copy: tuple[tuple[int, int], ...]  # (src, dst) copy-on-write before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Owns the waiting queue and the running list.

    Invariants: a sequence is in at most one of `waiting` / `running`; a RUNNING sequence
    holds blocks for all its computed tokens; `running` is sorted by (arrival, seq_id).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0
        bs = block_manager.block_size
        self.slot_blocks = -(-config.max_model_len // bs)  # static mode: blocks per slot
        self.num_static_slots = min(
            config.max_num_seqs, block_manager.num_blocks // self.slot_blocks
        )

    # --- queue management ------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A fork that already holds its parent's blocks joins the running list if there is room.

        Room: fewer than `max_num_seqs` running; static mode also needs a slot of its own (else
        both would write into the parent's reserved blocks). Without room the fork releases its
        blocks and waits, in arrival order, to recompute (paged mode: from the prefix cache).
        """
        if self.config.static:
            roomy = self._reserve_fork_slot(seq)
        else:
            roomy = len(self.running) < self.config.max_num_seqs
        if roomy:
            self._insert_running(seq)
            return
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        at = 0  # keep the waiting queue in arrival order
        while at < len(self.waiting) and _order(self.waiting[at]) < _order(seq):
            at += 1
        self.waiting.insert(at, seq)

    def _insert_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_order)

    def _reserve_fork_slot(self, seq: Sequence) -> bool:
        """Static mode: reserve a whole slot for the fork, if one is free."""
        slot_tokens = self.slot_blocks * self.bm.block_size
        return len(self.running) < self.num_static_slots and self.bm.allocate(
            seq, slot_tokens - seq.num_computed_tokens
        )

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (stop, length, abort): leave the queues and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self.bm.begin_step()
        budget = self.config.max_num_batched_tokens
        preempted: list[Sequence] = []
        if self.config.static:
            chunks = self._schedule_static(budget)
        else:
            chunks, preempted, budget = self._schedule_running(budget)
            if not preempted:
                chunks += self._admit_waiting(budget)
        return SchedulerOutput(tuple(chunks), tuple(preempted), tuple(self.bm.take_copies()))

    def commit(self, output: SchedulerOutput) -> None:
        """After the forward: the chunks' K/V are in the cache."""
        for chunk in output.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens

    def rollback(self, output: SchedulerOutput) -> None:
        """The forward of `output` failed: none of its K/V was written, so the engine stays usable
        only if nothing can read it. Blocks registered for the step are forgotten. A sequence
        keeps its progress (commit never ran, so its computed tokens are those before the step)
        unless its computed tokens lean on the step: a prefix hit on a forgotten block (admitted
        in this step) or a copy-on-write copy that may not have run; those recompute."""
        forgotten = self.bm.forget_step()
        copied = {dst for _, dst in output.blocks_to_copy}
        bs = self.bm.block_size
        for chunk in reversed(output.chunks):  # the oldest ends up first in the queue
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            table = seq.block_table
            if any(b in forgotten for b in table[: chunk.start // bs]) or any(
                b in copied for b in table
            ):
                self._requeue_first(seq)
                continue
            for i in range(min(seq.num_hashed_blocks, len(table))):
                if table[i] in forgotten:  # register it again when the step is redone
                    seq.num_hashed_blocks = i
                    break
            if not self.config.static:  # the step's blocks come back when it is redone
                self.bm.release_tail(seq)

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        """Record a chunk and share the blocks it fills (see BlockManager.cache_full_blocks)."""
        chunk = ScheduledChunk.of(seq, num_new)
        end = chunk.start + num_new
        if end // self.bm.block_size > seq.num_hashed_blocks:  # else no block filled (decode)
            self.bm.cache_full_blocks(seq, end)
        return chunk

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledChunk], list[Sequence], int]:
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        running, allocate, scheduled = self.running, self.bm.allocate, self._scheduled  # hot loop
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not allocate(seq, num_new):
                victim = running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                chunks.append(scheduled(seq, num_new))
                budget -= num_new
                i += 1
        return chunks, preempted, budget

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            remaining = seq.num_tokens - len(hits) * self.bm.block_size
            num_new = min(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.bm.allocate(seq, num_new, hits):
                break
            self._start(seq, len(hits) * self.bm.block_size)
            chunks.append(self._scheduled(seq, num_new))
            budget -= num_new
        return chunks

    def _schedule_static(self, budget: int) -> list[ScheduledChunk]:
        if not self.running:
            self._admit_static_batch()
        chunks: list[ScheduledChunk] = []
        for seq in self.running:
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                break
            chunks.append(ScheduledChunk.of(seq, num_new))
            budget -= num_new
        return chunks

    def _admit_static_batch(self) -> None:
        """Fill every free slot, reserving `max_model_len` tokens of blocks per sequence."""
        slot_tokens = self.slot_blocks * self.bm.block_size
        while self.waiting and len(self.running) < self.num_static_slots:
            seq = self.waiting[0]
            if not self.bm.allocate(seq, slot_tokens):
                break
            self._start(seq, 0)

    def _start(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.waiting.popleft()
        if seq.num_cached_tokens is None:  # first admission: count the prompt's lookup
            seq.num_cached_tokens = num_hit_tokens
            self.bm.count_hit(seq.num_prompt_tokens, num_hit_tokens)
        seq.admitted_at = self.num_steps
        self._insert_running(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue_first(seq)
        self.num_preemptions += 1

    def _requeue_first(self, seq: Sequence) -> None:
        """A running sequence releases its blocks and waits at the front to recompute."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)


def _order(seq: Sequence) -> tuple[int, int]:
    return (seq.arrival, seq.seq_id)
