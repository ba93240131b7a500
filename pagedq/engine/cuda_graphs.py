"""Decode steps replayed from CUDA graphs.

A decode step launches a dozen kernels per layer, hundreds for a 7B model, and at small
batches launching them from Python takes longer than running them (H200, the 224 GPTQ
linears of a Llama-2-7B step at one token: 2.7 ms eager, 1.13 ms replayed). `DecodeGraphs`
captures the whole forward of a decode step, logits included, and replays it.

- **Keys.** A graph is captured per (batch bucket, context bucket, prefix bucket), on first
  use: the step runs once eagerly on the static buffers (kernels compile, the CUDA extension
  builds, autotuners measure, all outside capture), is captured, then replayed. Batch buckets are
  BATCH_BUCKETS up to the first one that holds `max_num_seqs`; a step of n sequences pads
  to the smallest bucket >= n. The context bucket is the smallest power of two (at least
  MIN_CONTEXT) >= the step's longest context, capped at the pool's longest sequence: the
  attention launch plan depends on that bound, a Python int frozen into the graph.
- **Padding rows** `n..bucket` get token 0 at position 0, slot -1 (`write_kv` skips it) and
  seq_len 0 (attention gives zeros): they never read or write the KV cache.
- **Static buffers** are sized for the largest bucket and shared by every graph, as is the
  graphs' memory pool (steps run one at a time). A step's inputs are written into a pinned
  staging buffer and moved in one copy (`StepInputs`); the logits come back in one
  [max_batch, vocab] fp32 buffer, so a step's logits are valid until the next step.
- **Shared prefixes.** A step whose sequences share leading pages (a system prompt) runs the
  cascade decode, whose prefix length is frozen into the launch: it is the third part of the
  key, rounded down to a prefix bucket (`prefix_bucket`: 4, 6, 8, 12, 16, 24, ... pages), so a
  batch job needs one or two more graphs, and pages past the bucket are read per sequence.
- **Eager steps.** Prefill chunks, batches larger than the largest bucket and CPU devices run
  eagerly. A capture that fails turns graphs off for the engine, with one warning, and the
  step runs eagerly.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from pagedq.models.llama import KVCache, LlamaForCausalLM
from pagedq.ops.attention import AttentionMetadata
from pagedq.ops.transfer import to_device

# Padded batch sizes; each step pads to the next one (at most a third of a step is padding
# above 8 sequences). Larger decode batches run eagerly: their launches cost less than the math.
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_CONTEXT = 256  # tokens: the smallest context bucket
T = TypeVar("T", torch.Tensor, np.ndarray)


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets an engine running up to `max_num_seqs` sequences captures."""
    fitting = tuple(b for b in BATCH_BUCKETS if b < max_num_seqs)
    above = [b for b in BATCH_BUCKETS if b >= max_num_seqs]
    return fitting + tuple(above[:1])


def pick_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n rows, or None when none does."""
    return next((b for b in buckets if b >= n), None)


def prefix_bucket(pages: int, smallest: int) -> int:
    """`pages` rounded down to 2^k or 3 * 2^(k-1) pages (at most a third is lost), 0 below
    `smallest` pages."""
    if pages < smallest:
        return 0
    power = 1 << (pages.bit_length() - 1)
    half = power // 2
    return max(power + half if pages >= power + half else power, smallest)


def context_bucket(max_seq_len: int, capacity: int) -> int:
    """The smallest power of two >= max_seq_len and >= MIN_CONTEXT, capped at `capacity`."""
    bound = MIN_CONTEXT
    while bound < max_seq_len:
        bound *= 2
    return min(bound, capacity)


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """A decode step on the host: one new token per sequence (a shared prefix: the cascade)."""

    tokens: list[int]  # [n] the new token of each sequence
    positions: list[int]  # [n] its position
    slots: list[int]  # [n] its KV slot: block_id * block_size + offset
    seq_lens: list[int]  # [n] context length including the new token
    tables: list[list[int]]  # [n][*] block tables, ragged
    sampling_rows: list[int]  # rows whose logits are returned, ascending
    shared_prefix_len: int = 0  # tokens of leading pages every table shares (cascade), bucketed


@dataclass(frozen=True, slots=True)
class PendingTokens:
    """Input tokens the host does not know yet: the previous step sampled them on the device."""

    at: list[int]  # input rows (tokens of the step) that take one
    rows: list[int]  # the row of `tokens` each of them takes
    tokens: torch.Tensor  # [rows of the previous step] int64, on the device

    def write(self, ids: torch.Tensor) -> None:
        """Put the tokens into the step's input ids (on the device, queued on the stream)."""
        index = to_device([self.at, self.rows], torch.int64, ids.device)
        ids[index[0]] = self.tokens[index[1]].to(ids.dtype)


