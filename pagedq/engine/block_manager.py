"""Fixed-size KV pages, prefix sharing by chained hashes, reference counts and LRU eviction.

Plain Python with no torch import, so it is tested exactly on the CPU. The KV tensors
themselves live in the model runner; this class only hands out block ids.
"""

from __future__ import annotations

import struct
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import xxhash

from pagedq.engine.sequence import Sequence

_U64 = struct.Struct("<Q")


@dataclass(slots=True)
class Block:
    """One KV page."""

    block_id: int  # index into the per-layer k_cache / v_cache pools
    ref_count: int = 0  # block tables holding this block
    block_hash: int | None = None  # chained hash once full and registered; None: not shareable
    token_ids: tuple[int, ...] | None = None  # the tokens of a hashed block, compared on every hit
    parent: tuple[int, int] | None = None  # (block_id, version) of the block before it; None: first
    version: int = 0  # bumped whenever the block is reused for other content


@dataclass(slots=True)
class BlockStats:
    """Counters of the prefix cache and the pool (read by `LLM.stats()`)."""

    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of those, tokens served from cached blocks
    evicted_blocks: int = 0  # cached blocks whose hash was dropped to make room
    peak_used_blocks: int = 0  # most blocks held by sequences at once


def hash_block(parent_hash: int | None, token_ids: Seq[int], extra_key: int = 0) -> int:
    """h_i = xxh3_64(h_{i-1} ‖ token ids of block i ‖ extra key); h_{-1} is 0."""
    h = xxhash.xxh3_64()
    h.update(_U64.pack(0 if parent_hash is None else parent_hash))
    h.update(array("q", token_ids).tobytes())
    h.update(_U64.pack(extra_key & 0xFFFFFFFFFFFFFFFF))
    return h.intdigest()


@dataclass(slots=True)
class _Pending:
    """What `allocate` decided, before it commits (so a failure changes nothing)."""

    hits: list[int] = field(default_factory=list)
    num_fresh: int = 0
    cow: bool = False


