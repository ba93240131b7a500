"""Shared test set-up: GPU tests skip cleanly without CUDA; Triton runs interpreted on CPU."""

from __future__ import annotations

import os

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
