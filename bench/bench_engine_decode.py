"""W2: engine decode throughput on a Llama-2-7B-shaped GPTQ model, CUDA graphs vs eager steps.

Conditions: one GPU; a synthetic Llama-2-7B (32 layers, hidden 4096, intermediate 11008, 32
heads, vocab 32000) with random 4-bit GPTQ weights (group 128, symmetric, fp16 scales) and fp16
embeddings and lm_head, written once into --work. Workload W2 of targets.md: B prompts of 8
random tokens, 128 new tokens each, greedy, EOS ignored, for B = 1, 16, 64 (max_num_seqs 64).
Each B runs once untimed (kernels compile, graphs are captured), then --repeats timed runs;
new tokens/s = B * 128 / the median wall time of `LLM.generate`. Three modes (`MODES`): graphs
with launch-ahead (the default engine), graphs one step at a time (`launch_ahead=False`), and
eager steps: the same engine with its graphs detached, which is what `enforce_eager=True`
builds (one 3.9 GB load instead of two).

Run (about 2 minutes on an H200, plus about 1 minute to write the model the first time):
    PYTHONPATH=. python3 bench/bench_engine_decode.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

from pagedq import LLM, SamplingParams

LAYERS, HIDDEN, INTER, HEADS, VOCAB, GROUP = 32, 4096, 11008, 32, 32000, 128
BATCHES = (1, 16, 64)
PROMPT_TOKENS, NEW_TOKENS = 8, 128
TARGETS = {1: 800, 16: 6000, 64: 15000}  # targets.md W2, new tokens/s
# mode -> (decode steps from CUDA graphs, launch-ahead)
MODES = {"graphs": (True, True), "graphs, no launch-ahead": (True, False), "eager": (False, True)}


def write_model(
    folder: Path,
    *,
    layers: int = LAYERS,
    hidden: int = HIDDEN,
    inter: int = INTER,
    heads: int = HEADS,
    gptq: bool = True,
    device: str = "cuda",
) -> Path:
    """The synthetic checkpoint, GPTQ (the default: the Llama-2-7B shape) or fp16 (skipped when
    the folder is complete)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}

    def dense(name: str, shape: tuple[int, ...], std: float) -> None:
        t = torch.randn(shape, generator=g, device=device) * std
        tensors[name] = t.half().cpu()

    def linear(name: str, k: int, n: int) -> None:
        if not gptq:
            dense(f"{name}.weight", (n, k), 0.02)
            return
        words = torch.randint(-(2**31), 2**31, (k // 8, n), generator=g, device=device)
        tensors[f"{name}.qweight"] = words.int().cpu()
        tensors[f"{name}.qzeros"] = torch.full((k // GROUP, n // 8), 0x77777777, dtype=torch.int32)
        scales = torch.rand((k // GROUP, n), generator=g, device=device) * 0.002 + 0.001
        tensors[f"{name}.scales"] = scales.half().cpu()
        tensors[f"{name}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP

    dense("model.embed_tokens.weight", (VOCAB, hidden), 0.02)
    dense("lm_head.weight", (VOCAB, hidden), 0.02)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.float16)
    for i in range(layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}{norm}.weight"] = torch.ones(hidden, dtype=torch.float16)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear(f"{p}self_attn.{proj}", hidden, hidden)
        for proj in ("gate_proj", "up_proj"):
            linear(f"{p}mlp.{proj}", hidden, inter)
        linear(f"{p}mlp.down_proj", inter, hidden)
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float16",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    if gptq:
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq",
        }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    save_file(tensors, str(folder / "model.safetensors.tmp"))
    (folder / "model.safetensors.tmp").rename(folder / "model.safetensors")
    return folder


def timed_runs(llm: LLM, batch: int, repeats: int) -> float:
    """Median seconds of `generate` for the W2 workload at `batch` (after one untimed run)."""
    g = torch.Generator().manual_seed(batch)
    shape = (batch, PROMPT_TOKENS)
    prompts = torch.randint(3, VOCAB, shape, generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    return statistics.median(times)


def engine_bench_args(doc: str) -> argparse.Namespace:
    """--out (result folder), --work (the synthetic model's folder) and --repeats, shared by
    the engine benches."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedq-llama2-7b-gptq"))
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    args = engine_bench_args(__doc__ or "")
    start = time.perf_counter()
    folder = write_model(args.work)
    print(f"model folder ready in {time.perf_counter() - start:.0f} s", flush=True)
    start = time.perf_counter()
    llm = LLM(str(folder), device="cuda", num_blocks=2048, max_num_seqs=max(BATCHES))
    print(f"loaded in {time.perf_counter() - start:.0f} s", flush=True)
    rows: list[dict[str, Any]] = []
    graphs = llm.engine.runner.graphs
    for mode in MODES:
        set_mode(llm, graphs, mode)
        for batch in BATCHES:
            seconds = timed_runs(llm, batch, args.repeats)
            row = {"mode": mode, "batch": batch, "seconds": seconds,
                   "tokens_per_s": batch * NEW_TOKENS / seconds,
                   "ms_per_step": seconds / (NEW_TOKENS + 1) * 1e3}  # fmt: skip
            rows.append(row)
            print(f"  {mode} B={batch}: {row['tokens_per_s']:.0f} tok/s", flush=True)
    set_mode(llm, graphs, "graphs")
    write(rows, llm, args.out)


def set_mode(llm: LLM, graphs: Any, mode: str) -> None:
    """Put the engine in one of MODES; `graphs` is the runner's own DecodeGraphs."""
    use_graphs, ahead = MODES[mode]
    llm.engine.runner.graphs = graphs if use_graphs else None
    llm.engine.launch_ahead = ahead


def environment(llm: LLM) -> dict[str, Any]:
    """Date stamp, GPU, versions and the engine's counters, for a result file."""
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "stats": llm.stats(),
    }


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table: the header, its rule, one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def command_line() -> str:
    """This run's exact command, as the results record it."""
    return "PYTHONPATH=. " + " ".join(["python3", *map(shlex.quote, sys.argv)])


def save_result(
    out: Path, name: str, env: dict[str, Any], rows: list[dict[str, Any]], lines: list[str]
) -> None:
    """Write `{name}_{date}.json` (env and rows) and `.md` (the lines) into `out`; print the
    table."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{name}_{env['date_utc']}"
    stem.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}))
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    print(text)


def write(rows: list[dict[str, Any]], llm: LLM, out: Path) -> None:
    env = environment(llm)
    stamp = env["date_utc"]
    by = {(r["mode"], r["batch"]): r for r in rows}
    lines = [
        f"# W2 engine decode, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
        f"{stamp} UTC",
        "",
        f"Command: `{command_line()}`",
        "",
        "tok/s (ms/step) per mode:",
        "",
    ]
    lines += markdown_table(
        ["B", *MODES, "target tok/s"],
        (
            [b]
            + [f"{by[(m, b)]['tokens_per_s']:.0f} ({by[(m, b)]['ms_per_step']:.2f})" for m in MODES]
            + [TARGETS[b]]
            for b in BATCHES
        ),
    )
    save_result(out, "engine_decode", env, rows, lines)


if __name__ == "__main__":
    main()
