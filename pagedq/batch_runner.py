"""One pass of a batch job over one engine: render rows, feed them a window at a time, step,
and report each row the moment it is done."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from pagedq.batch_io import BadRow, DoneRows, InputRow
from pagedq.batch_report import RunStats
from pagedq.errors import InvalidRequestError, TokenizerError
from pagedq.llm import LLM
from pagedq.loader.tokenizer import Tokenizer
from pagedq.outputs import RequestOutput
from pagedq.sampling_params import SamplingParams

Sink = Callable[[dict[str, Any]], None]
"""Receives every finished row and every error row, as the JSON object of its output line."""


@dataclass(frozen=True, slots=True)
class Renderer:
    """Prompt token ids of an input row, with the shared system prompt first."""

    tokenizer: Tokenizer
    system: str | None  # the shared system prompt, stripped; None: none
    chat: bool  # render through the chat template (else: system text, blank line, prompt)
    no_chat_reason: str = ""  # why chat is off, for rows that need it

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, system: str | None, chat: bool | None) -> Renderer:
        """`chat=None` uses the chat template when the model has one."""
        has_template = tokenizer.has_chat_template
        if chat and not has_template:
            raise TokenizerError("chat was asked for, but the model has no chat template")
        if system is not None:
            system = system.strip() or None
        reason = "the model has no chat template" if not has_template else "chat is turned off"
        return cls(tokenizer, system, has_template if chat is None else chat, reason)

    def __call__(self, row: InputRow) -> list[int]:
        if self.chat:
            return self.tokenizer.apply_chat_template(self._messages(row), True)
        if row.prompt is None:
            raise InvalidRequestError(
                f'a "messages" row needs a chat template: {self.no_chat_reason}'
            )
        text = row.prompt if self.system is None else f"{self.system}\n\n{row.prompt}"
        return self.tokenizer.encode(text)

    def _messages(self, row: InputRow) -> list[dict[str, str]]:
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        if row.messages is not None:
            return system + row.messages
        assert row.prompt is not None  # an InputRow has a prompt or messages
        return [*system, {"role": "user", "content": row.prompt}]


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm[Any]:
    """Rows done of `total`, on stderr."""
    return tqdm(total=total, desc=desc, unit="row", disable=not enabled, file=sys.stderr)


class Runner:
    """Feeds rows to one engine and reports each through `sink` once it is done.

    Invariants: at most `window` (2 x max_num_seqs) requests are in the engine; every row taken
    from the input that `done` does not hold is reported exactly once (finished, or as an error
    row), except rows in flight when Ctrl-C aborts them, which are not reported at all (a rerun
    does them). With
    prefix caching on, the first request runs alone until its prompt is computed, so every
    later row finds the shared prefix in the cache.
    """

    def __init__(
        self,
        llm: LLM,
        renderer: Renderer,
        params: SamplingParams,
        stats: RunStats,
        sink: Sink,
        bar: tqdm[Any],
    ) -> None:
        self.engine = llm.engine
        self.renderer = renderer
        self.params = params
        self.stats = stats
        self.sink = sink
        self.bar = bar
        self.window = 2 * self.engine.config.max_num_seqs
        self.in_flight: dict[str, InputRow] = {}  # request id -> its row
        self.finished_lines: set[int] = set()  # input lines of the rows finished by this pass
        self._warm = not stats.prefix_caching  # the shared prefix is in the cache
        self._start = 0.0

    def run(self, rows: Iterable[InputRow | BadRow], done: DoneRows | None) -> RunStats:
        """Go through `rows`, skipping those `done` holds; Ctrl-C ends the pass cleanly."""
        self._start = time.perf_counter()
        try:
            self._loop(iter(rows), done)
        except KeyboardInterrupt:
            self.stats.interrupted = True
            self._abort_in_flight()
        finally:
            self.stats.wall_s = time.perf_counter() - self._start
            self.stats.peak_kv_blocks = int(self.engine.stats()["peak_blocks_used"])
        return self.stats

    def _loop(self, rows: Iterator[InputRow | BadRow], done: DoneRows | None) -> None:
        exhausted = False
        while True:
            if not exhausted:
                exhausted = self._feed(rows, done, self.window if self._warm else 1)
            if not self.in_flight:
                return  # _feed stops short of its limit only when the input is exhausted
            self._step()

    def _feed(self, rows: Iterator[InputRow | BadRow], done: DoneRows | None, limit: int) -> bool:
        """Add rows until `limit` are in flight; True once the input is exhausted."""
        while len(self.in_flight) < limit:
            row = next(rows, None)
            if row is None:
                return True
            if done is not None and done.has(row):
                self.stats.skipped += 1
            elif isinstance(row, BadRow):
                self._report_error(row)
            else:
                self._add(row)
        return False

    def _add(self, row: InputRow) -> None:
        request_id = f"row-{row.line}"
        try:
            self.engine.add_request(self.renderer(row), self.params, request_id)
        except (InvalidRequestError, TokenizerError) as e:
            self._report_error(BadRow(row.line, row.id, str(e)))
            return
        self.in_flight[request_id] = row

    def _step(self) -> None:
        # until the first tokens arrive (the shared prefix is cached), every output counts
        outputs: list[RequestOutput] = self.engine.step(finished_only=self._warm)
        running = len(self.engine.scheduler.running)
        self.stats.peak_running_seqs = max(self.stats.peak_running_seqs, running)
        for out in outputs:
            if out.outputs[0].token_ids:
                self._warm = True
            if out.finished:
                self._finish(out)

    def _finish(self, out: RequestOutput) -> None:
        row = self.in_flight.pop(out.request_id)
        completion = out.outputs[0]
        num_prompt = len(out.prompt_token_ids)
        self.sink(
            {
                "id": row.id,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "num_prompt_tokens": num_prompt,
                "num_cached_tokens": out.num_cached_tokens,
            }
        )
        s = self.stats
        s.rows += 1
        s.prompt_tokens += num_prompt
        s.cached_tokens += out.num_cached_tokens
        s.generated_tokens += len(completion.token_ids)
        s.longest_prompt = max(s.longest_prompt, num_prompt)
        s.longest_output = max(s.longest_output, len(completion.token_ids))
        self.finished_lines.add(row.line)
        self._progress()

    def _report_error(self, row: BadRow) -> None:
        self.sink(row.to_json())
        self.stats.errors += 1
        self._progress()

    def _progress(self) -> None:
        elapsed = time.perf_counter() - self._start
        rate = self.stats.generated_tokens / elapsed if elapsed > 0 else 0.0
        self.bar.set_postfix_str(
            f"{rate:.1f} gen tok/s, prefix hits {self.stats.hit_rate:.0%}", refresh=False
        )
        self.bar.update(1)

    def _abort_in_flight(self) -> None:
        for request_id in list(self.in_flight):
            try:
                self.engine.abort(request_id)
            except Exception:  # interrupted mid-step: the engine is discarded right after
                break
        self.in_flight.clear()
