"""`sgld` command line: generate images, serve them over HTTP, benchmark the engine, quantize a model file. One module per
command; common.py holds the engine's flags (derived from EngineConfig's declarations) and the shared
checks. Errors are one line and exit 2; Ctrl-C is one line and exit 130, SIGTERM / SIGHUP one line and 128 + the
signal's number (the output keeps its old content, no part file is left)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading

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


class Terminated(BaseException):
    """SIGTERM or SIGHUP during a command: it unwinds the stack like Ctrl-C, so the cleanups run (a half-written
    output's part file is removed: engine/io/atomic.py)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_unwind(command: str):
    """SIGTERM and SIGHUP raise Terminated while ``command`` runs, once (a second one does what it did before,
    killing by default); the old handlers come back after. Not for serve: uvicorn shuts down on them itself."""
    names = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    if command == "serve" or threading.current_thread() is not threading.main_thread():
        names = []  # signal handlers can be set from the main thread only
    old = {}

    def restore():
        for s, h in old.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)

    def handler(signum, frame):
        restore()
        raise Terminated(signum)

    try:
        for s in names:
            old[s] = signal.signal(s, handler)
        yield
    finally:
        restore()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args._argv = argv  # the command line as given (sgld serve --dp-size gives it to its replicas)
    _setup_logging()
    try:
        check_common_args(args, devices_here=getattr(args, "ray", None) is None)  # --ray: the replicas' nodes
    except ValueError as e:
        print(f"sgld {args.command}: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "threads", 0):  # from the start (loading too); without it the model decides (common.use_threads)
        torch.set_num_threads(args.threads)
    try:
        with _signals_unwind(args.command):
            return _run_command(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT; --out keeps its old content
        print(f"sgld {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:  # the same for SIGTERM / SIGHUP: 143 / 129, as a shell reports a process they ended
        print(f"sgld {args.command}: terminated by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum


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
