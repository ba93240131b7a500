"""`to_device`: small host-made tensors on the device (no stream sync on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedq.ops.transfer import to_device


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_lists_and_arrays_arrive_with_their_values(device: str) -> None:
    rows = to_device([[1, 2, 3], [4, 5, 6]], torch.int64, torch.device(device))
    assert rows.dtype == torch.int64 and rows.device.type == device
    assert rows.cpu().tolist() == [[1, 2, 3], [4, 5, 6]]
    column = to_device(np.array([0.5, 2.0]), torch.float32, torch.device(device))
    assert column.dtype == torch.float32 and column.cpu().tolist() == [0.5, 2.0]
    if device == "cuda":  # queued behind a long kernel, the copy still lands in order
        big = torch.randn(4096, 4096, device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(4):
                big = big @ big
            late = to_device(list(range(100)), torch.int64, torch.device("cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert late.cpu().tolist() == list(range(100))
