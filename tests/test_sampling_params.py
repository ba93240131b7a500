"""SamplingParams: validation of every field, normalisation, immutability."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pagedq.errors import InvalidRequestError, SamplingParamsError
from pagedq.sampling_params import SamplingParams

BAD_VALUES = [
    ("n", 0),
    ("n", -3),
    ("n", 2.5),
    ("n", True),
    ("n", "2"),
    ("n", None),
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", None),
    ("temperature", False),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_p", math.nan),
    ("top_p", "0.9"),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", "5"),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("min_p", None),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", "1.1"),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", 2.0001),
    ("frequency_penalty", -math.inf),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "42"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 10.0),
    ("max_tokens", False),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("min_tokens", None),
    ("stop", 3),
    ("stop", ["ok", 3]),
    ("stop", [""]),
    ("stop", ""),
    ("stop_token_ids", [1, -2]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("ignore_eos", None),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("logprobs", True),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", 0),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_raises_naming_field_and_value(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message
    assert "got" in message


def test_error_message_states_value_and_range() -> None:
    with pytest.raises(SamplingParamsError, match=r"top_p must be in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(SamplingParamsError, match=r"logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=21)


def test_error_is_an_invalid_request_and_value_error() -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(n=0)
    with pytest.raises(ValueError):
        SamplingParams(n=0)


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(SamplingParamsError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)  # type: ignore[call-arg]


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, None, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert (p.stop, p.stop_token_ids) == ((), ())
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy


@pytest.mark.parametrize(("given", "stored"), [(None, None), (0, None), (-1, None), (1, 1), (7, 7)])
def test_top_k_off_values_are_stored_as_none(given: int | None, stored: int | None) -> None:
    assert SamplingParams(top_k=given).top_k == stored


@pytest.mark.parametrize(
    ("given", "stored"),
    [(None, ()), ("</s>", ("</s>",)), (["a", "bc"], ("a", "bc")), (("x",), ("x",))],
)
def test_stop_is_normalised_to_a_tuple(given: object, stored: tuple[str, ...]) -> None:
    assert SamplingParams(stop=given).stop == stored  # type: ignore[arg-type]


def test_stop_token_ids_are_normalised_to_a_tuple_of_int() -> None:
    p = SamplingParams(stop_token_ids=[2, np.int64(7)])  # type: ignore[arg-type]
    assert p.stop_token_ids == (2, 7)
    assert all(type(t) is int for t in p.stop_token_ids)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # type: ignore[arg-type]


def test_numbers_are_stored_as_python_types() -> None:
    p = SamplingParams(temperature=1, top_p=np.float32(0.5), n=np.int32(3), seed=np.uint64(9))
    assert type(p.temperature) is float and p.temperature == 1.0
    assert type(p.top_p) is float and p.top_p == 0.5
    assert type(p.n) is int and p.n == 3
    assert type(p.seed) is int and p.seed == 9


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-4, False), (0.7, False)]
)
def test_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_boundaries_are_accepted() -> None:
    p = SamplingParams(
        top_p=1.0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        seed=2**64 - 1,
        logprobs=20,
        max_tokens=1,
    )
    assert p.seed == 2**64 - 1
    assert SamplingParams(min_p=0.0, logprobs=0, seed=0).logprobs == 0


def test_frozen_hashable_and_replace_revalidates() -> None:
    p = SamplingParams(temperature=0.5, stop=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(temperature=0.5, stop=("x",)))
    assert dataclasses.replace(p, seed=3).seed == 3
    with pytest.raises(SamplingParamsError, match="seed"):
        dataclasses.replace(p, seed=-3)
