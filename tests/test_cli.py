"""The `pagedq` command: `batch` killed with SIGKILL mid-run and resumed, exit codes, the
summary, and the other subcommands registered (or reported unavailable) without breaking it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pagedq import cli
from pagedq.engine.llm_engine import Engine
from tests.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "Paged attention stores keys and values in fixed-size blocks. The quick brown fox."


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=256)


def batch_args(tiny: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return [
        "batch",
        "--model", str(tiny),
        "--input", str(src),
        "--output", str(out),
        "--system", SYSTEM,
        "--max-tokens", "5",
        "--num-blocks", "128",
        "--device", "cpu",
        "--quiet",
        *extra,
    ]  # fmt: skip


def write_input(path: Path, n: int, bad_every: int = 0) -> tuple[set[int], set[int]]:
    """n rows with ids 0..n-1 where every `bad_every`-th line is broken: (good ids, bad lines)."""
    good, bad = set(), set()
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            if bad_every and i % bad_every == bad_every - 1:
                f.write(f'{{"id": {i}, "prompt": \n')
                bad.add(i + 1)
            else:
                f.write(json.dumps({"id": i, "prompt": f"fox {i} dog"}) + "\n")
                good.add(i)
    return good, bad


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_mid_run_then_resume_gives_every_row_exactly_once(
    tiny: Path, tmp_path: Path
) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good, bad = write_input(src, 400, bad_every=37)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pagedq", *batch_args(tiny, src, out, "--max-num-seqs", "4")]
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            deadline = time.monotonic() + 300
            while count_lines(out) < 30 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()
    written = count_lines(out)
    assert 30 <= written < len(good) + len(bad)  # killed mid-run

    rerun = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "already in the output" in rerun.stdout
    rows = read_rows(out)  # a torn last line, if any, was repaired
    assert Counter(r["id"] for r in rows if "token_ids" in r) == Counter(good)
    assert Counter(r["line"] for r in rows if "error" in r) == Counter(bad)

    finished = out.read_bytes()
    assert cli.main(batch_args(tiny, src, out)) == 0  # a third run changes nothing
    assert out.read_bytes() == finished


def test_batch_prints_the_summary_and_writes_json(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    write_input(src, 8)
    code = cli.main(
        [*batch_args(tiny, src, out, "--compare-static"), "--summary-json", str(summary)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    for label in ("rows", "prompt tokens", "peak KV", "prefill vs static", "KV vs static"):
        assert label in printed
    assert "identical outputs 8/8" in printed  # greedy: both modes agree
    data = json.loads(summary.read_text(encoding="utf-8"))
    assert data["run"]["rows"] == 8 and data["identical_rows"] == 8
    assert data["static"]["cache"] == "static"
    assert data["run"]["cached_tokens"] > 0


def test_ctrl_c_exits_130_with_a_partial_summary(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(src, 20)
    real_step, calls = Engine.step, [0]

    def interrupting_step(self: Engine, **kwargs: bool) -> Any:
        calls[0] += 1
        if calls[0] == 8:
            raise KeyboardInterrupt
        return real_step(self, **kwargs)

    monkeypatch.setattr(Engine, "step", interrupting_step)
    assert cli.main(batch_args(tiny, src, out, "--max-num-seqs", "2")) == cli.EXIT_INTERRUPTED
    assert "(interrupted)" in capsys.readouterr().out
    assert 0 < count_lines(out) < 20


def test_usage_and_file_errors(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([]) == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["batch", "--cache", "dynamic"])
    assert e.value.code == 2
    missing = tmp_path / "missing.jsonl"
    assert cli.main(batch_args(tiny, missing, tmp_path / "out.jsonl")) == 1
    assert "does not exist" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    write_input(src, 2)
    assert cli.main(batch_args(tiny, src, src)) == 1
    assert "is the input file" in capsys.readouterr().err
    assert cli.main([*batch_args(tiny, src, tmp_path / "o.jsonl"), "--temperature", "-1"]) == 1
    assert "temperature" in capsys.readouterr().err


def test_other_subcommands_are_registered_and_guarded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    help_text = cli.build_parser().format_help()
    for name in ("batch", "quantize", "eval-ppl"):
        assert name in help_text
    quantize = cli.build_parser("quantize").parse_args(["quantize", "in", "out"])
    assert callable(quantize.func)

    def broken(name: str) -> Any:
        raise ImportError(f"no module named {name!r} today")

    monkeypatch.setattr(cli.importlib, "import_module", broken)
    assert cli.main(["eval-ppl", "some-model"]) == 1
    assert "unavailable" in capsys.readouterr().err
    assert cli.build_parser("batch").parse_args(["batch"]).func is cli.run_batch_command
