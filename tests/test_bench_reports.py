"""The W4a bench's reporting, without a GPU: nvidia-smi sampling and the results files."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import bench_gptq
from bench.gptq_stacks import smi_device, smi_query


def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """An `nvidia-smi` first on PATH that runs the shell script `body`."""
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")


def printing(lines: list[str]) -> str:
    """A script body that prints `lines`."""
    return "".join(f"echo '{line}'\n" for line in lines)


def test_smi_query_reads_values_and_skips_unavailable_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_smi(tmp_path, monkeypatch, printing(["[N/A], 700.00", "1980, 700.00"]))
    assert smi_query("clocks.max.sm,power.limit") == [1980.0, 700.0]


def test_smi_query_samples_medians_past_the_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the first quarter of the samples (1 of 4) is dropped: medians of the last three
    fake_smi(tmp_path, monkeypatch, printing(["100, 50", "1800, 690", "1700, 695", "1900, 700"]))
    calls = []
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)
    assert smi_query("clocks.sm,power.draw", 0.05, lambda: calls.append(1)) == [1800.0, 695.0]
    assert calls  # the function ran while sampling


def test_smi_query_asks_for_torchs_gpu_by_uuid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nvidia-smi numbers the host's GPUs, not CUDA_VISIBLE_DEVICES': the query names the UUID
    fake_smi(tmp_path, monkeypatch, '[ "$1 $2" = "-i GPU-0c1d" ] && echo 1980\n')
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.current_device", lambda: 3)
    props = {3: SimpleNamespace(uuid="0c1d")}
    monkeypatch.setattr("torch.cuda.get_device_properties", props.__getitem__)
    assert smi_device() == "GPU-0c1d"
    assert smi_query("clocks.sm") == [1980.0]


def test_smi_device_without_cuda_is_the_first_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert smi_device() == "0"


def test_smi_query_without_nvidia_smi_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert smi_query("clocks.sm") is None


def results(peers: str) -> dict[str, Any]:
    row = {"graph_ms": 1.5, "eager_ms": 4.4, "tbs": 2.2}
    return {
        "date": "2026-12-01T22:00:00+00:00", "gpu": "NVIDIA H200", "torch": "2.11.0",
        "triton": "3.6.0", "cuda": "13.0", "command": "bench/bench_gptq.py", "weight_gb": 3.34,
        "power_limit_w": 700.0, "max_sm_mhz": 1980.0, "peers": peers, "skipped": {},
        "rows": {"16": {"pagedq": {**row, "sm_mhz": 1800.0, "board_w": 694.0}}},
        "paths": [{"m": 16, "cuda": row}],
    }  # fmt: skip


def test_write_keeps_pagedq_figures_of_a_run_stopped_among_the_peers(tmp_path: Path) -> None:
    bench_gptq.write(results("pending"), tmp_path)
    md = (tmp_path / "gptq_w4a_2026-12-01.md").read_text()
    assert "| 16 | pagedq | 1.500 | 4.400 | 2.20 | 51% | 1800 | 694 |" in md
    assert "Board power limit 700 W, SM clock at most 1980 MHz" in md
    assert "Peers: not measured" in md
    data = json.loads((tmp_path / "gptq_w4a_2026-12-01.json").read_text())
    assert data["rows"]["16"]["pagedq"]["board_w"] == 694.0


def test_write_prints_the_table_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench_gptq.write(results("pending"), tmp_path, echo=False)
    assert capsys.readouterr().out == ""
    assert (tmp_path / "gptq_w4a_2026-12-01.md").exists()
    bench_gptq.write(results("done"), tmp_path)
    out = capsys.readouterr().out
    assert out.count("| 16 | pagedq |") == 1
    assert "M=16 1.500 ms target 1.4 ms: MISSED" in out


def test_write_marks_rows_without_clock_samples(tmp_path: Path) -> None:
    done = results("done")
    done["rows"]["16"]["marlin"] = {"graph_ms": 2.87, "eager_ms": 12.1, "tbs": 1.2}
    bench_gptq.write(done, tmp_path)
    md = (tmp_path / "gptq_w4a_2026-12-01.md").read_text()
    assert "| 16 | marlin | 2.870 | 12.100 | 1.20 | 28% | – | – |" in md
    assert "Peers: not measured" not in md