class BlockManager:
    """Hands out KV blocks to sequences and shares full prompt blocks between them.

    Invariants (checked by `check_invariants`, used by the tests):
    - a block with ref_count > 0 is in no free queue; a block with ref_count == 0 is in exactly
      one: `_free_cached` if it has a hash (LRU order, oldest first), else `_free_plain`;
    - `_cached[h] == b` iff block b is registered with hash h (one block per hash);
    - a hashed block is full and its K/V are those of its tokens after its parent chain: a hit
      checks the tokens and the (block_id, version) of the parent, so a hash collision or a
      reused parent can never hand a sequence someone else's KV;
    - only full blocks are shared by hash; a partial block is shared only by `fork`, and is
      copied before either sequence writes into it (copy-on-write).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}
        self.stats = BlockStats()
        self.pending_copies: list[
            tuple[int, int]
        ] = []  # (src, dst) copy-on-write, drained per step
        self._step_registered: list[int] = []  # blocks registered since `begin_step`

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached free blocks are evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache ------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence, extra_key: int = 0) -> list[int]:
        """Cached blocks holding the longest prefix of `seq`, leaving >= 1 token to compute.

        Does not take the blocks: `allocate` does, so a failed admission changes nothing.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks, extra_key)
        hits: list[int] = []
        parent: tuple[int, int] | None = None
        for i in range(max_blocks):
            block_id = self._cached.get(seq.block_hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            start = i * self.block_size
            if block.parent != parent or block.token_ids != tuple(
                seq.token_ids[start : start + self.block_size]
            ):
                break
            hits.append(block_id)
            parent = (block_id, block.version)
        return hits

    def _extend_hashes(self, seq: Sequence, num_full: int, extra_key: int) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            seq.block_hashes.append(
                hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], extra_key)
            )

    # --- allocation ----------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: Seq[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq`, first taking the prefix `hits`.

        Returns False, changing nothing, when the pool cannot supply the blocks (the scheduler
        then preempts or waits). `hits` only applies to a sequence with an empty block table.
        """
        room = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        if not hits and num_new_tokens <= room and not self._needs_copy(seq, num_new_tokens):
            return True  # nothing to take (a decode step, mostly)
        plan = self._plan(seq, num_new_tokens, hits)
        if plan is None:
            return False
        for block_id in plan.hits:
            self._take(block_id)
        if plan.hits:
            seq.block_table.extend(plan.hits)
            seq.num_hashed_blocks = len(plan.hits)
            seq.num_computed_tokens = len(plan.hits) * self.block_size
        if plan.cow:
            self._copy_on_write(seq)
        for _ in range(plan.num_fresh):
            seq.block_table.append(self._take(self._pop_free()))
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, self.num_used_blocks)
        return True

    def _plan(self, seq: Sequence, num_new_tokens: int, hits: Seq[int]) -> _Pending | None:
        if hits and seq.block_table:
            raise AssertionError("prefix hits apply only to a sequence without blocks")
        computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
        have = len(seq.block_table) + len(hits)
        need = self.blocks_for(computed + num_new_tokens)
        plan = _Pending(hits=list(hits), num_fresh=max(0, need - have))
        plan.cow = self._needs_copy(seq, num_new_tokens)
        revived = sum(1 for b in plan.hits if self.blocks[b].ref_count == 0)
        if plan.num_fresh + int(plan.cow) > self.num_free_blocks - revived:
            return None
        return plan

    def _needs_copy(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Writing into a shared, partially filled last block needs a private copy first."""
        table = seq.block_table
        return bool(
            table
            and num_new_tokens > 0
            and seq.num_computed_tokens % self.block_size
            and self.blocks[table[-1]].ref_count > 1
        )

    def _copy_on_write(self, seq: Sequence) -> None:
        src = seq.block_table[-1]
        dst = self._take(self._pop_free())
        self.blocks[src].ref_count -= 1
        seq.block_table[-1] = dst
        self.pending_copies.append((src, dst))

    def _pop_free(self) -> int:
        """A block for new content: plain free blocks first, then evict the LRU cached one."""
        if self._free_plain:
            return self._free_plain.popleft()
        block_id, _ = self._free_cached.popitem(last=False)
        self._unregister(self.blocks[block_id])
        self.stats.evicted_blocks += 1
        return block_id

    def _unregister(self, block: Block) -> None:
        """Drop `block`'s hash: nothing can hit it any more (its version invalidates children)."""
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        block.block_hash, block.token_ids, block.parent = None, None, None
        block.version += 1

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0 and block.block_hash is not None:
            del self._free_cached[block_id]
        block.ref_count += 1
        return block_id

    def count_hit(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Record one admission's prefix-cache lookup in the counters."""
        self.stats.queried_tokens += num_prompt_tokens
        self.stats.hit_tokens += num_hit_tokens

    # --- registration, forks, release ------------------------------------------------------

    def cache_full_blocks(
        self, seq: Sequence, num_tokens: int | None = None, extra_key: int = 0
    ) -> None:
        """Register the full blocks among the first `num_tokens` tokens of `seq` (default: its
        computed tokens), so that other sequences can share them.

        The scheduler registers blocks as soon as it schedules the tokens that fill them: the
        forward writes every token's K/V of a layer before any attention of that layer reads,
        so a sequence admitted in the same step can already share them. A block that ends in
        a pending token (one the device has sampled, the host not yet read) waits for the next
        call.
        """
        if not self.enable_prefix_caching or seq.hash_chain_broken:
            return
        if num_tokens is None:
            num_tokens = seq.num_computed_tokens
        num_full = num_tokens // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return  # no block filled since the last call (most decode steps)
        num_full = min(num_full, seq.num_known_tokens // self.block_size)  # values to hash
        self._extend_hashes(seq, num_full, extra_key)
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and seq.block_hashes[i] not in self._cached:
                start = i * self.block_size
                prev = self.blocks[seq.block_table[i - 1]] if i else None
                block.block_hash = seq.block_hashes[i]
                block.token_ids = tuple(seq.token_ids[start : start + self.block_size])
                block.parent = None if prev is None else (prev.block_id, prev.version)
                self._cached[block.block_hash] = block.block_id
                self._step_registered.append(block.block_id)
            elif block.block_hash != seq.block_hashes[i]:
                seq.hash_chain_broken = True  # another block holds this hash: stop sharing here
                return
            seq.num_hashed_blocks = i + 1

    def begin_step(self) -> None:
        """A new schedule starts: `forget_step` would undo the registrations from here on."""
        self._step_registered.clear()

    def forget_step(self) -> set[int]:
        """The forward of this step failed: the blocks registered for it hold no K/V, so they
        must never be hit. Unregister them (a freed one moves to the plain free queue); returns
        their ids."""
        forgotten = set()
        for block_id in self._step_registered:
            block = self.blocks[block_id]
            if block.block_hash is None or self._cached.get(block.block_hash) != block_id:
                continue  # evicted and reused since
            self._unregister(block)
            forgotten.add(block_id)
            if block.ref_count == 0:
                del self._free_cached[block_id]
                self._free_plain.append(block_id)
        self._step_registered.clear()
        return forgotten

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares the blocks holding `parent`'s computed tokens (the partial last one
        until a write). Blocks reserved beyond them (static mode) stay `parent`'s alone."""
        assert not child.block_table
        shared = parent.block_table[: self.blocks_for(parent.num_computed_tokens)]
        for block_id in shared:
            self._take(block_id)
        child.block_table = list(shared)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.hash_chain_broken = parent.hash_chain_broken

    def free(self, seq: Sequence) -> None:
        """Release the blocks of `seq`, last block first, so eviction takes tails before heads."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.hash_chain_broken = False

    def release_tail(self, seq: Sequence) -> None:
        """Release the blocks of `seq` past those of its computed tokens, last block first."""
        keep = self.blocks_for(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, keep)

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unreferenced block joins its free queue."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            if block.block_hash is None:
                self._free_plain.append(block_id)
            else:
                self._free_cached[block_id] = None

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copy-on-write pairs since the last call; the runner copies them."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # --- checks --------------------------------------------------------------------------------

    def check_invariants(self, tables: Seq[Seq[int]]) -> None:
        """Assert the class invariants given every live block table (for tests)."""
        holders = [0] * self.num_blocks
        for table in tables:
            for block_id in table:
                holders[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (block, holders[block.block_id])
            in_plain = block.block_id in self._free_plain
            in_cached = block.block_id in self._free_cached
            if block.ref_count > 0:
                assert not in_plain and not in_cached, block
            else:
                assert in_plain != in_cached, block
                assert in_cached == (block.block_hash is not None), block
            if block.block_hash is not None:
                assert self._cached[block.block_hash] == block.block_id, block
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks)
