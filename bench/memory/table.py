"""Regenerate the predicted-peak table of docs/memory.md and bench/RESULTS.md (between their
``<!-- predicted:start/end -->`` markers):

    .venv/bin/python bench/memory/table.py            # the 8B release shape, every row (a few minutes on 2 cores)
    .venv/bin/python bench/memory/table.py --print    # print the table instead of writing the pages

One row per configuration and resolution (predict.py), with the cards it fits and the published figures.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from predict import Prediction, Setup, Unavailable, predict, predict_cached  # noqa: E402  (puts the project root on sys.path)
from rehearse import GiB, RehearsalError  # noqa: E402

from engine.io.atomic import atomic_write  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "memory.md")
PAGES = (PAGE, os.path.join(ROOT, "bench", "RESULTS.md"))
START, END = "<!-- predicted:start -->", "<!-- predicted:end -->"
CARDS = (8, 12, 16, 24, 32, 80)  # GB cards (their memory is GiB: an "8 GB" card has 8192 MiB)
DESKTOP_GIB = 1.0  # kept for the desktop / other programs
CONTEXT_GIB = 0.5  # the CUDA context (not a tensor: invisible to the trace, added here)
PIXELS = (1024, 2048)

SEED_BF16 = "seeds: 8B bf16 about 16 GB"
OFFLOAD_8GB = "SGLang's ERNIE article: 8 GB (RTX 3070) with layer-wise offload; SGLang: Qwen-Image offloaded at 8.5 GB"

# (setup, published figure beside it)
ROWS: List[Tuple[Setup, str]] = [
    (Setup("Base bf16"), SEED_BF16 + "; model card: runs on 24 GB consumer GPUs"),
    (Setup("Base fp8", quant="fp8"), ""),
    (Setup("Base int8 W8A8", quant="int8"), ""),
    (Setup("Base int4 (g128)", quant="int4"), ""),
    (Setup("Base GGUF Q8_0", quant="q8_0"), ""),
    (Setup("Base GGUF Q4_K", quant="q4_k"), ""),
    (Setup("Base ComfyUI nvfp4", quant="nvfp4"), ""),
    (Setup("Base ComfyUI mxfp8", quant="mxfp8"), ""),
    (Setup("Base ComfyUI int8 tensorwise", quant="int8-tensorwise"), ""),
    (Setup("Base ComfyUI convrot-w4a4", quant="convrot-w4a4"), ""),
    (Setup("Base ComfyUI asym-w4a8-int8", quant="asym-w4a8-int8"), ""),
    (Setup("Base ComfyUI awq-w4a16 (files only)", quant="awq-w4a16"), ""),
    (Setup("Base bf16, offload 2 buffers", offload="layerwise", resident_layers=2), OFFLOAD_8GB),
    (Setup("Base bf16, offload 8 buffers", offload="layerwise", resident_layers=8), ""),
    (Setup("Base fp8, offload 2 buffers", quant="fp8", offload="layerwise"), ""),
    (Setup("Base GGUF Q4_K, offload 2 buffers", quant="q4_k", offload="layerwise"),
     "stable-diffusion.cpp: ERNIE-Image on 4 GB with --offload-to-cpu"),
    (Setup("Base bf16, Cache-DiT", cache=True), ""),
    (Setup("Base bf16, offload 2, Cache-DiT", offload="layerwise", cache=True), ""),
    (Setup("Base bf16, LoRA r32 (merged, restore copy)", lora_rank=32, lora_restore="copy"), ""),
    (Setup("Base fp8, LoRA r32 (side path)", quant="fp8", lora_rank=32), ""),
    (Setup("Base bf16, compile (eager fallback)", compile=True), ""),
    (Setup("Base bf16, ComfyUI MODEL call (CFG batch 2)", comfy=True), ""),
    (Setup("Base bf16, TP 2 (per rank)", tp=2), ""),
    (Setup("Base bf16, TP 4 (per rank)", tp=4), ""),
    (Setup("Base bf16, Ulysses 2 (per rank)", ulysses=2), ""),
    (Setup("Base bf16, Ulysses 4 (per rank)", ulysses=4), ""),
    (Setup("Base bf16, TP 2 x Ulysses 2 (per rank)", tp=2, ulysses=2), ""),
    (Setup("Base bf16, Ring 2 (per rank)", ring=2), ""),
    (Setup("Base bf16, Ring 4 (per rank)", ring=4), ""),
    (Setup("Base bf16, Ring 2 x Ulysses 2 (per rank)", ring=2, ulysses=2), ""),
    (Setup("Base bf16, CFG parallel 2 (per rank)", cfg_parallel=2), ""),
    (Setup("Turbo bf16", model="turbo"), ""),
    (Setup("Turbo fp8", model="turbo", quant="fp8"), ""),
    (Setup("Turbo ComfyUI nvfp4", model="turbo", quant="nvfp4"), "community: Turbo NVFP4 in about 4.8 GB"),
    (Setup("Turbo GGUF Q4_K, offload 2 buffers", model="turbo", quant="q4_k", offload="layerwise"), ""),
    (Setup("Turbo bf16, batch 4", model="turbo", batch=4), "SGLang's ERNIE article: RTX 4090 24 GB, Batch=4 (Turbo)"),
    (Setup("Turbo fp8, batch 4", model="turbo", quant="fp8", batch=4), ""),
    (Setup("Turbo bf16, served batch of 4 jobs", model="turbo", served=4), ""),
    (Setup("Turbo bf16, served batch of 8 jobs (sgld serve's --max-batch)", model="turbo", served=8), ""),
    (Setup("Base bf16, served 4 jobs (CFG: 8 rows)", served=4), ""),
    (Setup("Base fp8, served 4 jobs (CFG: 8 rows)", quant="fp8", served=4), ""),
    (Setup("Turbo bf16, served 8 jobs on a 24 GB card (admission by bytes)", model="turbo", served=8,
           card_free_gib=24 - 1.5), ""),  # the card less the desktop and the CUDA context (DESKTOP_GIB, CONTEXT_GIB)
    # the second family at its release shape (6.15B parameters, the Flux latent: 4096 image tokens at 1024²)
    (Setup("Z-Image Turbo bf16", family="z-image", model="turbo"),
     "Comfy-Org's z_image_turbo_bf16.safetensors: listed as 11.46 (GiB)"),
    (Setup("Z-Image Turbo fp8", family="z-image", model="turbo", quant="fp8"), ""),
    (Setup("Z-Image Turbo bf16, offload 2 buffers", family="z-image", model="turbo", offload="layerwise"), ""),
]


AUTO_FORMATS = (None, "fp8", "int8", "q4_k")  # offload "auto" by card for these weights (None: bf16)


def fits(peak_bytes: int, card_gb: int) -> bool:
    return peak_bytes / GiB + DESKTOP_GIB + CONTEXT_GIB <= card_gb


def auto_card(card_gb: int, pixels: int = 1024, layers: Optional[int] = None, model: str = "base",
              quant: Optional[str] = None) -> Prediction:
    """``offload="auto"`` on a card of ``card_gb`` (free memory as the loader sees it: desktop and context taken):
    the engine decides at load and again before the run at this image size; the predicted peak of the run (its
    ``notes``: the load's why first, then a switch made for the image, if any)."""
    setup = Setup(f"{model} {quant or 'bf16'}, offload auto", model=model, quant=quant, offload="auto")
    return predict(setup, pixels, layers, card_gb=card_gb - DESKTOP_GIB - CONTEXT_GIB)


def auto_switched(p: Prediction) -> bool:
    """Did the run move the blocks to host memory for its image (offload "auto" at the call)?"""
    return any("switched to layer-wise offload" in n for n in p.notes)


def _row(p: Prediction, published: str) -> str:
    s = p.setup
    marks = " | ".join("yes" if fits(p.peak_bytes, c) else "-" for c in CARDS)
    host = f"{p.pinned_host_bytes / GiB:.1f}" if p.pinned_host_bytes else ""
    return (f"| {s.label} | {p.pixels}² | {p.peak_gib:.2f} | {p.weights_bytes / GiB:.2f} | {marks} | {host} | "
            f"`{p.where}` | {published} |")


def table(layers: Optional[int] = None, rows=ROWS, pixels=PIXELS, log=print) -> str:
    head = ("| configuration | image | predicted peak GiB | weights + buffers GiB | "
            + " | ".join(f"{c} GB" for c in CARDS) + " | pinned host GiB | peak at | published |\n"
            "|---|---|---|---|" + "---|" * len(CARDS) + "---|---|---|")
    lines = [head]
    for setup, published in rows:
        for px in pixels:
            t = time.perf_counter()
            p = predict_cached(setup, px, layers=layers)
            lines.append(_row(p, published if px == 1024 else ""))
            log(f"{setup.label} {px}²: {p.peak_gib:.2f} GiB ({time.perf_counter() - t:.1f} s)")
    lines += ["", "Auto offload (`offload=auto`, Base, CFG batch 2) by card, free memory = card − "
              f"{DESKTOP_GIB:g} GiB desktop − {CONTEXT_GIB:g} GiB CUDA context:", "",
              "| card | weights | image | at load | at the run | predicted peak GiB | fits |",
              "|---|---|---|---|---|---|---|"]
    for quant in AUTO_FORMATS:
        for card in CARDS[:4]:
            for px in pixels:
                p = auto_card(card, px, layers=layers, quant=quant)
                switched = [n for n in p.notes if "switched to layer-wise offload" in n]
                at_run = ("layer-wise offload (" + switched[0].split(": switched")[0].removeprefix("offload auto: ") + ")"
                          if switched else "as loaded")
                lines.append(f"| {card} GB | {quant or 'bf16'} | {px}² | {p.notes[0]} | {at_run} | {p.peak_gib:.2f} | "
                             f"{'yes' if fits(p.peak_bytes, card) else 'NO'} |")
    return "\n".join(lines)


def write_page(text: str, page: str = PAGE) -> None:
    with open(page, encoding="utf-8") as f:
        doc = f.read()
    if START not in doc or END not in doc:
        raise SystemExit(f"{page} has no {START} ... {END} markers")
    before, rest = doc.split(START, 1)
    after = rest.split(END, 1)[1]
    with atomic_write(page) as f:
        f.write(f"{before}{START}\n{text}\n{END}{after}".encode("utf-8"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="DiT blocks (default: each family's release)")
    ap.add_argument("--print", action="store_true", help="print the table, leave the pages alone")
    args = ap.parse_args(argv)
    try:
        text = table(args.layers, log=lambda m: print(m, file=sys.stderr))
    except (Unavailable, RehearsalError) as e:  # what this machine lacks (pages left alone), with the torch build
        import torch

        build = "CUDA" if torch.backends.cuda.is_built() else "CPU-only"
        raise SystemExit(f"table.py cannot run here (torch {torch.__version__}, {build} build): {e}") from e
    if args.print:
        print(text)
        return
    for page in PAGES:
        write_page(text, page)
        print(f"wrote {page}", file=sys.stderr)


if __name__ == "__main__":
    main()
