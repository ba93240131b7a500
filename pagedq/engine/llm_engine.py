"""The step-level engine: add requests at any time, step, stream, abort.

`LLM` (offline) and serving code both drive this class. A request is validated entirely in
`add_request`, so a bad one raises there and never disturbs the others.

Launch-ahead (on by default on CUDA) keeps the GPU from waiting for the host. A step launches
the next one before its own tokens reach the host: the next step is scheduled as if every
running sequence had its new token, a PENDING_TOKEN on the host that the forward reads from the
device. Then the host reads the tokens (they replace the placeholders), applies the stop
conditions and builds the outputs, decoding their text, while the GPU runs. A sequence that
stops computes one more token, thrown away. A step whose rows read the token history (penalties) or
fork (the first token of n > 1) samples when the next call reads it, and the step after it is
launched once its tokens are appended. For callers: a request added between two calls joins
one step later, and an aborted request's row of the step already launched is dropped. Greedy
and seeded tokens are those of one step at a time; a row may share its step with other rows,
which moves fp32 logits in the last bits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import cast

import torch

from pagedq.config import EngineConfig, ModelConfig
from pagedq.engine.block_manager import BlockManager
from pagedq.engine.model_runner import ModelRunner
from pagedq.engine.resources import ResolvedConfig, resolve_config
from pagedq.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedq.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from pagedq.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    InvalidTokenIdError,
    PromptTooLongError,
    RequestTooLargeError,
)
from pagedq.layers.sampler import PendingSample, Sampler, SamplingRow
from pagedq.loader.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedq.models.llama import load_llama
from pagedq.ops.transfer import to_device
from pagedq.outputs import CompletionOutput, RequestOutput
from pagedq.sampling_params import SamplingParams

Prompt = str | Seq[int]


@dataclass(slots=True)
class _Launched:
    """A step whose forward is queued: its schedule, its logits (rows of sampling chunks) and,
    when its sampling was queued too, the sequences of its rows and the pending tokens."""

    out: SchedulerOutput
    logits: torch.Tensor
    rows: list[Sequence] = field(default_factory=list)
    sample: PendingSample | None = None


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    seqs: list[Sequence] = field(default_factory=list)
    stop_ids: frozenset[int] = (
        frozenset()
    )  # ids that end generation (eos unless ignored ∪ stop ids)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class Engine:
    """Continuous-batching engine over one model and one KV pool."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.resolved: ResolvedConfig = resolve_config(config)
        r = self.resolved
        torch.manual_seed(config.seed)
        self.tokenizer = Tokenizer.from_model_dir(r.model_dir)
        self.model = load_llama(r.model_dir, r.dtype, r.device).eval()
        self.model_config: ModelConfig = self.model.config
        r = self.resolved = r.with_pool(self.model_config)
        self.block_manager = BlockManager(
            r.num_blocks,
            config.block_size,
            config.enable_prefix_caching and config.cache == "paged",
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=r.max_num_batched_tokens,
                max_model_len=r.max_model_len,
                static=config.cache == "static",
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            self.model,
            r.num_blocks,
            config.block_size,
            r.dtype,
            max_model_len=r.max_model_len,
            max_num_seqs=config.max_num_seqs,
            enforce_eager=config.enforce_eager,
        )
        self.sampler = Sampler()
        ahead = config.launch_ahead
        self.launch_ahead = r.device.type == "cuda" if ahead is None else ahead
        self._launched: _Launched | None = None  # the step launched ahead, not yet sampled
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self._auto_ids = itertools.count()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)

    # --- requests ------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.resolved.max_model_len

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request (text or token ids); returns its id."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}"
            )
        if request_id is None:
            request_id = f"req-{next(self._auto_ids)}"
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        max_tokens = self._check_length(len(ids), params)
        req = _Request(request_id, text, ids, params, next(self._arrivals))
        if not params.ignore_eos:
            req.stop_ids = self.eos_token_ids
        req.stop_ids = req.stop_ids | frozenset(params.stop_token_ids)
        seq = self._new_sequence(req, 0, list(ids), max_tokens)
        self._requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, Seq) and (token_ids := _int_list(prompt)) is not None:
            ids, text = token_ids, None
        else:
            raise InvalidRequestError(
                f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidRequestError("the prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # C-level passes; the loop names the culprit
            i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise InvalidTokenIdError(f"prompt token {i} is {t}, outside [0, {vocab})")
        return text, ids

    def _check_length(self, num_prompt: int, params: SamplingParams) -> int:
        """The request's effective max_tokens; raises if it cannot be served."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise PromptTooLongError(
                f"the prompt has {num_prompt} tokens; max_model_len is {limit} and at least one "
                "token must be generated"
            )
        max_tokens = limit - num_prompt
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        need, have = (
            self.block_manager.blocks_for(num_prompt + max_tokens),
            self.block_manager.num_blocks,
        )
        if need > have:
            raise RequestTooLargeError(f"the request needs {need} KV blocks, the pool holds {have}")
        return max_tokens

    def _new_sequence(
        self, req: _Request, index: int, token_ids: list[int], max_tokens: int
    ) -> Sequence:
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=req.request_id,
            index=index,
            arrival=req.arrival,
            token_ids=token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            max_tokens=max_tokens,
        )
        seq.extra["detok"] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens
        )
        seq.extra["text"] = ""
        seq.extra["logprobs"] = [] if req.params.logprobs is not None else None
        seq.extra["cum_logprob"] = 0.0
        seed = None  # completion `index` of a seeded request: its own stream
        if req.params.seed is not None:
            seed = (req.params.seed + index) & 0xFFFFFFFFFFFF
        seq.extra["row"] = SamplingRow(
            params=req.params,
            token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            seed=seed,
            stop_token_ids=req.stop_ids,
        )
        req.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its blocks are freed. False if unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # --- one step ----------------------------------------------------------------------------

    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step: outputs of every request that progressed, or with `finished_only` of
        those that finished (callers that collect only results skip building the others: at a
        batch of 128, a tenth of a step's host time). With launch-ahead, the next step is
        launched before this one's outputs are built (see the module docstring)."""
        launched, self._launched = self._launched, None
        if launched is None:
            launched = self._launch(None)
            if launched is None:
                return []
        tried = False
        if launched.sample is not None:  # its tokens are still on the device
            if self.launch_ahead and self._runs_on(launched):
                self._launched, tried = self._try_launch(launched), True
            rows = self._take_sample(launched)
        else:
            rows = self._sample_and_update(launched.out, launched.logits)
        if self.launch_ahead and not tried and self.scheduler.has_unfinished():
            self._launched = self._try_launch(None)
        # a request can only have finished in this step through a row that did
        touched = {
            seq.request_id: self._requests[seq.request_id]
            for seq in rows
            if seq.is_finished or not finished_only
        }
        outputs = []
        for req in touched.values():
            if req.finished or not finished_only:  # text is decoded when an output needs it
                for seq in req.seqs:
                    self._decode_text(seq)
                outputs.append(self._finish_output(req))
        if not self._requests:  # a step launched ahead holds only rows that stopped since
            self._launched = None
        return outputs

    def _launch(self, previous: _Launched | None) -> _Launched | None:
        """Schedule a step and queue its forward (and, with launch-ahead, its sampling when its
        rows allow); None when nothing is left to run. `previous`: a launched step whose
        tokens are still on the device; each of its running rows gets a PENDING_TOKEN that the
        forward reads from the device and `_take_sample` replaces."""
        device_tokens = None
        if previous is not None and previous.sample is not None:
            rows_of: dict[int, int] = {}
            for i, seq in enumerate(previous.rows):
                if seq.status is SequenceStatus.RUNNING:
                    seq.token_ids.append(PENDING_TOKEN)
                    rows_of[seq.seq_id] = i
            device_tokens = (previous.sample.tokens, rows_of)
        out = self.scheduler.schedule()
        if not out.chunks:
            if self.scheduler.has_unfinished():
                raise AssertionError("scheduler made no progress with requests pending")
            return None
        try:
            logits = self.runner.execute(out, device_tokens)
        except BaseException:
            self.scheduler.rollback(out)  # e.g. CUDA OOM: the engine stays usable
            raise
        self.scheduler.commit(out)
        launched = _Launched(out, logits)
        if self.launch_ahead and (rows := self._queueable_rows(out)) is not None:
            launched.rows = rows
            launched.sample = self.sampler.launch(logits, [self._row(s) for s in rows])
        return launched

    def _try_launch(self, previous: _Launched | None) -> _Launched | None:
        """`_launch` for a step ahead: a failure was rolled back, and the next call schedules
        the step again and raises there."""
        try:
            return self._launch(previous)
        except Exception:
            return None

    def _queueable_rows(self, out: SchedulerOutput) -> list[Sequence] | None:
        """The rows of a step whose sampling can be queued with its forward: none forks (the
        first token of n > 1) and none is penalised (penalties read the tokens, and the last
        one may be pending). None when some row cannot."""
        seqs = [c.seq for c in out.chunks if c.samples]
        for seq in seqs:
            req = self._requests[seq.request_id]
            p = req.params
            if p.n > len(req.seqs) or p.repetition_penalty != 1.0:
                return None
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                return None
        return seqs

    def _runs_on(self, launched: _Launched) -> bool:
        """Whether a step launched now has work besides rows that end by length with their
        pending token (a step of only those would be thrown away)."""
        limit = self.max_model_len
        ending = {
            s.seq_id
            for s in launched.rows
            if s.num_output_tokens + 1 >= s.max_tokens or s.num_tokens + 1 >= limit
        }
        return bool(self.scheduler.waiting) or any(
            s.seq_id not in ending for s in self.scheduler.running
        )

    def _take_sample(self, launched: _Launched) -> list[Sequence]:
        """Bring a queued sampling's tokens to the host and append them; returns the rows still
        live (a row aborted, or finished by the step before, is dropped)."""
        assert launched.sample is not None
        result = launched.sample.result()
        rows = []
        for i, seq in enumerate(launched.rows):
            if seq.is_finished:
                continue
            self._append(seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i])
            rows.append(seq)
        return rows

    def _sample_and_update(self, out: SchedulerOutput, logits: torch.Tensor) -> list[Sequence]:
        """Sample a token for every live sampling chunk and append it; returns the rows."""
        seqs = [c.seq for c in out.chunks if c.samples]
        if any(s.is_finished for s in seqs):  # aborted since the step was launched ahead
            live = [i for i, s in enumerate(seqs) if not s.is_finished]
            logits = logits.index_select(0, to_device(live, torch.int64, logits.device))
            seqs = [seqs[i] for i in live]
        rows_of_seq: list[list[Sequence]] = []
        for seq in seqs:
            req = self._requests[seq.request_id]
            group = [seq]
            if req.params.n > 1 and len(req.seqs) == 1 and seq.num_output_tokens == 0:
                group += self._fork(req, seq)
            rows_of_seq.append(group)
        rows = [s for g in rows_of_seq for s in g]
        if not rows:
            return []
        if len(rows) > len(seqs):  # forked rows sample from their parent's logits
            index = [i for i, g in enumerate(rows_of_seq) for _ in g]
            logits = logits.index_select(0, to_device(index, torch.int64, logits.device))
        result = self.sampler(logits, [self._row(s) for s in rows])
        for i, seq in enumerate(rows):
            self._append(seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i])
        return rows

    def _fork(self, req: _Request, parent: Sequence) -> list[Sequence]:
        children = []
        for index in range(1, req.params.n):
            child = self._new_sequence(req, index, list(parent.token_ids), parent.max_tokens)
            child.num_cached_tokens = parent.num_cached_tokens
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    @staticmethod
    def _row(seq: Sequence) -> SamplingRow:
        """What the sampler reads of `seq`: made once (it reads the token list in place)."""
        row: SamplingRow = seq.extra["row"]
        return row

    def _append(
        self, seq: Sequence, token: int, logprob: float, top: dict[int, float] | None
    ) -> None:
        """Append a sampled token and apply the stop conditions. Its text follows in
        `_decode_text`: here for requests with stop strings, else when an output is built
        (every step when streaming; with `finished_only`, once, when the request ends)."""
        req = self._requests[seq.request_id]
        if seq.token_ids[-1] == PENDING_TOKEN:  # the next step already reads it on the device
            seq.token_ids[-1] = token
        else:
            seq.token_ids.append(token)
        seq.extra["cum_logprob"] += logprob
        if seq.extra["logprobs"] is not None:
            entry = dict(top or {})
            entry[token] = logprob
            seq.extra["logprobs"].append(entry)
        reason = self._stop_reason(req, seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _decode_text(self, seq: Sequence) -> int:
        """Detokenize the output tokens of `seq` not decoded yet (in one window: the same text
        as token by token), and at its end what is held back (unless a stop string cut the
        text); returns the length of the new text."""
        detok: IncrementalDetokenizer = seq.extra["detok"]
        new = seq.token_ids[seq.num_prompt_tokens + detok.num_tokens :]
        delta = detok.add_many(new) if new else ""
        seq.extra["text"] += delta
        if seq.finish_reason in ("stop", "length") and not isinstance(seq.stop_reason, str):
            seq.extra["text"] += detok.flush()
        return len(delta)

    def _stop_reason(self, req: _Request, seq: Sequence, token: int) -> str | None:
        params = req.params
        if token in req.stop_ids:  # the sampler masks these until min_tokens
            seq.stop_reason = token if token in params.stop_token_ids else None
            return "stop"
        if params.stop and self._check_stop_strings(seq, params, self._decode_text(seq)):
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _check_stop_strings(self, seq: Sequence, params: SamplingParams, delta_len: int) -> bool:
        """Find a stop string that the newest text completes; cut the text there."""
        text: str = seq.extra["text"]
        longest = max(len(s) for s in params.stop)
        window_start = max(0, len(text) - delta_len - longest + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            at = text.find(stop, window_start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        seq.extra["text"] = (
            text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        )
        seq.stop_reason = stop
        return True

    def _finish_output(self, req: _Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.extra["text"],
                token_ids=s.output_token_ids,
                cumulative_logprob=s.extra["cum_logprob"],
                logprobs=s.extra["logprobs"],
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in req.seqs
        ]
        finished = req.finished
        if finished:
            del self._requests[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens or 0,
        )

    # --- metrics -------------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float | str]:
        """Prefix-cache and pool counters, and the decode steps replayed from CUDA graphs."""
        bm, st = self.block_manager, self.block_manager.stats
        graphs = self.runner.graphs
        return {
            "cache_mode": self.config.cache,
            "num_blocks": bm.num_blocks,
            "block_size": bm.block_size,
            "max_model_len": self.max_model_len,
            "static_slots": self.scheduler.num_static_slots,
            "prefix_queried_tokens": st.queried_tokens,
            "prefix_hit_tokens": st.hit_tokens,
            "prefix_hit_rate": st.hit_tokens / st.queried_tokens if st.queried_tokens else 0.0,
            "blocks_used": bm.num_used_blocks,
            "blocks_cached": bm.num_cached_free_blocks,
            "blocks_evicted": st.evicted_blocks,
            "peak_blocks_used": st.peak_used_blocks,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.scheduler.num_steps,
            "cuda_graphs": graphs.num_graphs if graphs is not None else 0,
            "graph_steps": graphs.replays if graphs is not None else 0,
        }


def _int_list(prompt: Seq[object]) -> list[int] | None:
    """The prompt as a new list of ints; None unless every element is an int (bools are not).
    Plain ints are checked by one C-level pass (a 1,000-token prompt per request adds up)."""
    if set(map(type, prompt)) <= {int}:
        return cast("list[int]", list(prompt))
    ids = []
    for t in prompt:  # int subclasses (IntEnum, ...) are converted; bools are not ids
        if not isinstance(t, int) or isinstance(t, bool):
            return None
        ids.append(int(t))
    return ids