class StepInputs:
    """Where a step's inputs sit in one flat int32 buffer, so that one copy moves them all.

    Four vectors of `rows` (token ids, positions, slots, seq_lens), then a [rows, width] page
    table. `fill` writes a step padded to `bucket` rows (see the module docstring for the
    padding), its tables cut to `pages` columns: a table longer than that (static slots
    reserve the whole max_model_len) reaches no context past them.
    """

    def __init__(self, rows: int, width: int) -> None:
        self.rows = rows
        self.width = width
        self.size = rows * (4 + width)  # elements

    def views(self, flat: T) -> tuple[T, T, T, T, T]:
        """ids, positions, slots, seq_lens [rows] and tables [rows, width] of a flat buffer
        (a tensor or a numpy array)."""
        r = self.rows
        vectors = [flat[i * r : (i + 1) * r] for i in range(4)]
        tables = flat[4 * r : self.size].reshape(r, self.width)
        return vectors[0], vectors[1], vectors[2], vectors[3], tables

    def fill(self, step: DecodeStep, bucket: int, pages: int, host: np.ndarray) -> int:
        """Write `step` into the flat int32 array `host`; returns how many leading elements
        the step uses (the vectors and the first `bucket` table rows)."""
        n = len(step.tokens)
        ids, positions, slots, seq_lens, tables = self.views(host)
        for vector, values, pad in (
            (ids, step.tokens, 0),
            (positions, step.positions, 0),
            (slots, step.slots, -1),  # write_kv skips negative slots
            (seq_lens, step.seq_lens, 0),  # attention of an empty context is 0
        ):
            vector[:n] = values
            vector[n:bucket] = pad
        lengths = np.fromiter((min(len(t), pages) for t in step.tables), np.int64, count=n)
        used = np.arange(pages) < lengths[:, None]  # [n, pages] row-major, as the flat pages
        flat = itertools.chain.from_iterable(t[:pages] for t in step.tables)
        view = tables[:bucket, :pages]
        view.fill(0)
        view[:n][used] = np.fromiter(flat, np.int32, count=int(lengths.sum()))
        return 4 * self.rows + bucket * self.width


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
        # inputs: staged in pinned memory, moved in one copy into the buffer the graphs read
        self._layout = StepInputs(rows, width)
        self._staging = torch.zeros(self._layout.size, dtype=i32).pin_memory()
        self._inputs = torch.zeros(self._layout.size, dtype=i32, device=dev)
        self._copied = torch.cuda.Event()  # the last copy out of the staging buffer is done
        self._ids, self._positions, self._slots, self._seq_lens, self._tables = self._layout.views(
            self._inputs
        )  # [rows] x 4, [rows, width]
        self._starts = torch.arange(rows + 1, dtype=i32, device=dev)  # [rows + 1] one query each
        vocab = model.config.vocab_size
        self._logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.enabled = True
        self.replays = 0  # steps served by a graph (captures included)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(
        self, step: DecodeStep, max_seq_len: int, pending: PendingTokens | None = None
    ) -> torch.Tensor | None:
        """Logits [len(step.sampling_rows), vocab] fp32 of the step, from its graph; None
        when no graph takes it (the caller runs it eagerly). `pending`: input tokens that
        the previous step left on the device."""
        n = len(step.tokens)
        bucket = pick_bucket(n, self.buckets)
        if not self.enabled or bucket is None or max_seq_len > self.capacity:
            return None
        context = context_bucket(max_seq_len, self.capacity)
        key = (bucket, context, step.shared_prefix_len)
        self._load(step, bucket, context // self.block_size)
        if pending is not None:
            pending.write(self._ids)
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

    def _load(self, step: DecodeStep, bucket: int, pages: int) -> None:
        """Copy the step into rows 0..bucket of the static buffers (padding rows after it)."""
        self._copied.synchronize()  # the previous step's copy has left the staging buffer
        used = self._layout.fill(step, bucket, pages, self._staging.numpy())
        self._inputs[:used].copy_(self._staging[:used], non_blocking=True)
        self._copied.record()

    def _forward(self, bucket: int, context: int, shared: int) -> None:
        """The step over the static buffers' first `bucket` rows, logits into `_logits`."""
        meta = AttentionMetadata(
            slot_mapping=self._slots[:bucket],
            block_tables=self._tables[:bucket, : context // self.block_size],
            seq_lens=self._seq_lens[:bucket],
            query_start_loc=self._starts[: bucket + 1],
            max_query_len=1,
            max_seq_len=context,
            shared_prefix_len=shared,
        )
        ids, positions = self._ids[:bucket], self._positions[:bucket]
        hidden = self.model(ids, positions, self.kv_caches, meta)  # [bucket, hidden]
        self._logits[:bucket].copy_(self.model.compute_logits(hidden))

    def _capture(self, key: tuple[int, int, int]) -> torch.cuda.CUDAGraph | None:
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
