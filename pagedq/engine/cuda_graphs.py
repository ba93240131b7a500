"""Decode steps replayed from CUDA graphs.

A decode step launches a dozen kernels per layer, hundreds for a 7B model, and at small
batches launching them from Python takes longer than running them (H200, the 224 GPTQ
linears of a Llama-2-7B step at one token: 2.7 ms eager, 1.13 ms replayed). `DecodeGraphs`
captures the whole forward of a plain decode step, logits included, and replays it.

- **Keys.** A graph is captured per (batch bucket, context bucket), on first use: the step
  runs once eagerly on the static buffers (kernels compile, the CUDA extension builds,
  autotuners measure, all outside capture), is captured, then replayed. Batch buckets are
  BATCH_BUCKETS up to the first one that holds `max_num_seqs`; a step of n sequences pads
  to the smallest bucket >= n. The context bucket is the smallest power of two (at least
  MIN_CONTEXT) >= the step's longest context, capped at the pool's longest sequence: the
  attention launch plan depends on that bound, a Python int frozen into the graph.
- **Padding rows** `n..bucket` get token 0 at position 0, slot -1 (`write_kv` skips it) and
  seq_len 0 (attention gives zeros): they never read or write the KV cache.
- **Static buffers** are sized for the largest bucket and shared by every graph, as is the
  graphs' memory pool (steps run one at a time). Inputs are copied into them from pinned
  host memory; the logits come back in one [max_batch, vocab] fp32 buffer, so a step's
  logits are valid until the next step.
- **Eager steps.** Prefill chunks, a cascade over a shared prefix (its length is frozen into
  the launch), batches larger than the largest bucket and CPU devices run eagerly. A capture
  that fails turns graphs off for the engine, with one warning, and the step runs eagerly.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedq.models.llama import KVCache, LlamaForCausalLM
from pagedq.ops.attention import AttentionMetadata

# Padded batch sizes; each step pads to the next one (at most a third of a step is padding
# above 8 sequences). Larger decode batches run eagerly: their launches cost less than the math.
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_CONTEXT = 256  # tokens: the smallest context bucket


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets an engine running up to `max_num_seqs` sequences captures."""
    fitting = tuple(b for b in BATCH_BUCKETS if b < max_num_seqs)
    above = [b for b in BATCH_BUCKETS if b >= max_num_seqs]
    return fitting + tuple(above[:1])


def pick_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n rows, or None when none does."""
    return next((b for b in buckets if b >= n), None)


def context_bucket(max_seq_len: int, capacity: int) -> int:
    """The smallest power of two >= max_seq_len and >= MIN_CONTEXT, capped at `capacity`."""
    bound = MIN_CONTEXT
    while bound < max_seq_len:
        bound *= 2
    return min(bound, capacity)


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """A plain decode step on the host: one new token per sequence, no shared-prefix cascade."""

    tokens: list[int]  # [n] the new token of each sequence
    positions: list[int]  # [n] its position
    slots: list[int]  # [n] its KV slot: block_id * block_size + offset
    seq_lens: list[int]  # [n] context length including the new token
    tables: list[list[int]]  # [n][*] block tables, ragged
    sampling_rows: list[int]  # rows whose logits are returned, ascending


def padded_inputs(
    step: DecodeStep, bucket: int, width: int
) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
    """The step's token ids, positions, slots and seq_lens padded to `bucket` rows, and its
    block tables as `bucket` rows of `width` pages (see the module docstring for the padding).
    A table longer than `width` (static slots reserve the whole max_model_len) is cut: no
    context reaches past `width` pages."""
    pad = bucket - len(step.tokens)
    tables = [t[:width] + [0] * (width - len(t)) for t in step.tables] + [[0] * width] * pad
    return (
        step.tokens + [0] * pad,
        step.positions + [0] * pad,
        step.slots + [-1] * pad,
        step.seq_lens + [0] * pad,
        tables,
    )


class DecodeGraphs:
    """Captured decode forwards of one model over one KV pool (see the module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[KVCache],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.capacity = -(-max_model_len // block_size) * block_size  # tokens of a full table
        self.device = model.embed_tokens.weight.device
        rows, width = self.buckets[-1], self.capacity // block_size
        dev, i32 = self.device, torch.int32
        self._ids = torch.zeros(rows, dtype=i32, device=dev)  # [rows] token ids
        self._positions = torch.zeros(rows, dtype=i32, device=dev)  # [rows]
        self._slots = torch.full((rows,), -1, dtype=i32, device=dev)  # [rows]
        self._seq_lens = torch.zeros(rows, dtype=i32, device=dev)  # [rows]
        self._starts = torch.arange(rows + 1, dtype=i32, device=dev)  # [rows + 1] one query each
        self._tables = torch.zeros(rows, width, dtype=i32, device=dev)  # [rows, width]
        vocab = model.config.vocab_size
        self._logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.enabled = True
        self.replays = 0  # steps served by a graph (captures included)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, step: DecodeStep, max_seq_len: int) -> torch.Tensor | None:
        """Logits [len(step.sampling_rows), vocab] fp32 of the step, from its graph; None
        when no graph takes it (the caller runs it eagerly)."""
        n = len(step.tokens)
        bucket = pick_bucket(n, self.buckets)
        if not self.enabled or bucket is None or max_seq_len > self.capacity:
            return None
        key = (bucket, context_bucket(max_seq_len, self.capacity))
        self._load(step, bucket, key[1] // self.block_size)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key)
            if graph is None:
                return None
            self._graphs[key] = graph
        graph.replay()
        self.replays += 1
        logits = self._logits[:n]
        if len(step.sampling_rows) == n:
            return logits
        rows = torch.tensor(step.sampling_rows, dtype=torch.int64).to(self.device)
        return logits.index_select(0, rows)

    def _load(self, step: DecodeStep, bucket: int, width: int) -> None:
        """Copy the step into rows 0..bucket of the static buffers (padding rows after it)."""
        ids, positions, slots, seq_lens, tables = padded_inputs(step, bucket, width)
        for buffer, values in zip(
            (self._ids, self._positions, self._slots, self._seq_lens),
            (ids, positions, slots, seq_lens),
            strict=True,
        ):
            buffer[:bucket].copy_(_pinned(values), non_blocking=True)
        self._tables[:bucket, :width].copy_(_pinned(tables), non_blocking=True)

    def _forward(self, bucket: int, context: int) -> None:
        """The step over the static buffers' first `bucket` rows, logits into `_logits`."""
        meta = AttentionMetadata(
            slot_mapping=self._slots[:bucket],
            block_tables=self._tables[:bucket, : context // self.block_size],
            seq_lens=self._seq_lens[:bucket],
            query_start_loc=self._starts[: bucket + 1],
            max_query_len=1,
            max_seq_len=context,
        )
        ids, positions = self._ids[:bucket], self._positions[:bucket]
        hidden = self.model(ids, positions, self.kv_caches, meta)  # [bucket, hidden]
        self._logits[:bucket].copy_(self.model.compute_logits(hidden))

    def _capture(self, key: tuple[int, int]) -> torch.cuda.CUDAGraph | None:
        """Warm up once on a side stream, then capture; None (graphs off) if capture fails."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # capture on the model's device, not torch's default
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(*key)  # compiles and autotunes outside capture
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                self._forward(*key)
        except RuntimeError as e:
            self.enabled = False
            warnings.warn(
                f"pagedq: capturing a CUDA graph for a decode step of {key[0]} sequences failed "
                f"({e}); decode steps run eagerly from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        return graph


def _pinned(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).pin_memory()
