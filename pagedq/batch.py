"""`pagedq batch` as a function: many short prompts behind one shared system prompt, one answer
each, written as they finish, resumable after any crash.

Flow: open the output (truncate a torn tail, read which rows are done) -> load the engine ->
read the input lazily and keep at most `2 x max_num_seqs` requests in flight -> write each row
with one `write` the moment it finishes. A rerun skips every id (and every error line) already
in the output, so each input row ends up there exactly once; a kill loses at most the rows in
flight. Rows are not fsynced one by one: a killed process loses nothing the kernel has, and rows
lost to a machine crash are simply done again; the file is fsynced when the job stops.

The shared system prompt leads every row (a chat system message when the model has a chat
template, else text before the prompt). In paged mode the first row runs alone until its prompt
is in the cache, so every later row finds the shared prefix there.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedq.batch_io import (
    INPUT_FORMATS,
    BadRow,
    BatchFileError,
    DoneRows,
    InputRow,
    OutputFile,
    detect_format,
    id_key,
    read_output,
    read_rows,
)
from pagedq.batch_report import BatchSummary, RunStats, StaticComparison, round_up
from pagedq.batch_runner import Renderer, Runner, progress_bar
from pagedq.config import CACHE_MODES, EngineConfig
from pagedq.engine.resources import kv_bytes_per_block, resolve_config
from pagedq.errors import ConfigError, InvalidRequestError, TokenizerError
from pagedq.llm import LLM
from pagedq.loader.hf_config import load_model_config
from pagedq.loader.tokenizer import Tokenizer
from pagedq.sampling_params import SamplingParams

DATA_DIR = Path(__file__).parent / "data"
BUNDLED_INPUT = DATA_DIR / "reviews.jsonl"  # the bundled example: short product reviews
BUNDLED_RULES = DATA_DIR / "rules.txt"  # its shared system prompt: the classification rules
EXAMPLE_MAX_TOKENS = 8  # the example's answer is one label on one line
EXAMPLE_STOP = ("\n",)
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """How to run a batch job; the `pagedq batch` flags map one to one onto these fields."""

    model: str | None = None  # HF model folder; None: the embedded default (SmolLM2, GPTQ 4-bit)
    system: str | None = None  # shared system prompt; None: none (bundled example: its rules)
    chat: bool | None = None  # use the chat template; None: when the model has one
    params: SamplingParams | None = None  # None: greedy, max_tokens 128 (the example: 8)
    cache: str = "paged"  # "paged" (blocks on demand, prefix sharing) | "static"
    enable_prefix_caching: bool = True  # paged mode: share the prompt blocks of the prefix
    block_size: int = 16  # tokens per KV block
    compare_static: bool = False  # paged mode: run this run's rows again in static mode
    max_num_seqs: int = 64  # sequences running at once (static mode: the most slots)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "float16" | "bfloat16"
    num_blocks: int | None = None  # KV pool size; None: from the memory budget
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, not from CUDA graphs
    input_format: str = "auto"  # "auto" (by suffix, else first line) | "jsonl" | "text"
    limit: int | None = None  # only the first N non-blank input lines
    progress: bool = True  # progress bar on stderr

    def __post_init__(self) -> None:
        if self.cache not in CACHE_MODES:
            raise ConfigError(f"cache must be one of {CACHE_MODES}, got {self.cache!r}")
        if self.compare_static and self.cache != "paged":
            raise ConfigError(
                "compare_static compares the paged mode with static: use cache='paged'"
            )
        if self.input_format not in INPUT_FORMATS:
            raise ConfigError(
                f"input_format must be one of {INPUT_FORMATS}, got {self.input_format!r}"
            )
        if self.limit is not None and (isinstance(self.limit, bool) or self.limit < 1):
            raise ConfigError(f"limit must be a positive integer or None, got {self.limit!r}")
        if self.params is not None and self.params.n != 1:
            raise ConfigError(
                f"a batch job writes one answer per row: params.n must be 1, got {self.params.n}"
            )


@dataclass(frozen=True, slots=True)
class _Job:
    """A batch job with its defaults filled in."""

    input: Path  # the input file (the bundled one when none was given)
    label: str  # how the summary names the input
    fmt: str  # "jsonl" | "text"
    output: Path  # the output JSONL
    system: str | None  # the shared system prompt
    params: SamplingParams  # sampling settings of every row


def run_batch(
    input: str | os.PathLike[str] | None = None,
    output: str | os.PathLike[str] | None = None,
    options: BatchOptions | None = None,
) -> BatchSummary:
    """Run (or resume) a batch job; returns its summary.

    `input`: JSONL rows {"id", "prompt"} or {"id", "messages"}, or plain text (one prompt per
    line, id = line number); None runs the bundled example. `output`: the JSONL that receives
    {"id", "text", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens"} per
    row, or {"line", "id", "error"} per bad row; None: `<input stem>.out.jsonl` beside the
    input (the bundled example: a new temporary file). Ctrl-C stops cleanly: in-flight rows are
    aborted (a rerun does them) and the partial summary comes back with `interrupted` set.
    """
    opts = options or BatchOptions()
    job = _resolve_job(input, output, opts)
    out, done = OutputFile.open(job.output)
    try:
        summary, finished_lines = _run_main_pass(job, opts, out, done)
    finally:
        out.sync()
        out.close()
    if opts.compare_static and not summary.interrupted:
        comparison = _compare_static(job, opts, summary.run, finished_lines)
        summary = dataclasses.replace(summary, comparison=comparison)
    return summary


def default_params(bundled: bool) -> SamplingParams:
    """Greedy, 128 new tokens; the bundled example: one label, ended by a newline."""
    if bundled:
        return SamplingParams(temperature=0.0, max_tokens=EXAMPLE_MAX_TOKENS, stop=EXAMPLE_STOP)
    return SamplingParams(temperature=0.0, max_tokens=DEFAULT_MAX_TOKENS)


# --- the job ---------------------------------------------------------------------------------


def _resolve_job(
    input: str | os.PathLike[str] | None, output: str | os.PathLike[str] | None, opts: BatchOptions
) -> _Job:
    if input is None:
        path, system = BUNDLED_INPUT, opts.system
        if system is None:
            system = BUNDLED_RULES.read_text(encoding="utf-8")
    else:
        path, system = Path(input), opts.system
        if not path.is_file():
            raise BatchFileError(f"input file {str(path)!r} does not exist")
    out_path = _output_path(path, input is None, output)
    if out_path.exists() and out_path.resolve() == path.resolve():
        raise BatchFileError(f"the output {str(out_path)!r} is the input file")
    params = opts.params or default_params(bundled=input is None)
    label = "bundled example" if input is None else str(path)
    fmt = detect_format(path, opts.input_format)
    return _Job(path, label, fmt, out_path, system, params)


def _output_path(path: Path, bundled: bool, output: str | os.PathLike[str] | None) -> Path:
    if output is not None:
        return Path(output)
    if bundled:
        fd, name = tempfile.mkstemp(prefix="pagedq-batch-", suffix=".jsonl")
        os.close(fd)
        return Path(name)
    return path.with_name(path.stem + ".out.jsonl")


def _run_main_pass(
    job: _Job, opts: BatchOptions, out: OutputFile, done: DoneRows
) -> tuple[BatchSummary, set[int]]:
    """The job itself: its summary and the input lines of the rows it finished."""
    pending, skipped = _count_pending(job, opts, done)
    if pending == 0:  # a finished job: nothing to load
        stats = RunStats(opts.cache, False, opts.block_size, 0, job.params.max_tokens)
        stats.skipped = skipped
        return BatchSummary(job.label, job.output, 0.0, stats), set()
    max_model_len = _static_len_from_input(job, opts) if opts.cache == "static" else None
    llm, load_s = _load_llm(opts, opts.cache, max_model_len, job.params)
    stats = _new_stats(llm, opts, opts.cache, job.params)
    renderer = Renderer.for_model(llm.tokenizer, job.system, opts.chat)
    rows = read_rows(job.input, job.fmt, opts.limit)
    with progress_bar(pending, "batch", opts.progress) as bar:
        runner = Runner(llm, renderer, job.params, stats, out.write, bar)
        runner.run(rows, done)
    return BatchSummary(job.label, job.output, load_s, stats), runner.finished_lines


def _count_pending(job: _Job, opts: BatchOptions, done: DoneRows) -> tuple[int, int]:
    """(rows still to do, rows already in the output), from one read of the input."""
    pending = skipped = 0
    for row in read_rows(job.input, job.fmt, opts.limit):
        if done.has(row):
            skipped += 1
        else:
            pending += 1
    return pending, skipped


# --- engines ---------------------------------------------------------------------------------


def _load_llm(
    opts: BatchOptions, cache: str, max_model_len: int | None, params: SamplingParams
) -> tuple[LLM, float]:
    """An `LLM` for the job and the seconds it took to load."""
    start = time.perf_counter()
    llm = LLM(
        opts.model,
        dtype=opts.dtype,
        device=opts.device,
        cache=cache,
        enable_prefix_caching=opts.enable_prefix_caching,
        block_size=opts.block_size,
        num_blocks=opts.num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=opts.max_num_seqs,
        seed=params.seed or 0,
        enforce_eager=opts.enforce_eager,
    )
    return llm, time.perf_counter() - start


def _new_stats(llm: LLM, opts: BatchOptions, cache: str, params: SamplingParams) -> RunStats:
    engine = llm.engine
    return RunStats(
        cache=cache,
        prefix_caching=cache == "paged" and opts.enable_prefix_caching,
        block_size=opts.block_size,
        kv_block_bytes=kv_bytes_per_block(
            engine.model_config, opts.block_size, engine.resolved.dtype
        ),
        max_tokens=params.max_tokens,
        static_slots=engine.scheduler.num_static_slots if cache == "static" else 0,
    )


def _static_len(
    longest_prompt: int, max_tokens: int | None, block_size: int, model_max: int
) -> int:
    """The static mode's max_model_len: longest prompt + max_tokens, rounded up to a block."""
    if max_tokens is None:
        return model_max
    return min(round_up(longest_prompt + max_tokens, block_size), model_max)


def _static_len_from_input(job: _Job, opts: BatchOptions) -> int:
    """Tokenize every row once (nothing kept) to size the static slots before loading."""
    model_dir = _model_dir(opts)
    renderer = Renderer.for_model(Tokenizer.from_model_dir(model_dir), job.system, opts.chat)
    longest = 0
    for row in read_rows(job.input, job.fmt, opts.limit):
        if isinstance(row, InputRow):
            try:
                longest = max(longest, len(renderer(row)))
            except (InvalidRequestError, TokenizerError):
                continue  # the row becomes an error row when it runs
    model_max = load_model_config(model_dir).max_position_embeddings
    return _static_len(max(longest, 1), job.params.max_tokens, opts.block_size, model_max)


# --- the static comparison -------------------------------------------------------------------


def _compare_static(
    job: _Job, opts: BatchOptions, run: RunStats, lines: set[int]
) -> StaticComparison:
    """This run's finished rows again in static mode; token ids compared with the output's."""
    if not lines:
        empty = RunStats("static", False, run.block_size, run.kv_block_bytes, run.max_tokens)
        return StaticComparison(empty, 0, 0)
    gc.collect()  # the paged engine is gone: free its pool before the static one is allocated
    model_max = load_model_config(_model_dir(opts)).max_position_embeddings
    max_len = _static_len(run.longest_prompt, job.params.max_tokens, opts.block_size, model_max)
    llm, _ = _load_llm(opts, "static", max_len, job.params)
    stats = _new_stats(llm, opts, "static", job.params)
    renderer = Renderer.for_model(llm.tokenizer, job.system, opts.chat)
    static_tokens: dict[str, list[int]] = {}

    def collect(row: dict[str, Any]) -> None:
        if "token_ids" in row:
            static_tokens[id_key(row["id"])] = row["token_ids"]

    rows = _rows_at(read_rows(job.input, job.fmt, opts.limit), lines)
    with progress_bar(len(lines), "static", opts.progress) as bar:
        Runner(llm, renderer, job.params, stats, collect, bar).run(rows, None)
    compared = identical = 0
    for row in read_output(job.output):
        key = id_key(row["id"]) if "token_ids" in row else None
        if key in static_tokens:
            compared += 1
            identical += static_tokens[key] == row["token_ids"]
    return StaticComparison(stats, compared, identical)


def _rows_at(rows: Iterable[InputRow | BadRow], lines: set[int]) -> Iterable[InputRow]:
    return (row for row in rows if isinstance(row, InputRow) and row.line in lines)


def _model_dir(opts: BatchOptions) -> Path:
    """The model folder the job's engines load (the default model is built on first use)."""
    return resolve_config(EngineConfig(model=opts.model, device=opts.device)).model_dir
