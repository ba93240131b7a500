"""A sequence: the token ids of one completion and where its KV lives.

Plain Python, no torch: the scheduler and the block manager are tested exactly on the CPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# A token sampled on the device whose value the host does not know yet (launch-ahead with
# async scheduling appends it, the step's result replaces it): counted, never hashed or read.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: never admitted, or preempted and waiting to recompute
    RUNNING = "running"  # holds blocks and is scheduled every step
    FINISHED = "finished"  # done; its blocks are freed


@dataclass(slots=True, eq=False)
class Sequence:
    """One completion of one request.

    Invariant: `num_computed_tokens <= len(token_ids)`; the KV of `token_ids[:num_computed_tokens]`
    lives in the blocks of `block_table` (in order, `block_size` tokens per block).
    """

    seq_id: int  # unique per engine, increasing: a larger id was created later
    request_id: str  # the request this completion belongs to
    index: int  # which of the request's `n` completions this is
    arrival: int  # order of the request's arrival; preemption takes the largest first
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int  # length of the prompt part of token_ids
    max_tokens: int  # generation stops after this many new tokens
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # block ids, in token order
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block so far
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    hash_chain_broken: bool = False  # a block's hash was held by another block: stop registering
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache at admission
    admitted_at: int | None = None  # scheduler step counter of the latest admission
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    extra: dict[str, Any] = field(default_factory=dict)  # engine-side state (detokenizer, rng…)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host knows (all but a trailing PENDING_TOKEN)."""
        n = len(self.token_ids)
        return n - 1 if n and self.token_ids[-1] == PENDING_TOKEN else n

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill_done(self) -> bool:
        """Every token but the newest sampled one has its KV computed."""
        return self.num_computed_tokens >= self.num_tokens - 1
