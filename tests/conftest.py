"""Shared test set-up: GPU tests skip cleanly without CUDA; Triton runs interpreted on CPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # Triton decides at decoration time whether to interpret: set it before any kernel import.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny tensors: OpenMP thrashes on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
