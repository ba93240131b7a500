"""pagedq: a paged-attention KV-cache engine with prefix sharing for 4-bit GPTQ Llamas.

`LLM` and `SamplingParams` are imported lazily so that `import pagedq` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedq.llm import LLM
    from pagedq.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagedq.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedq.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pagedq' has no attribute {name!r}")
