"""Decode-step CUDA graphs: the buckets and which steps qualify (CPU; replay is in
test_cuda_graphs_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedq import LLM, SamplingParams
from pagedq.config import EngineConfig
from pagedq.engine.cuda_graphs import (
    BATCH_BUCKETS,
    MIN_CONTEXT,
    DecodeStep,
    StepInputs,
    batch_buckets,
    context_bucket,
    pick_bucket,
    prefix_bucket,
)
from pagedq.engine.llm_engine import Engine
from pagedq.errors import ConfigError
from tests.tiny_models import make_tiny_llama


def test_batch_buckets_stop_at_the_first_one_holding_max_num_seqs() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 8)
    assert batch_buckets(16) == (1, 2, 4, 8, 12, 16)
    assert batch_buckets(256) == BATCH_BUCKETS[: BATCH_BUCKETS.index(256) + 1]
    assert batch_buckets(10_000) == BATCH_BUCKETS  # larger steps run eagerly


def test_pick_bucket_pads_to_the_smallest_bucket() -> None:
    buckets = batch_buckets(64)
    assert [pick_bucket(n, buckets) for n in (1, 3, 8, 9, 13, 17, 33, 64)] == [
        1, 4, 8, 12, 16, 24, 48, 64,
    ]  # fmt: skip
    assert pick_bucket(65, buckets) is None


def test_context_bucket_is_a_power_of_two_capped_at_the_table() -> None:
    assert context_bucket(1, 4096) == MIN_CONTEXT
    assert context_bucket(MIN_CONTEXT, 4096) == MIN_CONTEXT
    assert context_bucket(MIN_CONTEXT + 1, 4096) == 2 * MIN_CONTEXT
    assert context_bucket(3000, 4096) == 4096
    assert context_bucket(3000, 3008) == 3008  # a table of max_model_len rounded to pages
    assert context_bucket(100, 128) == 128


def test_padding_rows_touch_no_kv_and_tables_fit_the_context_bucket() -> None:
    step = DecodeStep(
        tokens=[7, 8],
        positions=[40, 3],
        slots=[5 * 16 + 8, 9 * 16 + 3],
        seq_lens=[41, 4],
        tables=[[2, 3, 5], [9, 10, 11, 12, 13, 14]],  # a static slot reserves its whole length
        sampling_rows=[0, 1],
    )
    layout = StepInputs(rows=6, width=8)
    host = np.full(layout.size, 99, dtype=np.int32)  # stale values from an earlier step
    used = layout.fill(step, bucket=4, pages=4, host=host)
    assert used == 4 * 6 + 4 * 8  # the vectors and the bucket's table rows: one copy
    ids, positions, slots, seq_lens, tables = layout.views(host)
    assert ids[:4].tolist() == [7, 8, 0, 0] and positions[:4].tolist() == [40, 3, 0, 0]
    assert slots[:4].tolist() == [88, 147, -1, -1]  # write_kv skips negative slots
    assert seq_lens[:4].tolist() == [41, 4, 0, 0]  # attention of an empty context is 0
    assert tables[:4, :4].tolist() == [[2, 3, 5, 0], [9, 10, 11, 12], [0] * 4, [0] * 4]
    flat = torch.arange(layout.size, dtype=torch.int32)  # the device buffer's views alike
    assert layout.views(flat)[4][1, 0].item() == 4 * 6 + 8


def test_padding_rows_and_columns_are_zeroed() -> None:
    step = DecodeStep(tokens=[1], positions=[0], slots=[0], seq_lens=[1], tables=[[4]],
                      sampling_rows=[0])  # fmt: skip
    layout = StepInputs(rows=2, width=3)
    host = np.zeros(layout.size, dtype=np.int32)
    assert layout.fill(step, bucket=2, pages=3, host=host) == 8 + 2 * 3
    assert layout.views(host)[4].tolist() == [[4, 0, 0], [0, 0, 0]]


def test_enforce_eager_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")  # type: ignore[arg-type]


def test_decode_steps_are_recognised_and_cpu_never_captures(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "m", hidden_size=64, num_heads=4, num_kv_heads=2)
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_blocks=64, block_size=8))
    assert engine.runner.graphs is None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], params)  # two pages
    engine.add_request([3, 4, 5], params)
    prefill = engine.scheduler.schedule()
    assert engine.runner._decode_step(prefill.chunks) is None  # prompt chunks
    engine.scheduler.rollback(prefill)
    engine.step()
    decode = engine.scheduler.schedule()
    step = engine.runner._decode_step(decode.chunks)
    assert step is not None
    first, second = (c.seq for c in decode.chunks)
    assert step.positions == [10, 3]
    assert step.seq_lens == [11, 4]
    assert step.tokens == [first.token_ids[10], second.token_ids[3]]
    assert step.slots == [first.block_table[1] * 8 + 2, second.block_table[0] * 8 + 3]
    assert step.tables == [first.block_table, second.block_table]
    assert step.sampling_rows == [0, 1]
    engine.scheduler.rollback(decode)


def test_prefix_buckets_round_down_by_at_most_a_third() -> None:
    got = {p: prefix_bucket(p, 4) for p in (0, 3, 4, 5, 6, 7, 8, 11, 12, 13, 23, 24, 64, 93, 127)}
    assert got == {0: 0, 3: 0, 4: 4, 5: 4, 6: 6, 7: 6, 8: 8, 11: 8, 12: 12, 13: 12, 23: 16,
                   24: 24, 64: 64, 93: 64, 127: 96}  # fmt: skip
    assert all(3 * b >= 2 * p for p, b in got.items() if b)
    assert prefix_bucket(1, 1) == 1 and prefix_bucket(5, 6) == 0


def test_steps_over_a_long_shared_prefix_carry_its_bucket(tmp_path: Path) -> None:
    """Four or more shared leading pages take the cascade path; the graph key holds the
    shared pages rounded down to a prefix bucket."""
    folder = make_tiny_llama(tmp_path / "m", hidden_size=64, num_heads=4, num_kv_heads=2)
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_blocks=64, block_size=8))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    shared = list(range(3, 3 + 56))  # seven pages
    engine.add_request([*shared, 50], params)
    engine.add_request([*shared, 60], params)
    third = engine.add_request([*shared[:24], 70], params)  # three pages shared with the others
    engine.step()
    decode = engine.scheduler.schedule()
    assert all(c.num_tokens == 1 for c in decode.chunks)
    step = engine.runner._decode_step(decode.chunks)
    assert step is not None and step.shared_prefix_len == 0  # three pages: plain decode
    engine.scheduler.rollback(decode)
    engine.abort(third)
    decode = engine.scheduler.schedule()
    step = engine.runner._decode_step(decode.chunks)
    assert step is not None and step.shared_prefix_len == 6 * 8  # seven pages -> bucket six
    engine.scheduler.rollback(decode)


def test_stats_report_no_graphs_on_cpu(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "m", hidden_size=64, num_heads=4, num_kv_heads=2)
    llm = LLM(str(folder), device="cpu", num_blocks=32, enforce_eager=True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    stats = llm.stats()
    assert stats["cuda_graphs"] == 0 and stats["graph_steps"] == 0
