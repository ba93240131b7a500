"""The `pagedq` command: `batch` (the main job), `quantize` and `eval-ppl`.

`quantize` and `eval-ppl` live in `pagedq.gptq.cli`, imported only when one of them is the
command, so `pagedq batch` and `pagedq --help` never depend on that module.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedq import __version__

if TYPE_CHECKING:
    from pagedq.batch import BatchOptions

SubParsers = Any  # argparse._SubParsersAction (private in typeshed)

EXTERNAL_COMMANDS = {
    "quantize": ("add_quantize_parser", "quantize a dense Llama folder to a 4-bit GPTQ folder"),
    "eval-ppl": ("add_eval_ppl_parser", "perplexity of a model folder (dense or GPTQ) on a text"),
}
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("pagedq: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; the module of `quantize` / `eval-ppl` is imported only if it is `command`."""
    parser = argparse.ArgumentParser(
        prog="pagedq",
        description="Paged-attention KV-cache engine with prefix sharing for 4-bit GPTQ Llamas.",
    )
    parser.add_argument("--version", action="version", version=f"pagedq {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_batch_parser(subparsers)
    for name, (adder, help_text) in EXTERNAL_COMMANDS.items():
        if name == command:
            _add_external(subparsers, name, adder, help_text)
        else:  # listed in the help; the real parser is built when it is the command
            subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def _add_external(subparsers: SubParsers, name: str, adder: str, help_text: str) -> None:
    try:
        getattr(importlib.import_module("pagedq.gptq.cli"), adder)(subparsers)
    except Exception as e:  # a broken module must not take the other commands down with it
        error = f"{type(e).__name__}: {e}"
        p = subparsers.add_parser(name, help=help_text)
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=lambda _args: _unavailable(name, error))


def _unavailable(name: str, error: str) -> int:
    print(f"pagedq {name}: unavailable ({error})", file=sys.stderr)
    return 1


# --- pagedq batch ----------------------------------------------------------------------------

BATCH_DESCRIPTION = """\
Run many prompts that share one system prompt, one answer each, written to a JSONL file as
they finish. Run the same command again after a crash, Ctrl-C or kill -9: rows already in
the output are skipped (error rows too: delete them from the output to retry them). With no
--input, runs the bundled example: 200 product reviews classified by one shared rules prompt."""


def add_batch_parser(subparsers: SubParsers) -> None:
    """Register `batch`; its `func(args) -> int` runs it."""
    p = subparsers.add_parser(
        "batch",
        help="offline batch job with a shared system prompt (resumable)",
        description=BATCH_DESCRIPTION,
    )
    io = p.add_argument_group("input and output")
    io.add_argument("--model", metavar="PATH", help="HF model folder (default: embedded SmolLM2)")
    io.add_argument("--input", metavar="FILE", help="JSONL or text (default: bundled example)")
    io.add_argument("--output", metavar="FILE", help="output JSONL (default: INPUT.out.jsonl)")
    io.add_argument("--input-format", choices=("auto", "jsonl", "text"), default="auto")
    io.add_argument("--limit", type=int, metavar="N", help="only the first N input rows")
    io.add_argument("--summary-json", metavar="FILE", help="also write the summary as JSON")
    io.add_argument("--quiet", action="store_true", help="no progress bar")
    prompt = p.add_argument_group("prompt")
    system = prompt.add_mutually_exclusive_group()
    system.add_argument("--system", metavar="TEXT", help="shared system prompt")
    system.add_argument("--system-file", metavar="FILE", help="shared system prompt from a file")
    prompt.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="use the model's chat template (default: when it has one)",
    )
    _add_sampling_flags(p.add_argument_group("sampling"))
    _add_engine_flags(p.add_argument_group("engine"))
    p.set_defaults(func=run_batch_command)


def _add_sampling_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--max-tokens", type=int, metavar="N", help="new tokens per row (default 128; example: 8)"
    )
    group.add_argument("--temperature", type=float, metavar="T", help="default 0: greedy")
    group.add_argument("--top-p", type=float, metavar="P", help="default 1.0")
    group.add_argument(
        "--seed", type=int, metavar="S", help="per-row sampling seed (same output on resume)"
    )
    group.add_argument(
        "--stop",
        nargs="+",
        action="extend",
        metavar="STR",
        help="stop strings (the example stops at a newline)",
    )


def _add_engine_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--cache",
        choices=("paged", "static"),
        default="paged",
        help="paged: blocks on demand, prefix sharing (default); static: preallocated slots",
    )
    group.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not share the prompt blocks of the common prefix",
    )
    group.add_argument("--block-size", type=int, default=16, metavar="N", help="default 16")
    group.add_argument(
        "--compare-static",
        action="store_true",
        help="run this run's rows again in the static (preallocated) mode and compare",
    )
    group.add_argument(
        "--max-num-seqs", type=int, default=64, metavar="N", help="running at once (default 64)"
    )
    group.add_argument("--num-blocks", type=int, metavar="N", help="KV pool size in blocks")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    group.add_argument(
        "--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto"
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs",
    )


def run_batch_command(args: argparse.Namespace) -> int:
    """`pagedq batch`: run the job, print the summary; 130 after Ctrl-C."""
    from pagedq.batch import run_batch
    from pagedq.errors import PagedqError

    try:
        options = batch_options(args)
        summary = run_batch(args.input, args.output, options)
    except (PagedqError, OSError) as e:
        print(f"pagedq batch: error: {e}", file=sys.stderr)
        return 1
    print(summary.format())
    if args.summary_json:
        text = json.dumps(summary.to_dict(), indent=2)
        Path(args.summary_json).write_text(text + "\n", encoding="utf-8")
    return EXIT_INTERRUPTED if summary.interrupted else 0


def batch_options(args: argparse.Namespace) -> BatchOptions:
    """The `BatchOptions` of parsed `batch` flags (raises the typed errors of bad values)."""
    from pagedq.batch import BatchOptions, default_params

    given = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "stop": args.stop,
    }
    defaults = default_params(bundled=args.input is None)
    params = dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})
    system = args.system
    if args.system_file is not None:
        system = Path(args.system_file).read_text(encoding="utf-8")
    return BatchOptions(
        model=args.model,
        system=system,
        chat=args.chat,
        params=params,
        cache=args.cache,
        enable_prefix_caching=args.prefix_caching,
        block_size=args.block_size,
        compare_static=args.compare_static,
        max_num_seqs=args.max_num_seqs,
        device=args.device,
        dtype=args.dtype,
        num_blocks=args.num_blocks,
        enforce_eager=args.enforce_eager,
        input_format=args.input_format,
        limit=args.limit,
        progress=not args.quiet,
    )
