"""Communication bytes per sampling step of each parallel mode, computed from the 8B shape.

    python bench/speed/parallel_comm.py [--text-tokens 256] [--dtype-bytes 2] [--no-cfg]

One step = one model call of the CFG batch (cond + uncond = 2 samples, as ``Engine.sample``
batches them), 36 blocks, hidden 4096, 32 heads, MLP 12288, activations in bf16. Tokens:
image (H/16 x W/16, patch 1) + text (default 256). Bytes are what one GPU *sends* per step with
the usual bandwidth-optimal algorithms (ring all-gather / all-reduce, all-to-all), and the sum
over all GPUs:

  Ulysses P   per block: all-to-all of q, k, v and of the output, each (P-1)/P of the rank's
              [B, S/P, hidden] slice; then one all-gather of the hidden states [B, S, hidden].
  Ring P      per block: the K/V block [2, B, S/P, hidden] is sent on P-1 times; then the all-gather.
  USP U x R   Ulysses inside groups of U, Ring across R groups on the 1/U heads; then the all-gather.
  TP P        per block: two all-reduces of [B, S, hidden] (attention out, MLP out), 2 (P-1)/P each.
  CFG 2       cond and uncond on different ranks: one all-gather of the output latent; combined
              with Ulysses over the remaining GPUs (each CFG rank group then runs B = 1).

Not counted: the rank-0 command broadcast of the latent (host, fp32, a few MB), Cache-DiT's
8-byte decision all-reduce per call, and the steps Cache-DiT skips (which skip their
communication too). Times: per-GPU bytes / link bandwidth, as a lower bound with no overlap.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

LAYERS, HIDDEN, HEADS, FFN, OUT_CH = 36, 4096, 32, 12288, 128
LINKS = {"NVLink 4 (450 GB/s)": 450e9, "PCIe 5 x16 (~50 GB/s)": 50e9}


@dataclass
class Mode:
    name: str
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.ulysses * self.ring * self.cfg


def per_gpu_bytes(m: Mode, image_tokens: int, text_tokens: int, batch: int = 2, eb: int = 2) -> float:
    """Bytes one GPU sends per step (one model call of ``batch`` samples)."""
    b = batch // m.cfg if m.cfg > 1 else batch
    S = image_tokens + text_tokens
    sp = m.ulysses * m.ring
    total = 0.0
    if sp > 1:
        local = b * (S / sp) * HIDDEN * eb / m.tp  # this rank's q (or k, v, out) slice; TP-local heads
        if m.ulysses > 1:
            total += LAYERS * 4 * local * (m.ulysses - 1) / m.ulysses
        if m.ring > 1:
            # after the all-to-all a rank holds its ring block (S/R tokens) on 1/(tp*U) of the heads
            kv = 2 * b * (S / m.ring) * (HIDDEN / m.tp / m.ulysses) * eb
            total += LAYERS * kv * (m.ring - 1)
        total += b * S * HIDDEN * eb * (sp - 1) / sp  # all-gather of the hidden states before unembed
    if m.tp > 1:
        tokens = S / sp
        total += LAYERS * 2 * (2 * (m.tp - 1) / m.tp) * b * tokens * HIDDEN * eb
    if m.cfg > 1:
        total += b * image_tokens * OUT_CH * eb * (m.cfg - 1)  # all-gather of the output latent
    return total


def modes_for(gpus: int, cfg_on: bool):
    ms = [Mode(f"Ulysses {gpus}", ulysses=gpus) if HEADS % gpus == 0 else None,
          Mode(f"Ring {gpus}", ring=gpus)]
    if gpus >= 4:
        u = gpus // 2
        ms.append(Mode(f"USP {u}x2", ulysses=u, ring=2))
        if gpus // 2 != 2:
            ms.append(Mode(f"USP 2x{gpus // 2}", ulysses=2, ring=gpus // 2))
    ms.append(Mode(f"TP {gpus}", tp=gpus))
    if cfg_on:
        ms.append(Mode("CFG 2" if gpus == 2 else f"CFG 2 x Ulysses {gpus // 2}", cfg=2, ulysses=gpus // 2))
    return [m for m in ms if m is not None]


def fmt(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def table(text_tokens: int = 256, eb: int = 2, cfg_on: bool = True) -> str:
    rows = ["| resolution | tokens (img+txt) | GPUs | mode | per GPU / step | all GPUs / step | "
            + " | ".join(f"time @ {k}" for k in LINKS) + " |",
            "|---|---|---|---|---|---|" + "---|" * len(LINKS)]
    for px in (1024, 2048):
        img = (px // 16) ** 2
        for gpus in (2, 4, 8):
            for m in modes_for(gpus, cfg_on):
                per = per_gpu_bytes(m, img, text_tokens, 2 if cfg_on else 1, eb)
                times = " | ".join(f"{1000 * per / bw:.2f} ms" for bw in LINKS.values())
                rows.append(f"| {px}² | {img}+{text_tokens} | {gpus} | {m.name} | {fmt(per)} | {fmt(per * m.gpus)} | {times} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--dtype-bytes", type=int, default=2, help="activation bytes per element (bf16: 2)")
    p.add_argument("--no-cfg", action="store_true", help="guidance-distilled run (Turbo): batch 1, no CFG mode")
    a = p.parse_args(argv)
    batch = "1 sample (no CFG)" if a.no_cfg else "2 samples (cond + uncond)"
    print(f"Communication per sampling step, ERNIE-Image 8B ({LAYERS} blocks, hidden {HIDDEN}), batch of {batch}, "
          f"{a.dtype_bytes}-byte activations, {a.text_tokens} text tokens.\n")
    print(table(a.text_tokens, a.dtype_bytes, not a.no_cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
