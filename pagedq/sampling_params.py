"""How one request's tokens are chosen and when its generation stops (vLLM-style).

`SamplingParams` is frozen and validated when built: every bad value raises
`SamplingParamsError` naming the field, the value and the valid range, so a request is
rejected at `add_request` and never fails mid-batch. Derive variants with
`dataclasses.replace`, which validates again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from pagedq.errors import SamplingParamsError

GREEDY_TEMPERATURE_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
MAX_LOGPROBS = 20  # most top logprobs a request may ask for per token
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
_MAX_SEED = 2**64 - 1  # 64-bit seeds; completion i draws from (seed + i) mod 2**48


def _as_int(name: str, value: object) -> int:
    """`value` as a Python int; bools, floats and other types are rejected."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SamplingParamsError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _as_float(name: str, value: object) -> float:
    """`value` as a finite Python float; bools, NaN, inf and non-numbers are rejected."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise SamplingParamsError(
            f"{name} must be a number, got {value!r} ({type(value).__name__})"
        )
    result = float(value)
    if not math.isfinite(result):
        raise SamplingParamsError(f"{name} must be a finite number, got {result}")
    return result


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _out_of_range(name: str, valid: str, value: object) -> SamplingParamsError:
    return SamplingParamsError(f"{name} must be {valid}, got {value!r}")


def _normalise_stop(value: object) -> tuple[str, ...]:
    """`None`, a string, or an iterable of strings -> a tuple of non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise SamplingParamsError(
            f"stop must be a str or a list of str, got {value!r} ({type(value).__name__})"
        )
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise SamplingParamsError(
                f"stop must hold only str, got {item!r} ({type(item).__name__})"
            )
        if not item:
            raise SamplingParamsError("stop must not contain an empty string, got ''")
    return items


def _normalise_token_ids(name: str, value: object) -> tuple[int, ...]:
    """`None` or an iterable of non-negative ints -> a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise SamplingParamsError(
            f"{name} must be a list of int, got {value!r} ({type(value).__name__})"
        )
    ids = tuple(_as_int(name, item) for item in value)
    for token_id in ids:
        if token_id < 0:
            raise _out_of_range(name, "a list of ids >= 0", token_id)
    return ids


def _optional_int(name: str, value: object) -> int | None:
    return None if value is None else _as_int(name, value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping settings of one request.

    Invariants after construction: every field has the type of its annotation (ints are
    Python ints, floats finite Python floats, sequences tuples), every value is inside the
    range stated on its field, `top_k` is `None` or `>= 1`, and
    `min_tokens <= max_tokens` when `max_tokens` is set.
    """

    n: int = 1
    """Completions per prompt, >= 1; the forks share the prompt's KV blocks."""
    temperature: float = 1.0
    """>= 0; below `GREEDY_TEMPERATURE_EPS` (0 included) the request is greedy."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]: keep the smallest set of tokens whose mass is >= top_p."""
    top_k: int | None = None
    """Keep the top_k most likely tokens, >= 1; None is off (0 and -1 are accepted as off)."""
    min_p: float = 0.0
    """In [0, 1]: drop tokens less likely than min_p times the most likely one."""
    repetition_penalty: float = 1.0
    """> 0, HF-style over prompt + output tokens: positive logits / it, negative ones * it."""
    presence_penalty: float = 0.0
    """In [-2, 2], OpenAI-style: subtracted once from every token already in the output."""
    frequency_penalty: float = 0.0
    """In [-2, 2], OpenAI-style: subtracted per occurrence of a token in the output."""
    seed: int | None = None
    """In [0, 2**64 - 1]: the request samples with its own RNG; None uses the global RNG."""
    max_tokens: int | None = 16
    """Most new tokens, >= 1; None generates up to `max_model_len`."""
    min_tokens: int = 0
    """>= 0: EOS and stop tokens cannot be sampled before this many new tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; a str or a list of str is accepted, stored as a tuple."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids (>= 0) that end generation besides EOS; a list is accepted."""
    ignore_eos: bool = False
    """Keep generating after EOS (benchmarks)."""
    logprobs: int | None = None
    """In [0, 20]: return the log-probs of the top `logprobs` tokens at each step; None: off."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""

    def __post_init__(self) -> None:
        for name, value in self._validated().items():
            object.__setattr__(self, name, value)

    def _validated(self) -> dict[str, Any]:
        """Every field checked and normalised; raises SamplingParamsError on the first bad one."""
        values: dict[str, Any] = {}
        values.update(self._validated_sampling())
        values.update(self._validated_penalties())
        values.update(self._validated_stopping())
        values["seed"] = _optional_int("seed", self.seed)
        if values["seed"] is not None and not 0 <= values["seed"] <= _MAX_SEED:
            raise _out_of_range("seed", "in [0, 2**64 - 1] or None", values["seed"])
        logprobs = _optional_int("logprobs", self.logprobs)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise _out_of_range("logprobs", f"in [0, {MAX_LOGPROBS}] or None", logprobs)
        values["logprobs"] = logprobs
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            values[name] = _as_bool(name, getattr(self, name))
        return values

    def _validated_sampling(self) -> dict[str, Any]:
        n = _as_int("n", self.n)
        if n < 1:
            raise _out_of_range("n", ">= 1", n)
        temperature = _as_float("temperature", self.temperature)
        if temperature < 0:
            raise _out_of_range("temperature", ">= 0", temperature)
        top_p = _as_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise _out_of_range("top_p", "in (0, 1]", top_p)
        top_k = _optional_int("top_k", self.top_k)
        if top_k is not None and top_k < -1:
            raise _out_of_range("top_k", ">= 1, or None / 0 / -1 for off", top_k)
        min_p = _as_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise _out_of_range("min_p", "in [0, 1]", min_p)
        return {
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": None if top_k is None or top_k <= 0 else top_k,
            "min_p": min_p,
        }

    def _validated_penalties(self) -> dict[str, float]:
        repetition = _as_float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise _out_of_range("repetition_penalty", "> 0", repetition)
        values = {"repetition_penalty": repetition}
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise _out_of_range(name, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", value)
            values[name] = value
        return values

    def _validated_stopping(self) -> dict[str, Any]:
        max_tokens = _optional_int("max_tokens", self.max_tokens)
        if max_tokens is not None and max_tokens < 1:
            raise _out_of_range("max_tokens", ">= 1 or None", max_tokens)
        min_tokens = _as_int("min_tokens", self.min_tokens)
        if min_tokens < 0:
            raise _out_of_range("min_tokens", ">= 0", min_tokens)
        if max_tokens is not None and min_tokens > max_tokens:
            raise _out_of_range("min_tokens", f"<= max_tokens ({max_tokens})", min_tokens)
        return {
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "stop": _normalise_stop(self.stop),
            "stop_token_ids": _normalise_token_ids("stop_token_ids", self.stop_token_ids),
        }

    @property
    def greedy(self) -> bool:
        """The request takes the most likely token at every step (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
