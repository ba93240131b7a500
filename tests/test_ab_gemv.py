"""bench/ab_gemv.py without a GPU: how a version spec names its sources."""

from __future__ import annotations

from pathlib import Path

from bench.ab_gemv import patches_of


def test_a_version_is_a_copy_one_diff_or_diffs_in_order() -> None:
    assert patches_of(Path(".dev/cur/cuda_ext")) is None
    assert patches_of(Path("a.diff")) == [Path("a.diff")]
    assert patches_of(Path("d/a.diff+d/b.diff")) == [Path("d/a.diff"), Path("d/b.diff")]
    assert patches_of(Path("a.diff+cuda_ext")) is None  # a copy cannot be stacked on
