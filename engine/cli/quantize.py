"""`sgld quantize`: write a quantized copy of a model file that the loader reads back quantized, by the writer
of the format asked for (engine/features/quant/registry.py's writer table: sgld .safetensors, GGUF .gguf)."""
from __future__ import annotations

import json
import os
import time

from ..features.quant import FILE_WRITERS, describe_formats, writable_formats, writer_for, writer_formats
from ..models.bundle import named_file
from .common import check_output_path


def _writes() -> str:
    """Which file each --format name writes, from the writer table."""
    return "; ".join(f"{w.suffix} for {', '.join(writer_formats(w))}{f' ({w.help})' if w.help else ''}"
                     for w in FILE_WRITERS.values())


def add_parser(sub) -> None:
    suffixes = " or ".join(dict.fromkeys(w.suffix for w in FILE_WRITERS.values()))  # two writers share .safetensors
    q = sub.add_parser("quantize", help=f"write a quantized copy of a model file ({suffixes})",
                       description="Quantize the DiT blocks' linear layers of an ERNIE-Image checkpoint (bf16/fp16/fp32, "
                                   f"or already quantized) and write a file ({suffixes}) that the loader (and the "
                                   "SGLDiffusion Model Loader node) reads back quantized. One tensor in memory at a time.")
    q.add_argument("input", help="ERNIE-Image .safetensors file or diffusers folder, or 'demo' / 'demo-turbo' (an "
                                 "embedded demo model's DiT: `sgld generate --model` runs the copy with the demo's text "
                                 "encoder)")
    q.add_argument("output", help=f"the file to write: {suffixes}, as --format says")
    q.add_argument("--format", required=True, choices=writable_formats(), type=str.lower,
                   help=f"{describe_formats()}. Writes {_writes()}")
    q.add_argument("--dtype", default=None, help="dtype of the tensors left unquantized: bf16, fp16, fp32 (default: as stored)")
    q.add_argument("--json", action="store_true", help="print one line of JSON")


def cmd_quantize(args) -> dict:
    writer = writer_for(args.format)
    out = args.output.lower()
    if writer.formats is not None and not out.endswith(writer.suffix):  # a writer of its own (GGUF)
        raise ValueError(f"--format {args.format} writes a {writer.label} file: the output must end in {writer.suffix}, "
                         f"not '{args.output}'")
    other = next((w for w in FILE_WRITERS.values() if w.suffix != writer.suffix and w.formats is not None
                  and out.endswith(w.suffix)), None)  # another writer's file kind (two writers may share .safetensors)
    if other is not None:
        raise ValueError(f"output '{args.output}' is a {other.label} file: --format must be a {other.label} type "
                         f"({', '.join(writer_formats(other))}), not {args.format} (which writes {writer.suffix})")
    check_output_path("output", args.output, (writer.suffix,))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)  # as check_output_path promises
    t0 = time.perf_counter()
    source = named_file(args.input)  # "demo", "demo-turbo": the embedded models, as elsewhere
    summary = writer.write(source, args.output, args.format, dtype=args.dtype)
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
