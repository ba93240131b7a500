"""What `LLM.generate` and `Engine.step` return (the conventions users know from vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's `n` completions, cumulative so far."""

    index: int  # which of the n completions
    text: str  # detokenized output (stop string removed unless asked to keep it)
    token_ids: list[int]  # generated token ids
    cumulative_logprob: float  # sum of the sampled tokens' log-probs (raw model distribution)
    logprobs: list[dict[int, float]] | None = None  # per token: top-k ids and the sampled id
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step (or at the end of `generate`)."""

    request_id: str
    prompt: str | None  # the prompt text, when the request was given as text
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
