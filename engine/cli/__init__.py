"""`sgld` command line: generate images, serve them over HTTP, benchmark the engine, quantize a model file. One module per
command; common.py holds the engine's flags (derived from EngineConfig's declarations) and the shared
checks. Errors are one line and exit 2; Ctrl-C is one line and exit 130."""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from ..errors import USER_ERRORS
from . import bench, generate, quantize, serve
from .common import check_common_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgld", description="SGLDiffusion: fast ERNIE-Image inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parser(sub)
    generate.add_parser(sub)
    quantize.add_parser(sub)
    serve.add_parser(sub)
    return parser


def _setup_logging() -> None:
    """The engine's choices (attention backend, fp8 matmul, compile) and its fallback warnings go to
    stderr as one line each: ``sgld: attention: sdpa (...)``, ``sgld: warning: ...``."""
    logger = logging.getLogger("sgld")
    if not logger.handlers:
        class Format(logging.Formatter):
            def format(self, record):
                kind = "warning: " if record.levelno >= logging.WARNING else ""
                return f"sgld: {kind}{record.getMessage()}"

        class Stderr(logging.StreamHandler):  # the current sys.stderr at each record
            stream = property(lambda self: sys.stderr, lambda self, value: None)

        h = Stderr()
        h.setFormatter(Format())
        logger.addHandler(h)
        logger.setLevel(logging.INFO)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging()
    try:
        check_common_args(args)
    except ValueError as e:
        print(f"sgld {args.command}: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "threads", 0):  # from the start (loading too); without it the model decides (common.use_threads)
        torch.set_num_threads(args.threads)
    try:
        return _run_command(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT; --out keeps its old content
        print(f"sgld {args.command}: interrupted", file=sys.stderr)
        return 130


def _run_command(args) -> int:
    try:
        if args.command == "bench":
            bench.cmd_bench(args)
        elif args.command == "generate":
            args.loras = generate.lora_specs(args)
            generate.cmd_generate(args)
        elif args.command == "quantize":
            quantize.cmd_quantize(args)
        elif args.command == "serve":
            args.loras = generate.lora_specs(args)
            serve.cmd_serve(args)
    except (*USER_ERRORS, ValueError, OSError) as e:
        print(f"sgld {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["build_parser", "main"]
