"""bench/w4a_floor.py without a GPU: its rows and operands."""

from __future__ import annotations

import pytest
import torch

from bench import w4a_floor
from bench.w4a_floor import Row, b_operands, rows_for


def test_rows_cover_stream_then_each_mode_and_m() -> None:
    rows = rows_for([8, 16], [1, 2], ["none"])
    assert [r.name for r in rows[::2]] == ["stream", "hmma, M=8", "imma, M=8", "hmma, M=16",
                                           "imma, M=16"]  # fmt: skip
    assert {r.per_sm for r in rows} == {1, 2}
    assert Row("hmma", 16, 2).tiles == 2 and Row("imma", 8, 2).tiles == 1
    assert Row("stream", 0, 2).tiles == 1


def test_paths_name_and_pick_the_shared_memory_traffic() -> None:
    rows = rows_for([16], [2], ["none", "ring", "x", "ring+x", "ring+x+dq"])
    assert rows[0] == Row("stream", 0, 2)  # the stream row never adds paths
    flags = {(r.mode, r.path): (r.ring, r.xpath) for r in rows[1:]}
    assert flags[("hmma", "none")] == (False, False) and flags[("imma", "ring")] == (True, False)
    assert flags[("hmma", "x")] == (False, True) and flags[("hmma", "ring+x")] == (True, True)
    assert flags[("imma", "ring+x+dq")] == (True, True)
    assert [r.dq for r in rows[1:5]] == [0] * 4 and Row("hmma", 16, 2, "ring+x+dq").dq == 3
    assert Row("hmma", 16, 2, "ring+x+sub").dq == 1 and Row("imma", 16, 2, "ring+x+scale").dq == 2
    assert Row("hmma", 16, 2, "ring+x+bar").dq == 4
    assert Row("hmma", 16, 2, "ring+x+dq+xwait").dq == 11  # the kernels' only combined row
    assert Row("hmma", 16, 2, "x").name == "hmma, M=16, x via shared memory"
    with pytest.raises(ValueError, match="--paths"):
        rows_for([16], [2], ["smem"])


def test_rows_take_each_cta_size() -> None:
    """12 warps per SM, as pagedq's 16-token GEMV has them (3 CTAs of 128), beside 16 (2 of 256)."""
    rows = rows_for([16], [2, 3], ["ring+x+dq+xwait"], (128, 256))
    assert {(r.per_sm, r.threads) for r in rows if r.mode == "hmma"} == {
        (2, 128),
        (3, 128),
        (2, 256),
        (3, 256),
    }
    with pytest.raises(ValueError, match="--threads"):
        rows_for([16], [2], ["none"], (96,))


@pytest.mark.parametrize(("ms", "per_sm"), [([12], [2]), ([16], [0]), ([16], [9])])
def test_rows_reject_what_the_kernels_cannot_run(ms: list[int], per_sm: list[int]) -> None:
    with pytest.raises(ValueError, match=r"--ms|--ctas-per-sm"):
        rows_for(ms, per_sm, ["none"])


def test_b_operands_fill_every_lane_and_tile() -> None:
    """256 words each: 32 lanes x up to 4 tiles x 2 registers; fp16 N(0, 1), s8 over the full
    byte range."""
    ops = b_operands(torch.Generator().manual_seed(0))
    assert all(v.shape == (256,) and v.dtype == torch.int32 for v in ops.values())
    fp16 = ops["hmma"].view(torch.float16).float()
    assert fp16.abs().max() < 8 and (fp16 != fp16.round()).any()
    s8 = ops["imma"].view(torch.int8)
    assert int(s8.min()) < -100 and int(s8.max()) > 100


@pytest.mark.skipif(torch.cuda.is_available(), reason="the script runs on a GPU here")
def test_main_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert w4a_floor.main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
