"""Turns a `SchedulerOutput` into tensors, runs the model and returns the logits to sample.

Owns the KV pool (one k/v tensor pair per layer, allocated once) and the copy-on-write copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedq.engine.cuda_graphs import DecodeGraphs, DecodeStep, PendingTokens, prefix_bucket
from pagedq.engine.scheduler import ScheduledChunk, SchedulerOutput
from pagedq.engine.sequence import PENDING_TOKEN
from pagedq.models.llama import LlamaForCausalLM, allocate_kv_caches
from pagedq.ops.attention import AttentionMetadata
from pagedq.ops.transfer import to_device
from pagedq.ops.triton_loader import launch_device

# a decode batch's shared leading pages go through the cascade path from this many on:
# below it, the extra prefix launch and partials cost more than re-reading a few pages
CASCADE_MIN_BLOCKS = 4


class ModelRunner:
    """Runs flat batches of prefill chunks and decode tokens over the paged KV cache.

    On CUDA, decode steps replay captured graphs (`DecodeGraphs`) unless
    `enforce_eager`; every other step, and every step on CPU, runs the model eagerly.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        *,
        max_model_len: int,
        max_num_seqs: int,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.kv_caches = allocate_kv_caches(
            model.config, num_blocks, block_size, dtype, self.device
        )
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = DecodeGraphs(
                model, self.kv_caches, block_size, max_model_len, max_num_seqs
            )

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, previous: tuple[torch.Tensor, dict[int, int]] | None = None
    ) -> torch.Tensor:
        """Forward every chunk; logits [num_sampling_chunks, vocab] fp32, in chunk order (a
        replayed step's logits are valid until the next step). `previous`: the last step's
        sampled tokens on the device and the row of each sequence (seq_id), for chunks whose
        input is a PENDING_TOKEN."""
        # Triton launches on the current device: the model's, for the copies and graphs too
        with launch_device(self.device):
            self._copy_blocks(out.blocks_to_copy)
            pending = _pending_tokens(out.chunks, previous)
            if self.graphs is not None:
                step = self._decode_step(out.chunks)
                if step is not None:
                    logits = self.graphs.run(step, max(step.seq_lens), pending)
                    if logits is not None:
                        return logits
            input_ids, positions, meta, last = self._prepare(out.chunks)
            if pending is not None:
                pending.write(input_ids)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
            return self.model.compute_logits(hidden[last])

    def _decode_step(self, chunks: Sequence[ScheduledChunk]) -> DecodeStep | None:
        """The step as a `DecodeStep` when it is a decode step (one token per sequence), with
        its shared leading pages rounded down to a prefix bucket; else None."""
        if any(c.num_tokens != 1 for c in chunks):
            return None
        bs = self.block_size
        tables = [c.seq.block_table for c in chunks]
        seq_lens = [c.start + 1 for c in chunks]
        shared = shared_prefix_len(tables, seq_lens, bs) // bs
        return DecodeStep(
            tokens=[c.seq.token_ids[c.start] for c in chunks],
            positions=[c.start for c in chunks],
            slots=[c.seq.block_table[c.start // bs] * bs + c.start % bs for c in chunks],
            seq_lens=seq_lens,
            tables=tables,
            sampling_rows=[i for i, c in enumerate(chunks) if c.samples],
            shared_prefix_len=prefix_bucket(shared, CASCADE_MIN_BLOCKS) * bs,
        )

    def _copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = to_device(list(zip(*pairs, strict=True)), torch.int64, self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _prepare(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        last: list[int] = []
        for c in chunks:
            end = c.start + c.num_tokens
            table = c.seq.block_table
            tokens += c.seq.token_ids[c.start : end]
            positions += range(c.start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(c.start, end)]
            seq_lens.append(end)
            starts.append(starts[-1] + c.num_tokens)
            if c.samples:
                last.append(starts[-1] - 1)
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        tables = [c.seq.block_table + [0] * (max_blocks - len(c.seq.block_table)) for c in chunks]
        decode = all(c.num_tokens == 1 for c in chunks)
        shared = shared_prefix_len(tables, seq_lens, bs) if decode else 0
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, dev),
            block_tables=to_device(tables, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            query_start_loc=to_device(starts, torch.int32, dev),
            max_query_len=max(c.num_tokens for c in chunks),
            max_seq_len=max(seq_lens),
            shared_prefix_len=shared,
        )
        return (
            to_device(tokens, torch.int64, dev),
            to_device(positions, torch.int64, dev),
            meta,
            to_device(last, torch.int64, dev),
        )


def _pending_tokens(
    chunks: Sequence[ScheduledChunk], previous: tuple[torch.Tensor, dict[int, int]] | None
) -> PendingTokens | None:
    """Where the step's inputs take tokens the previous step left on the device: decode
    chunks whose token is a PENDING_TOKEN (input row = chunk index in a decode step, the
    chunk's first token in a mixed one)."""
    if previous is None:
        return None
    tokens, rows_of = previous
    at: list[int] = []
    rows: list[int] = []
    first = 0
    for c in chunks:
        if c.seq.token_ids[c.start] == PENDING_TOKEN:
            if c.num_tokens != 1:
                raise AssertionError("a pending token can only be a decode step's input")
            at.append(first)
            rows.append(rows_of[c.seq.seq_id])
        first += c.num_tokens
    return PendingTokens(at, rows, tokens) if at else None


def shared_prefix_len(tables: list[list[int]], seq_lens: list[int], block_size: int) -> int:
    """Tokens of the leading block ids that every table shares, for the cascade decode path.

    Capped so that every sequence keeps at least one own token ((seq_len - 1) // block_size
    blocks at most); 0 for fewer than two sequences or fewer than CASCADE_MIN_BLOCKS shared
    blocks. The common prefix of all rows is that of the lexicographically smallest and
    largest rows, so the cost is two C-level passes plus a loop over the shared blocks.
    """
    if len(tables) < 2:
        return 0
    limit = min(seq_lens) - 1
    limit = min(limit // block_size, *(len(t) for t in tables))
    lo, hi = min(tables), max(tables)
    shared = 0
    while shared < limit and lo[shared] == hi[shared]:
        shared += 1
    return shared * block_size if shared >= CASCADE_MIN_BLOCKS else 0
