"""The batch job on a tiny random model: output rows, error rows with their line numbers,
exactly-once resume (torn tails, Ctrl-C), prefix-cache hits of the shared system prompt, and
the static mode giving the same greedy outputs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pagedq.batch import BUNDLED_INPUT, BUNDLED_RULES, BatchOptions, run_batch
from pagedq.batch_io import (
    BatchFileError,
    InputRow,
    OutputFile,
    detect_format,
    id_key,
    read_rows,
)
from pagedq.engine.llm_engine import Engine
from pagedq.errors import ConfigError
from pagedq.loader.tokenizer import Tokenizer
from pagedq.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_llama

SYSTEM = (
    "Paged attention stores keys and values in fixed-size blocks. A shared system prompt is "
    "computed once and reused by every request. The quick brown fox jumps over the lazy dog."
)
WORDS = [
    "fox",
    "dog",
    "quick",
    "brown",
    "lazy",
    "blocks",
    "keys",
    "values",
    "prompt",
    "shared",
    "once",
]
ROW_FIELDS = {"id", "text", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=256)


def options(tiny: Path, **kwargs: Any) -> BatchOptions:
    base: dict[str, Any] = {
        "model": str(tiny),
        "system": SYSTEM,
        "params": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        "num_blocks": 128,
        "max_num_seqs": 8,
        "device": "cpu",
        "progress": False,
    }
    base.update(kwargs)
    return BatchOptions(**base)


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 5))


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def good_rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "prompt": prompt(i)} for i in range(n)]


def by_id(rows: list[dict[str, Any]]) -> dict[Any, list[int]]:
    return {r["id"]: r["token_ids"] for r in rows if "token_ids" in r}


def test_rows_and_error_rows(tiny: Path, tmp_path: Path) -> None:
    rows: list[Any] = [
        {"id": "a", "prompt": "the quick fox"},  # line 1
        "this is not json",  # 2
        {"id": "b"},  # 3: no prompt
        {"id": "c", "prompt": 42},  # 4: wrong type
        "",  # 5: blank, skipped silently
        {"id": "a", "prompt": "again"},  # 6: duplicate id
        {"id": "d", "prompt": "fox " * 400},  # 7: too long for max_position_embeddings=256
        {"id": [1], "prompt": "x"},  # 8: bad id type
        ["not", "an", "object"],  # 9
        {"prompt": "no id: the line number is the id"},  # 10
        {"id": 7, "messages": [{"role": "user", "content": "hello fox"}]},  # 11
        {"id": 2.5, "prompt": "float ids keep their type"},  # 12
        {"id": "e", "messages": [{"role": "user"}]},  # 13: no content
        {"id": "f", "prompt": "x", "messages": []},  # 14: both
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run_batch(src, tmp_path / "out.jsonl", options(tiny))
    out = read_jsonl(tmp_path / "out.jsonl")
    errors = {r["line"]: r for r in out if "error" in r}
    assert sorted(errors) == [2, 3, 4, 6, 7, 8, 9, 13, 14]
    assert "not valid JSON" in errors[2]["error"] and "id" not in errors[2]
    assert errors[3]["id"] == "b" and "prompt" in errors[3]["error"]
    assert "duplicate" in errors[6]["error"] and "line 1" in errors[6]["error"]
    assert "256" in errors[7]["error"]  # names the limit
    finished = [r for r in out if "error" not in r]
    assert sorted(json.dumps(r["id"]) for r in finished) == ['"a"', "10", "2.5", "7"]  # types kept
    for r in finished:
        assert set(r) == ROW_FIELDS
        assert len(r["token_ids"]) == 6 and r["finish_reason"] == "length"
    assert (summary.run.rows, summary.run.errors, summary.run.skipped) == (4, 9, 0)


def test_shared_system_prompt_is_served_from_the_prefix_cache(tiny: Path, tmp_path: Path) -> None:
    n = 20
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(n))
    summary = run_batch(src, tmp_path / "out.jsonl", options(tiny))
    tok = Tokenizer.from_model_dir(tiny)
    rendered = [
        tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt(i)}]
        )
        for i in range(2)
    ]
    shared = next(k for k, (x, y) in enumerate(zip(*rendered, strict=False)) if x != y)
    assert shared > 64  # the system prompt spans several blocks
    out = read_jsonl(tmp_path / "out.jsonl")
    assert out[0]["num_cached_tokens"] == 0
    for row in out[1:]:  # every later row: at least every full block of the shared prefix
        assert shared // 16 * 16 <= row["num_cached_tokens"] < row["num_prompt_tokens"]
    assert summary.run.cached_tokens >= (n - 1) * (shared // 16 * 16)


def test_rerun_of_a_finished_job_changes_nothing(tiny: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [*good_rows(6), "bad line"])
    out = tmp_path / "out.jsonl"
    run_batch(src, out, options(tiny))
    before = out.read_bytes()
    again = run_batch(src, out, options(tiny))
    assert out.read_bytes() == before
    assert (again.run.rows, again.run.errors, again.run.skipped) == (0, 0, 7)


def test_resume_after_a_torn_tail_gives_each_row_once(tiny: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [*good_rows(12), "{broken"])
    full = tmp_path / "full.jsonl"
    run_batch(src, full, options(tiny))
    data = full.read_bytes()
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(data[: len(data) // 2])  # cut in the middle of a line
    assert not torn.read_bytes().endswith(b"\n")
    summary = run_batch(src, torn, options(tiny))
    out = read_jsonl(torn)  # every line is valid JSON again
    ids = Counter(r["id"] for r in out if "token_ids" in r)
    assert ids == Counter(f"q{i}" for i in range(12))
    assert [r["line"] for r in out if "error" in r] == [13]
    assert by_id(out) == by_id(read_jsonl(full))  # greedy: same tokens as one uninterrupted run
    assert summary.run.skipped > 0 and summary.run.rows > 0


def test_ctrl_c_keeps_finished_rows_and_a_rerun_completes(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(30))
    out = tmp_path / "out.jsonl"
    real_step = Engine.step
    calls = {"n": 0}

    def interrupting_step(self: Engine, **kwargs: bool) -> Any:
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return real_step(self, **kwargs)

    monkeypatch.setattr(Engine, "step", interrupting_step)
    partial = run_batch(src, out, options(tiny, max_num_seqs=4))
    assert partial.interrupted
    done = read_jsonl(out)
    assert 0 < len(done) < 30 and len(done) == partial.run.rows
    monkeypatch.setattr(Engine, "step", real_step)
    rest = run_batch(src, out, options(tiny, max_num_seqs=4))
    assert not rest.interrupted and rest.run.skipped == len(done)
    ids = Counter(r["id"] for r in read_jsonl(out))
    assert ids == Counter(f"q{i}" for i in range(30))


def test_static_mode_and_compare_static_give_the_same_greedy_outputs(
    tiny: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [*good_rows(10), "oops"])
    paged = run_batch(src, tmp_path / "paged.jsonl", options(tiny, compare_static=True))
    c = paged.comparison
    assert c is not None
    assert c.compared == c.identical == 10
    assert c.static.cache == "static" and c.static.static_slots > 0
    static = run_batch(src, tmp_path / "static.jsonl", options(tiny, cache="static"))
    assert static.run.cache == "static" and static.run.cached_tokens == 0
    assert by_id(read_jsonl(tmp_path / "static.jsonl")) == by_id(
        read_jsonl(tmp_path / "paged.jsonl")
    )
    # the static mode reserves longest prompt + max_tokens per slot, rounded up to a block
    assert static.run.peak_kv_blocks >= static.run.peak_running_seqs * 2
    text = paged.format()
    assert "static mode run" in text and "identical outputs 10/10" in text


def test_plain_text_input_and_no_chat(tiny: Path, tmp_path: Path) -> None:
    src = tmp_path / "prompts.txt"
    src.write_text("the quick fox\n\nlazy dog\n  \nshared blocks\n", encoding="utf-8")
    summary = run_batch(src, None, options(tiny, chat=False))
    out = read_jsonl(tmp_path / "prompts.out.jsonl")
    assert [r["id"] for r in out] == [1, 3, 5]  # line numbers; blank lines skipped
    tok = Tokenizer.from_model_dir(tiny)
    assert out[0]["num_prompt_tokens"] == len(tok.encode(f"{SYSTEM}\n\nthe quick fox"))
    assert summary.output == tmp_path / "prompts.out.jsonl"


def test_messages_rows_need_a_chat_template(tiny: Path, tmp_path: Path) -> None:
    rows = [{"id": 1, "messages": [{"role": "user", "content": "fox"}]}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run_batch(src, tmp_path / "out.jsonl", options(tiny, chat=False))
    (row,) = read_jsonl(tmp_path / "out.jsonl")
    assert row["line"] == 1 and "chat template" in row["error"]


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="compare"):
        BatchOptions(cache="static", compare_static=True)
    with pytest.raises(ConfigError, match="limit"):
        BatchOptions(limit=0)
    with pytest.raises(ConfigError, match="n must be 1"):
        BatchOptions(params=SamplingParams(n=2))
    with pytest.raises(ConfigError, match="cache"):
        BatchOptions(cache="dynamic")


# --- the files, without a model ----------------------------------------------------------------


def test_output_scan_repairs_only_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    ok = '{"id": 1, "token_ids": [5]}\n{"line": 4, "error": "bad"}\n'
    path.write_text(ok + '{"id": 2, "tok', encoding="utf-8")
    out, done = OutputFile.open(path)
    out.write({"id": 3, "token_ids": []})
    out.close()
    assert path.read_text(encoding="utf-8") == ok + '{"id": 3, "token_ids": []}\n'
    assert done.ids == {id_key(1)} and done.error_lines == {4}

    path.write_text('{"id": "x", "token_ids": []}', encoding="utf-8")  # complete, no newline
    out, done = OutputFile.open(path)
    out.write({"id": "y", "token_ids": []})
    out.close()
    assert [r["id"] for r in read_jsonl(path)] == ["x", "y"]

    path.write_text('{"id": 1, "token_ids": []}\nnot json\n{"id": 2, "token_ids": []}\n')
    with pytest.raises(BatchFileError, match="line 2"):
        OutputFile.open(path)
    path.write_text('{"name": "some other file"}\n')
    with pytest.raises(BatchFileError, match="not a row of a pagedq batch"):
        OutputFile.open(path)


def test_one_writer_per_output_file(tmp_path: Path) -> None:
    first, _ = OutputFile.open(tmp_path / "out.jsonl")
    try:
        with pytest.raises(BatchFileError, match="another"):
            OutputFile.open(tmp_path / "out.jsonl")
    finally:
        first.close()


def test_reading_rows(tmp_path: Path) -> None:
    path = tmp_path / "in.data"
    path.write_bytes(
        b'\xef\xbb\xbf{"id": 1, "prompt": "a"}\r\n'  # BOM and CRLF
        b"\xff\xfe broken utf-8\n"
        b'{"id": true, "prompt": "b"}\n'
        b'{"id": 1.0, "prompt": "c"}\n'  # 1.0 is not 1: JSON types differ
        b'{"id": 1, "prompt": "d"}\n'
        b'{"prompt": "   "}\n'
    )
    assert detect_format(path) == "jsonl"
    rows = list(read_rows(path, "jsonl"))
    assert [type(r).__name__ for r in rows] == [
        "InputRow", "BadRow", "InputRow", "InputRow", "BadRow", "BadRow"
    ]  # fmt: skip
    assert rows[0].id == 1 and isinstance(rows[0], InputRow) and rows[0].prompt == "a"
    assert "UTF-8" in rows[1].error  # type: ignore[union-attr]
    assert rows[2].id is True and rows[3].id == 1.0 and isinstance(rows[3].id, float)
    assert "duplicate" in rows[4].error  # type: ignore[union-attr]
    assert "empty" in rows[5].error  # type: ignore[union-attr]
    assert [r.line for r in read_rows(path, "jsonl", limit=2)] == [1, 2]
    text = tmp_path / "notes"
    text.write_text("\n{not json, just text}\n", encoding="utf-8")
    assert detect_format(text) == "jsonl" and detect_format(text, "text") == "text"
    assert detect_format(tmp_path / "x.txt", "auto") == "text"


# --- the bundled example -----------------------------------------------------------------------


def test_bundled_example_is_well_formed() -> None:
    rows = list(read_rows(BUNDLED_INPUT, detect_format(BUNDLED_INPUT)))
    assert all(isinstance(r, InputRow) for r in rows)
    assert 200 <= len(rows) <= 300
    assert len({r.prompt for r in rows}) == len(rows)  # no two reviews alike
    assert 1500 < len(BUNDLED_RULES.read_text(encoding="utf-8")) < 6000  # several hundred tokens


@pytest.mark.slow
def test_bundled_example_on_the_default_model(tmp_path: Path) -> None:
    # The embedded quantized SmolLM2 (quantized on first use: minutes), three reviews.
    summary = run_batch(None, tmp_path / "out.jsonl", BatchOptions(limit=3, progress=False))
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(out) == ["r001", "r002", "r003"]
    assert all(1 <= len(r["token_ids"]) <= 8 for r in out.values())
    assert out["r001"]["num_cached_tokens"] == 0  # runs alone first: the shared prefix
    assert out["r002"]["num_cached_tokens"] >= 560  # the rules: ~570 tokens
    assert out["r003"]["num_cached_tokens"] >= 560
    assert summary.run.hit_rate > 0.6
    assert "KV vs static" in summary.format()
