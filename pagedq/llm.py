"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(conversations, params)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from pagedq.config import EngineConfig
from pagedq.engine.llm_engine import Engine, Prompt
from pagedq.errors import InvalidRequestError
from pagedq.outputs import RequestOutput
from pagedq.sampling_params import SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """Generate for many prompts at once over a paged, prefix-shared KV cache.

    `LLM()` with no model runs the embedded default (SmolLM2-135M-Instruct, GPTQ 4-bit).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        cache: str = "paged",
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        num_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        seed: int = 0,
        enforce_eager: bool = False,
        launch_ahead: bool | None = None,
    ) -> None:
        config = EngineConfig(
            model=None if model is None else str(model),
            dtype=dtype,
            device=device,
            cache=cache,
            enable_prefix_caching=enable_prefix_caching,
            block_size=block_size,
            num_blocks=num_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_bytes=kv_cache_bytes,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            seed=seed,
            enforce_eager=enforce_eager,
            launch_ahead=launch_ahead,
        )
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results in input order.

        Every request is validated before any work starts: a bad one raises its typed error,
        naming its index, and nothing runs.
        """
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                ids.append(self.engine.add_request(prompt, p))
        except InvalidRequestError as e:
            for rid in ids:
                self.engine.abort(rid)
            raise type(e)(f"prompt {len(ids)}: {e}") from e
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations: list[Messages] = (
            [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[arg-type, list-item]
        )
        prompts: list[Prompt] = [
            self.tokenizer.apply_chat_template(list(conv), add_generation_prompt)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict[str, int | float | str]:
        """Prefix-cache queried/hit tokens, blocks used/cached/evicted, preemptions."""
        return self.engine.stats()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(finished_only=True):
                    done[out.request_id] = out
                    bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]


def _as_batch(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]  # one prompt as token ids
    return items  # type: ignore[return-value]


def _per_prompt(
    params: SamplingParams | Seq[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
