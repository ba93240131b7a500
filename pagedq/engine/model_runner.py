"""Turns a `SchedulerOutput` into tensors, runs the model and returns the logits to sample.

Owns the KV pool (one k/v tensor pair per layer, allocated once) and the copy-on-write copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedq.engine.scheduler import ScheduledChunk, SchedulerOutput
from pagedq.models.llama import LlamaForCausalLM, allocate_kv_caches
from pagedq.ops.attention import AttentionMetadata


class ModelRunner:
    """Runs flat batches of prefill chunks and decode tokens over the paged KV cache."""

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.kv_caches = allocate_kv_caches(
            model.config, num_blocks, block_size, dtype, self.device
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Forward every chunk; logits [num_sampling_chunks, vocab] fp32, in chunk order."""
        self._copy_blocks(out.blocks_to_copy)
        input_ids, positions, meta, last = self._prepare(out.chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        return self.model.compute_logits(hidden[last])

    def _copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
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
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_tensor(slots, torch.int64, dev),
            block_tables=_tensor(tables, torch.int32, dev),
            seq_lens=_tensor(seq_lens, torch.int32, dev),
            query_start_loc=_tensor(starts, torch.int32, dev),
            max_query_len=max(c.num_tokens for c in chunks),
            max_seq_len=max(seq_lens),
        )
        return (
            _tensor(tokens, torch.int64, dev),
            _tensor(positions, torch.int64, dev),
            meta,
            _tensor(last, torch.int64, dev),
        )


def _tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor moved without blocking (pinned on CUDA so the copy is asynchronous)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
