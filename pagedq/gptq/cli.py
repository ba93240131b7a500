"""The `pagedq quantize` and `pagedq eval-ppl` subcommands (registered by `pagedq.cli`).

pagedq quantize MODEL_DIR OUT_DIR [--group-size 128] [--desc-act] [--asym]
                [--calibration FILE] [--samples 128] [--seq-len 512] [--method gptq|rtn]
pagedq eval-ppl MODEL_DIR [--text FILE] [--window 512] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pagedq.errors import ConfigError, PagedqError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_quantize_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `quantize`; its `func(args) -> int` runs it."""
    p = subparsers.add_parser(
        "quantize",
        help="quantize a dense Llama folder to a 4-bit GPTQ folder",
        description="Quantize a dense Llama model folder to 4-bit GPTQ (or round-to-nearest). "
        "The output loads in pagedq, transformers, GPTQModel and vLLM.",
    )
    p.add_argument("model_dir", help="dense Hugging Face model folder (safetensors)")
    p.add_argument("out_dir", help="output folder (must not exist or be empty)")
    p.add_argument("--bits", type=int, default=4, help="weight bits (only 4)")
    p.add_argument(
        "--group-size", type=int, default=128, help="input rows per scale/zero; -1: one group"
    )
    p.add_argument("--desc-act", action="store_true", help="act-order (by Hessian diagonal)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True, help="(default)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric grid")
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="calibration text: plain text, or .jsonl with a 'text' field (default: bundled)",
    )
    p.add_argument("--samples", type=int, default=128, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--damp", type=float, default=0.01, help="dampening, fraction of mean diag H")
    p.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    p.add_argument(
        "--format", choices=("gptq", "gptq_v2"), default="gptq", help="checkpoint format"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration windows")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_quantize)


def add_eval_ppl_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `eval-ppl`; its `func(args) -> int` runs it."""
    p = subparsers.add_parser(
        "eval-ppl",
        help="perplexity of a model folder (dense or GPTQ) on a text",
        description="Perplexity of a model folder on a text, computed with pagedq's own model.",
    )
    p.add_argument("model_dir", help="model folder (dense or GPTQ)")
    p.add_argument("--text", metavar="FILE", help="text file (default: the bundled eval text)")
    p.add_argument("--window", type=int, default=512, help="tokens per window")
    p.add_argument("--stride", type=int, default=None, help="window start step (default: window)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run_eval_ppl)


def run_quantize(args: argparse.Namespace) -> int:
    from pagedq.gptq.quantizer import QuantizeOptions, quantize_model

    try:
        if args.group_size == 0 or args.group_size < -1:
            raise ConfigError(f"--group-size {args.group_size}: use a positive size or -1")
        opts = QuantizeOptions(
            bits=args.bits,
            group_size=None if args.group_size == -1 else args.group_size,
            desc_act=args.desc_act,
            sym=args.sym,
            damp_percent=args.damp,
            samples=args.samples,
            seq_len=args.seq_len,
            checkpoint_format=args.format,
            seed=args.seed,
            method=args.method,
        )
        text = None if args.calibration is None else load_calibration_file(args.calibration)
        out = quantize_model(args.model_dir, args.out_dir, opts, text, progress=not args.quiet)
    except PagedqError as e:
        print(f"pagedq quantize: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def run_eval_ppl(args: argparse.Namespace) -> int:
    from pagedq.eval_ppl import bundled_eval_text, perplexity

    try:
        text = bundled_eval_text() if args.text is None else _read_text(args.text)
        ppl = perplexity(
            args.model_dir,
            text,
            dtype=DTYPES[args.dtype],
            device=args.device,
            window=args.window,
            stride=args.stride,
            max_tokens=args.max_tokens,
        )
    except PagedqError as e:
        print(f"pagedq eval-ppl: error: {e}", file=sys.stderr)
        return 1
    print(f"perplexity {ppl:.4f}")
    return 0


def load_calibration_file(path: str) -> str:
    """Plain text, or JSON lines (`.jsonl`) whose objects carry a "text" field (joined)."""
    raw = _read_text(path)
    if Path(path).suffix != ".jsonl":
        return raw
    texts = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path!r} line {lineno} is not JSON: {e}") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ConfigError(f'{path!r} line {lineno} has no string "text" field')
        texts.append(record["text"])
    if not texts:
        raise ConfigError(f"{path!r} holds no records")
    return "\n\n".join(texts)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path!r}: {e}") from e
