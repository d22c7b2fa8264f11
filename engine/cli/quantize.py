"""`sgld quantize`: write an FP8 / INT4 / INT8 copy of a model file that the loader reads back quantized, or a
GGUF file (q8_0, q4_k, ...: engine/features/quant/gguf_convert.py)."""
from __future__ import annotations

import json
import os
import time

from ..features.quant import FORMATS, quantize_file
from ..features.quant.gguf_convert import GGUF_FORMATS, gguf_type, quantize_gguf_file
from ..models import demo as demo_model
from ..router import DEMO
from .common import check_output_path


def _choices():
    return tuple(FORMATS) + tuple(f for f in GGUF_FORMATS if f not in FORMATS)


def add_parser(sub) -> None:
    q = sub.add_parser("quantize", help="write an FP8 / INT4 / INT8 copy of a model file",
                       description="Quantize the DiT blocks' linear layers of an ERNIE-Image checkpoint (bf16/fp16/fp32, "
                                   "or already quantized) and write a .safetensors file that the loader (and the "
                                   "SGLDiffusion Model Loader node) reads back quantized. One tensor in memory at a time.")
    q.add_argument("input", help="ERNIE-Image .safetensors file or diffusers folder, or 'demo' (the embedded demo "
                                 "model's DiT: `sgld generate --model` runs the copy with the demo's text encoder)")
    q.add_argument("output", help="the .safetensors file to write (.gguf for a GGUF type)")
    q.add_argument("--format", required=True, choices=_choices(), type=str.lower,
                   help="fp8: e4m3, one scale per output channel; int4: groups of 128 (int4-g64: groups of 64); "
                        "int8 / int8-weight: int8, one scale per output channel (loads as W8A8 / weight-only); "
                        "a GGUF type (q8_0, q4_k, ...): a .gguf file that ComfyUI-GGUF also loads")
    q.add_argument("--dtype", default=None, help="dtype of the tensors left unquantized: bf16, fp16, fp32 (default: as stored)")
    q.add_argument("--json", action="store_true", help="print one line of JSON")


def cmd_quantize(args) -> dict:
    to_gguf = gguf_type(args.format) is not None  # a GGUF type (q4_k ..., also f16 / bf16 / f32) writes GGUF
    if to_gguf and not args.output.lower().endswith(".gguf"):
        raise ValueError(f"--format {args.format} writes a GGUF file: the output must end in .gguf, not '{args.output}'")
    if not to_gguf and args.output.lower().endswith(".gguf"):
        raise ValueError(f"output '{args.output}' is a GGUF file: --format must be a GGUF type "
                         f"({', '.join(GGUF_FORMATS)}), not {args.format} (which writes .safetensors)")
    check_output_path("output", args.output, (".gguf",) if to_gguf else (".safetensors",))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)  # as check_output_path promises
    t0 = time.perf_counter()
    write = quantize_gguf_file if to_gguf else quantize_file
    source = demo_model.DEMO_WEIGHTS if args.input == DEMO else args.input  # "demo": the embedded model, as elsewhere
    summary = write(source, args.output, args.format, dtype=args.dtype)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        print(json.dumps(summary))
    else:
        ratio = f" ({summary['output_bytes'] / summary['input_bytes']:.2f}x)" if summary.get("input_bytes") else ""
        fallback = summary.get("fallback") or {}
        other = f", {len(fallback)} as {'/'.join(sorted(set(fallback.values())))} (rows not whole blocks)" if fallback else ""
        print(f"wrote {args.output}: {summary['layers']} linear layers as {args.format}{other}, "
              f"{summary['output_bytes'] / 2 ** 20:.1f} MiB{ratio}")
    return summary
