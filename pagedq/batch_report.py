"""What a batch job reports: counters of each engine pass, and the summary table.

The summary states what prefix sharing and paging saved against the preallocated (static)
mode even when the static mode is not run: the static mode computes every prompt token, and
reserves `slot_tokens` = longest prompt + max_tokens (rounded up to a block) for each
sequence it runs, so the same concurrency costs `peak_running_seqs` x that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class RunStats:
    """Counters of one pass of one engine over the rows of a job (this run only)."""

    cache: str  # "paged" | "static"
    prefix_caching: bool  # prefix sharing was on (paged mode only)
    block_size: int  # tokens per KV block
    kv_block_bytes: int  # bytes of K and V of one block over all layers
    max_tokens: int | None  # the job's max new tokens per row; None: up to max_model_len
    static_slots: int = 0  # static mode: sequences per batch (0 in paged mode)
    rows: int = 0  # rows finished and written
    errors: int = 0  # error rows written
    skipped: int = 0  # rows that were already in the output
    prompt_tokens: int = 0  # prompt tokens of the finished rows
    cached_tokens: int = 0  # of which served by the prefix cache
    generated_tokens: int = 0  # new tokens of the finished rows
    longest_prompt: int = 0  # tokens of the longest finished prompt
    longest_output: int = 0  # tokens of the longest finished output
    peak_kv_blocks: int = 0  # most KV blocks held at once
    peak_running_seqs: int = 0  # most sequences running at once
    wall_s: float = 0.0  # first request to last row (model load excluded)
    interrupted: bool = False  # stopped by Ctrl-C; in-flight rows were aborted, not written

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the model ran (preemption recomputes are not counted)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def slot_tokens(self) -> int:
        """The static mode's reservation per sequence for these rows."""
        new = self.max_tokens if self.max_tokens is not None else self.longest_output
        return round_up(self.longest_prompt + new, self.block_size)

    @property
    def static_reserved_blocks(self) -> int:
        """KV blocks the static mode reserves to run `peak_running_seqs` of these rows at once."""
        return self.peak_running_seqs * (self.slot_tokens // self.block_size)

    def tokens_per_s(self, generated_only: bool = False) -> float:
        tokens = self.generated_tokens + (0 if generated_only else self.prompt_tokens)
        return tokens / self.wall_s if self.wall_s > 0 else 0.0

    def mib(self, blocks: int) -> float:
        return blocks * self.kv_block_bytes / 2**20


@dataclass(frozen=True, slots=True)
class StaticComparison:
    """The rows of this run done again in the static mode, outputs compared by id."""

    static: RunStats  # counters of the static pass
    compared: int  # rows finished in both modes
    identical: int  # of which with the same token ids


@dataclass(frozen=True, slots=True)
class BatchSummary:
    """What `run_batch` returns (and the CLI prints, and --summary-json writes)."""

    input: str  # the input file, or "bundled example"
    output: Path  # the output JSONL
    load_s: float  # seconds to load the model (and tokenizer)
    run: RunStats  # this run's counters
    comparison: StaticComparison | None = None  # with compare_static

    @property
    def interrupted(self) -> bool:
        """Ctrl-C stopped the job (or its static comparison)."""
        c = self.comparison
        return self.run.interrupted or (c is not None and c.static.interrupted)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values, derived numbers included."""
        out: dict[str, Any] = {
            "input": self.input,
            "output": str(self.output),
            "load_s": self.load_s,
            "run": _stats_dict(self.run),
        }
        if self.comparison is not None:
            c = self.comparison
            out["static"] = _stats_dict(c.static)
            out["compared_rows"], out["identical_rows"] = c.compared, c.identical
        return out

    def format(self) -> str:
        """The aligned summary table."""
        r = self.run
        state = " (interrupted)" if r.interrupted else ""
        lines = [f"pagedq batch{state}: {self.input} -> {self.output}"]
        if r.rows == r.errors == 0 and not r.interrupted:
            lines.append(_row("rows", f"nothing to do: all {r.skipped:,} rows are in the output"))
            return "\n".join(lines)
        lines += [_row(label, value) for label, value in _run_rows(r, self.load_s)]
        if self.comparison is not None:
            lines += [_row(label, value) for label, value in _comparison_rows(r, self.comparison)]
        return "\n".join(lines)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _stats_dict(r: RunStats) -> dict[str, Any]:
    out = dataclasses.asdict(r)
    out.update(
        computed_prompt_tokens=r.computed_prompt_tokens,
        prefix_hit_rate=r.hit_rate,
        tokens_per_s=r.tokens_per_s(),
        generated_tokens_per_s=r.tokens_per_s(generated_only=True),
        peak_kv_mib=r.mib(r.peak_kv_blocks),
    )
    if r.cache == "paged":
        out.update(
            static_slot_tokens=r.slot_tokens,
            static_reserved_blocks=r.static_reserved_blocks,
            static_reserved_mib=r.mib(r.static_reserved_blocks),
        )
    return out


def _row(label: str, value: str) -> str:
    return f"  {label:<20} {value}"


def _times(a: float, b: float) -> str:
    """a / b as "2.5x"."""
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def _run_rows(r: RunStats, load_s: float) -> list[tuple[str, str]]:
    rows = [
        ("rows", f"{r.rows:,} done, {r.errors:,} errors, {r.skipped:,} already in the output"),
        (
            "prompt tokens",
            f"{r.prompt_tokens:,} ({r.cached_tokens:,} from the prefix cache: {r.hit_rate:.1%})",
        ),
        ("generated tokens", f"{r.generated_tokens:,}"),
        ("wall time", f"{r.wall_s:.1f} s (+ {load_s:.1f} s model load)"),
        (
            "throughput",
            f"{r.tokens_per_s():,.0f} tok/s prompt+generated, "
            f"{r.tokens_per_s(True):,.1f} generated tok/s, "
            f"{r.rows / r.wall_s if r.wall_s else 0:,.2f} rows/s",
        ),
        (
            "peak KV",
            f"{r.peak_kv_blocks:,} blocks x {r.block_size} tokens = "
            f"{r.mib(r.peak_kv_blocks):,.1f} MiB, {r.peak_running_seqs} sequences at most",
        ),
    ]
    if r.cache == "static":
        rows.append(("static slots", f"{r.static_slots} of {r.slot_tokens} tokens"))
        return rows
    rows += [
        (
            "prefill vs static",
            f"{r.computed_prompt_tokens:,} prompt tokens computed, static computes "
            f"{r.prompt_tokens:,} ({_times(r.prompt_tokens, r.computed_prompt_tokens)} more)",
        ),
        (
            "KV vs static",
            f"static reserves {r.peak_running_seqs} x {r.slot_tokens} tokens = "
            f"{r.static_reserved_blocks:,} blocks = {r.mib(r.static_reserved_blocks):,.1f} MiB "
            f"({_times(r.static_reserved_blocks, r.peak_kv_blocks)} more)",
        ),
    ]
    return rows


def _comparison_rows(r: RunStats, c: StaticComparison) -> list[tuple[str, str]]:
    s = c.static
    if s.rows == 0:
        return [("static mode run", "no rows ran in this run: nothing to compare")]
    interrupted = " (interrupted)" if s.interrupted else ""
    return [
        (
            "static mode run",
            f"{s.wall_s:.1f} s, {s.tokens_per_s():,.0f} tok/s, {s.static_slots} slots of "
            f"{s.slot_tokens} tokens, peak {s.peak_kv_blocks:,} blocks{interrupted}",
        ),
        (
            "paged / static",
            f"{_times(r.tokens_per_s(), s.tokens_per_s())} the throughput, "
            f"{_times(s.peak_kv_blocks, r.peak_kv_blocks)} less peak KV; "
            f"identical outputs {c.identical:,}/{c.compared:,}",
        ),
    ]
