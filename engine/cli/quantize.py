"""`sgld quantize`: write a quantized (FP8 / INT4 / INT8) copy of a model file that the loader reads back quantized."""
from __future__ import annotations

import json
import time

from ..features.quant import FORMATS, quantize_file
from .common import check_output_path


def add_parser(sub) -> None:
    q = sub.add_parser("quantize", help="write an FP8 / INT4 / INT8 copy of a model file",
                       description="Quantize the DiT blocks' linear layers of an ERNIE-Image checkpoint (bf16/fp16/fp32, "
                                   "or already quantized) and write a .safetensors file that the loader (and the "
                                   "SGLDiffusion Model Loader node) reads back quantized. One tensor in memory at a time.")
    q.add_argument("input", help="ERNIE-Image .safetensors file or diffusers folder")
    q.add_argument("output", help="the .safetensors file to write")
    q.add_argument("--format", required=True, choices=FORMATS,
                   help="fp8: e4m3, one scale per output channel; int4: groups of 128 (int4-g64: groups of 64); "
                        "int8 / int8-weight: int8, one scale per output channel (loads as W8A8 / weight-only)")
    q.add_argument("--dtype", default=None, help="dtype of the tensors left unquantized: bf16, fp16, fp32 (default: as stored)")
    q.add_argument("--json", action="store_true", help="print one line of JSON")


def cmd_quantize(args) -> dict:
    check_output_path("output", args.output, (".safetensors",))
    t0 = time.perf_counter()
    summary = quantize_file(args.input, args.output, args.format, dtype=args.dtype)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        print(json.dumps(summary))
    else:
        ratio = f" ({summary['output_bytes'] / summary['input_bytes']:.2f}x)" if summary.get("input_bytes") else ""
        print(f"wrote {args.output}: {summary['layers']} linear layers as {args.format}, "
              f"{summary['output_bytes'] / 2 ** 20:.1f} MiB{ratio}")
    return summary
