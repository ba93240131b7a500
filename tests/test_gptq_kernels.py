"""GPTQ Triton kernels in the interpreter (TRITON_INTERPRET=1 on CPU), the dispatch and split-K
policy, and the CUDA kernel's work split checked on the host (when nvcc is installed).

Every kernel result is compared with x @ W^T computed in float64 from the independently packed
and dequantized checkpoints of test_gptq_linear.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pagedq.errors import ConfigError
from pagedq.gptq.linear import GPTQLinear
from pagedq.ops.gptq import (
    BACKEND_ENV,
    gemm_grid,
    gemm_tile_for,
    gptq_matmul,
    select_path,
)
from tests.offline_compile import run_compiler
from tests.test_gptq_linear import Checkpoint, make_checkpoint, reference_output
from triton_kernels import gptq_configs

ROOT = Path(__file__).resolve().parents[1]


def _run(lin: GPTQLinear, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setenv(BACKEND_ENV, "triton")
    return lin(x)


def _assert_matches(out: torch.Tensor, x: torch.Tensor, parts: list[Checkpoint]) -> None:
    ref = reference_output(x.reshape(-1, x.shape[-1]), parts).reshape(out.shape)
    # fp32: the kernels' only differences are fp32 summation order (K <= 512 terms)
    # fp16: weights rounded to fp16 once (2**-11) and the output rounded to fp16
    tol = 1e-5 if out.dtype == torch.float32 else 4e-3
    err = (out.double() - ref).abs().max().item()
    assert err <= tol * max(ref.abs().max().item(), 1.0), err


CASES = [
    # (k, n, group_size, zero_mode, desc_act, bias)
    # scale modes: 0 (group 128, -1), 1 (32, 64), 2 (40: not a multiple of 16)
    (256, 64, 128, "sym_v1", False, False),
    (384, 96, 64, "v1", True, True),
    (512, 48, 32, "v2", True, False),
    (200, 40, 64, "sym_v1_stores_8", False, True),  # K not a multiple of 128: padded block
    (256, 32, -1, "v1", False, False),
    (320, 24, 40, "v2", True, True),  # group size not a multiple of 16: per-row scales
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 33])
def test_triton_paths_match_the_reference(
    case: tuple, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[type-arg]
    k, n, group_size, zero_mode, desc_act, bias = case
    ck = make_checkpoint(
        seed=k + n,
        k=k,
        n=n,
        group_size=group_size,
        zero_mode=zero_mode,
        desc_act=desc_act,
        bias=bias,
    )
    lin = GPTQLinear([ck.tensors], ck.config, torch.float32)
    x = torch.randn(m, k)
    _assert_matches(_run(lin, x, monkeypatch), x, [ck])
    packed, _ = lin.segment(0)
    assert int(packed.locks.abs().sum()) == 0  # split-K counters are reset


@pytest.mark.parametrize("m", [1, 5, 20])
def test_triton_fp16_and_fused_parts(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [
        make_checkpoint(seed=s, k=256, n=32, group_size=64, zero_mode="v1", bias=s == 2)
        for s in (1, 2, 3)
    ]
    lin = GPTQLinear([p.tensors for p in parts], parts[0].config, torch.float16)
    assert lin.num_segments == 1
    x = torch.randn(m, 256).half()
    _assert_matches(_run(lin, x, monkeypatch), x, parts)


def test_triton_with_different_g_idx_per_part(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [
        make_checkpoint(
            seed=s, k=256, n=16, group_size=32, zero_mode="v2", desc_act=True, g_idx_rng_seed=s
        )
        for s in (4, 5)
    ]
    lin = GPTQLinear([p.tensors for p in parts], parts[0].config, torch.float32)
    assert lin.num_segments == 2
    for m in (2, 18):
        x = torch.randn(1, m, 256)
        _assert_matches(_run(lin, x, monkeypatch), x, parts)


def test_split_k_is_used_and_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_checkpoint(seed=1, k=1024, n=32, group_size=128, zero_mode="v1")
    lin = GPTQLinear([ck.tensors], ck.config, torch.float32)
    split, per_split = gptq_configs.split_k(tiles=1, num_blocks=8, num_sms=4, max_tiles=1024)
    assert split > 1 and per_split * split >= 8
    x = torch.randn(2, 1024)
    first = _run(lin, x, monkeypatch)
    assert torch.equal(first, _run(lin, x, monkeypatch))
    _assert_matches(first, x, [ck])


def test_gptq_matmul_checks_inputs() -> None:
    ck = make_checkpoint(seed=1, k=128, n=16)
    packed, _ = GPTQLinear([ck.tensors], ck.config, torch.float32).segment(0)
    with pytest.raises(ValueError, match="128"):
        gptq_matmul(torch.randn(2, 64), packed)
    with pytest.raises(ValueError, match="bias"):
        gptq_matmul(torch.randn(2, 128), packed, torch.zeros(8))
    assert gptq_matmul(torch.randn(0, 128), packed).shape == (0, 16)


def test_dispatch_by_backend_and_m(monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_checkpoint(seed=1, k=128, n=16)
    packed, _ = GPTQLinear([ck.tensors], ck.config, torch.float32).segment(0)
    x1, x40 = torch.randn(1, 128), torch.randn(40, 128)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_path(x1, packed) == "torch"  # auto on CPU
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert select_path(x1, packed) == "triton_small"
    assert select_path(x40, packed) == "triton_large"
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="CUDA"):
        select_path(x1, packed)
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ConfigError, match="fast"):
        select_path(x1, packed)


def test_cuda_gemm_tile_rule() -> None:
    """The wgmma GEMM's tile height: 64 rows up to M=64, then the cost model's pick, which is
    the faster tile in every H200 measurement it was fitted to (Llama-2-7B shapes, 132 SMs);
    256-row tiles only from M=256."""
    qkv, o, gate_up, down = (12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)
    for m in (17, 64):
        assert {gemm_tile_for(m, *shape, sms=132) for shape in (qkv, o, gate_up, down)} == {64}
    for m in (96, 128, 192):  # measured: qkv 37 vs 39, o 18 vs 20, gate_up 49 vs 59 ... at 128
        assert gemm_tile_for(m, *qkv, sms=132) == 64 and gemm_tile_for(m, *o, sms=132) == 64
        assert gemm_tile_for(m, *gate_up, sms=132) == 128
        assert gemm_tile_for(m, *down, sms=132) == 128
    for m in (256, 512, 2048):  # measured at 256: 25.8 vs 26.1 (o) .. 50.0 vs 54.3 (down)
        assert {gemm_tile_for(m, *shape, sms=132) for shape in (qkv, o, gate_up, down)} == {256}


@pytest.mark.parametrize("tiles", [1, 3, 128, 384, 2000])
@pytest.mark.parametrize("num_blocks", [1, 2, 32, 86])
def test_split_k_policy_has_no_empty_split(tiles: int, num_blocks: int) -> None:
    split, per_split = gptq_configs.split_k(tiles, num_blocks, num_sms=132, max_tiles=1024)
    assert 1 <= split <= gptq_configs.MAX_SPLIT_K
    assert (split - 1) * per_split < num_blocks <= split * per_split
    if tiles > 1024:
        assert split == 1


# --- the CUDA kernel's work split and ring placement, checked on the host ------------------


@pytest.fixture(scope="module")
def host_check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    exe = tmp_path_factory.mktemp("cuda") / "host_check"
    src = ROOT / "cuda_ext" / "host_check.cu"
    subprocess.run([nvcc, "-std=c++17", "-O1", "-arch=sm_90", "-o", str(exe), str(src)], check=True)
    return exe


@pytest.mark.parametrize(
    ("tiles", "num_blocks", "run", "ctas"),
    [
        # the GEMV (runs of 4 blocks, one per warp); at most one CTA per run
        (344, 32, 4, [396, 1, 7, 343, 344, 345, 2752]),  # gate_up 4096 -> 22016 (H200: 396 CTAs)
        (192, 32, 4, [396, 264, 132]),  # qkv 4096 -> 12288
        (64, 32, 4, [396, 256, 320, 511, 512]),  # o 4096 -> 4096 (256: at most 4 CTAs per tile)
        (64, 86, 4, [396, 256, 320, 1408]),  # down 11008 -> 4096 (a short last run per tile)
        # the GEMV at 9..16 tokens (runs of 2 blocks, one per pair of warps)
        (344, 32, 2, [396, 264, 5504]),  # gate_up
        (64, 32, 2, [256, 396, 1024]),  # o
        (64, 86, 2, [256, 396, 2752]),  # down (a short last run per tile)
        (3, 5, 2, [1, 2, 4, 6, 9]),
        (1, 1, 4, [1]),
        (3, 5, 4, [1, 2, 4, 5, 6]),
        (3, 5, 1, [1, 2, 4, 7, 14, 15]),
        # the wgmma GEMM's grids (runs of one block, one CTA per SM; tiles of 256 columns x 64 or
        # 128 rows, or of 128 columns x 256 rows)
        (172, 32, 1, [132]),  # gate_up at M=256 (either tile of 128 or 256 rows)
        (64, 32, 1, [132]),  # o at M=256, 64-row tiles (forced)
        (32, 86, 1, [132, 128]),  # down at M=256 (stream-K; exact split in 4)
        (16, 32, 1, [128]),  # o at M=128 with 128-row tiles (forced): an exact split in 8
    ],
)
def test_cuda_kernel_work_split_on_host(
    host_check: Path, tiles: int, num_blocks: int, run: int, ctas
) -> None:  # type: ignore[no-untyped-def]
    """Every (tile, block) item is taken once; segments are whole runs; split tiles are reduced
    by exactly the CTAs that `Split::contributors` names, no CTA writes two partial tiles (one
    workspace slot each); ring reads are bank-conflict-free."""
    args = [str(host_check), str(tiles), str(num_blocks), str(run), *map(str, ctas)]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout


@pytest.mark.parametrize(
    ("tiles", "num_blocks", "resident"),
    [(32, 86, 132), (16, 32, 132), (96, 32, 132), (172, 32, 132), (1, 1, 132), (3, 5, 132),
     (7, 1000, 132), (64, 3, 132), (45, 32, 100)],
)  # fmt: skip
def test_gemm_grid_matches_the_kernel_host_code(
    host_check: Path, tiles: int, num_blocks: int, resident: int
) -> None:
    """`gemm_grid` (which the tile rule models) is the grid the op launches: the same CTAs and
    split as gemm_grid in gptq_gemm.cuh, and an exact split's CTAs each stay in one tile."""
    done = subprocess.run(
        [str(host_check), "grid", str(tiles), str(num_blocks), str(resident)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    ctas, split = gemm_grid(tiles, num_blocks, resident)
    assert done.stdout.split() == [str(ctas), str(split)]
    assert ctas <= resident and (split == 0 or ctas == split * tiles)


def _compile_gemm_kernels(
    tmp_path: Path, kernels: list[tuple[str, int, str]], arch: str, *flags: str
) -> subprocess.CompletedProcess[str]:
    """nvcc -c of gptq_gemm_kernel<T, BT, PQ> for each (T, BT, PQ) for sm_`arch` (skips the test
    without nvcc); stderr holds ptxas's messages."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    src = tmp_path / "instantiate.cu"
    src.write_text(
        '#include "gptq_gemm.cuh"\n'
        + "".join(
            f"template __global__ void pagedq::gptq::gptq_gemm_kernel<{t}, {bt}, {pq}>(\n"
            "    const pagedq::gptq::GemmParams, const __grid_constant__ CUtensorMap);\n"
            for t, bt, pq in kernels
        )
    )
    gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    cmd = [nvcc, "-std=c++17", *flags, gencode, f"-I{ROOT / 'cuda_ext'}", "-c", str(src)]
    return subprocess.run([*cmd, "-o", str(tmp_path / "k.o")], capture_output=True, text=True)


@pytest.mark.parametrize("arch", ["80", "89", "90a"])
def test_gemm_kernel_compiles_for_every_extension_architecture(tmp_path: Path, arch: str) -> None:
    """build.py compiles gptq_gemm.cu with the GEMV for the current GPU's architecture (8.0 and
    up). The wgmma GEMM's body exists only on sm_90a; elsewhere it must still compile, or the
    whole extension, GEMV included, would fail to build."""
    done = _compile_gemm_kernels(tmp_path, [("__nv_bfloat16", 128, "true")], arch, "-O1")
    assert done.returncode == 0, done.stderr[-2000:]


def test_gemm_wgmmas_are_not_serialized(tmp_path: Path) -> None:
    """ptxas keeps each block half's wgmmas in flight together. It silently waits after every
    wgmma when it cannot prove the pipeline safe (info C7513 / C7518, "Potential Performance
    Loss"); a dev prototype ran 1.7x slower that way (gptq_w4a_2026-11-30s_notes.md)."""
    kernels = [("__half", 64, "true"), ("__half", 256, "false")]
    done = _compile_gemm_kernels(tmp_path, kernels, "90a", "-O3", "-Xptxas", "-v")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Potential Performance Loss" not in done.stderr, done.stderr[-2000:]


# --- the Triton kernels through the real compiler (sm_90), no GPU needed ------------------

AOT_VARIANTS = [  # (kernel, dtype, BLOCK_M, BLOCK_N, SCALE_MODE, HAS_ZEROS, HAS_BIAS, USE_SPLIT_K,
    #  SWAP_AB)
    ("gemv", "fp16", 16, 64, 0, False, False, True, False),
    ("gemv", "bf16", 16, 64, 1, True, True, True, False),
    ("gemv", "fp16", 16, 64, 2, True, False, False, False),
    ("gemv", "bf16", 16, 128, 0, False, True, True, True),
    ("gemm", "fp16", 64, 128, 0, False, True, False, False),
    ("gemm", "bf16", 32, 128, 0, True, False, True, False),
    ("gemm", "fp16", 128, 128, 1, False, False, False, False),
    ("gemm", "fp16", 128, 128, 0, True, True, False, True),
]


def aot_compile_variants() -> list[str]:
    """Compile every AOT_VARIANTS entry for sm_90 (needs TRITON_INTERPRET unset); returns names."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton_kernels.gptq_gemm import gptq_gemm_kernel
    from triton_kernels.gptq_gemv import gptq_gemv_kernel

    done = []
    for name, dtype, bm, bn, mode, zeros, bias, split, swap in AOT_VARIANTS:
        kernel = gptq_gemv_kernel if name == "gemv" else gptq_gemm_kernel
        consts = {"BLOCK_M": bm, "BLOCK_N": bn, "SCALE_MODE": mode, "HAS_ZEROS": zeros}
        consts |= {"SWAP_AB": swap}
        consts |= {"HAS_BIAS": bias, "USE_SPLIT_K": split} | (
            {"GROUP_M": 8} if name == "gemm" else {}
        )
        pointers = {"qweight_ptr": "*i32", "ws_ptr": "*fp32", "locks_ptr": "*i32"}
        signature = {}
        for arg in kernel.arg_names:
            if arg in consts:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = pointers.get(arg, f"*{dtype}")
            else:
                signature[arg] = "i32"
        keyed = {(kernel.arg_names.index(k),): v for k, v in consts.items()}  # triton >= 3.2 form
        source = ASTSource(kernel, signature, keyed)
        options = {"num_warps": 8 if bm == 128 else 4, "num_stages": 3}
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        done.append(f"{name}-{dtype}-{bm}x{bn}-mode{mode}-swap{int(swap)}")
    return done


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90() -> None:
    """The interpreter does not type-check like the compiler: compile for an H100/H200 offline."""
    code = "from tests.test_gptq_kernels import aot_compile_variants as f; print(len(f()))"
    assert run_compiler(code).strip() == str(len(AOT_VARIANTS))


@pytest.mark.parametrize("swap_ab", [0, 1])
@pytest.mark.parametrize("m", [2, 20])
@pytest.mark.parametrize("group_size", [64, 128])  # scaled weights / scaled exact sums
def test_table_configs_operand_orders_and_fixed_split(
    swap_ab: int, m: int, group_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-shape TUNED entry wins over the M tables; both operand orders and a fixed split
    (more splits than blocks is clamped) give the reference result."""
    ck = make_checkpoint(seed=9, k=384, n=48, group_size=group_size, zero_mode="v1", bias=True)
    lin = GPTQLinear([ck.tensors], ck.config, torch.float32)
    small = gptq_configs.KernelConfig(16, 32, 4, 2, split_k=8, swap_ab=swap_ab)
    large = gptq_configs.KernelConfig(16, 16, 4, 2, split_k=2, swap_ab=swap_ab)
    monkeypatch.setitem(gptq_configs.TUNED, ("small", 48, 384), ((16, small),))
    monkeypatch.setitem(gptq_configs.TUNED, ("large", 48, 384), ((64, large),))
    assert gptq_configs.pick_config(m <= 16, m, 48, 384) == (small if m <= 16 else large)
    assert gptq_configs.split_for(small, 2, 3, 132, 1024) == (3, 1)
    x = torch.randn(m, 384)
    _assert_matches(_run(lin, x, monkeypatch), x, [ck])
    packed, _ = lin.segment(0)
    assert int(packed.locks.abs().sum()) == 0


def test_tuning_sweep_installs_and_prints_the_best_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep logic with a fake timer (no kernels run): winners land in TUNED, the printed
    table is valid Python naming them, and failing configs are skipped."""
    from types import SimpleNamespace

    from triton_kernels import gptq_tuning

    monkeypatch.setattr(gptq_configs, "TUNED", {})
    weights = [SimpleNamespace(out_features=96, in_features=256) for _ in range(2)]

    def timer(ws: list, m: int, call: object) -> float:  # type: ignore[type-arg]
        cfg = gptq_configs.TUNED[("small" if m <= 16 else "large", 96, 256)][0][1]
        if cfg.block_n == 256:
            raise RuntimeError("out of shared memory")
        return cfg.block_n + cfg.split_k + cfg.num_stages + m

    result = gptq_tuning.sweep_and_apply(timer, weights)
    small = gptq_configs.TUNED[("small", 96, 256)]
    assert [bound for bound, _ in small] == [1, 16]
    assert small[0][1].block_n == 64 and small[0][1].split_k == 2 and small[0][1].num_stages == 3
    assert [bound for bound, _ in gptq_configs.TUNED[("large", 96, 256)]] == [64, 1 << 30]
    namespace = {"KernelConfig": gptq_configs.KernelConfig, "ConfigTable": tuple}
    exec(result["table"], namespace)  # the printed table is pasteable Python
    assert namespace["TUNED"] == gptq_configs.TUNED
