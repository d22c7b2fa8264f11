"""Offload section of the GPU check: ``bash bench/gpu_check.sh --offload`` (only this section, ~2-3 min
on an H200) or, in the default run, before the compiled row when budget is left (``--skip offload``
leaves it out).

At the 8B shape, 1024x1024, sdpa, weights bf16 and fp8, a forward at batch 1 (= one Turbo step) and at
batch 2 (= one Base step with CFG):
  resident            the whole model on the GPU (the baseline)
  layer-wise, 2 buf   engine/offload.py with the default two layer buffers: s/step, peak VRAM
                      (max allocated, and reserved in the notes), slowdown over resident, GiB moved per
                      forward, host-to-device GB/s, and whether the output is bit-equal to resident
  layer-wise, 8 buf   6 blocks kept resident + 2 streaming (bf16): the trade of VRAM for speed
  Engine run          Engine(offload="layerwise") Base run (cfg 4) with Cache-DiT "fast": s/step, peak,
                      and that the middle blocks were transferred only on the computed calls
Targets (issue 7): peak <= 8 GB with bf16 weights, <= 6 GB with fp8; Base slowdown <= 1.3x on PCIe 4+.
The CUDA context (~0.5 GiB) is not in torch's peak figures.
"""
import time

import torch

from engine import attention as A
from engine import offload as O
from engine import quant as Q
from engine.cache import CacheConfig
from engine.config import EngineConfig
from engine.pipeline import Engine

NAMES = ("off-bf16", "off-bf16-8buf", "off-fp8", "off-engine")


def _reserved(dev) -> str:
    return f"{torch.cuda.max_memory_reserved(dev) / 2 ** 30:.1f}" if dev.type == "cuda" else "–"


def _h2d_gbps(off, dev, n=5) -> str:
    """Host-to-device bandwidth of one block's master buffer into a layer buffer (copy stream)."""
    if dev.type != "cuda":
        return "n/a on CPU"
    st = off.stores[-1]
    buf = torch.empty(st.nbytes, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    s = time.perf_counter()
    for _ in range(n):
        buf.copy_(st.master, non_blocking=True)
    torch.cuda.synchronize(dev)
    sec = (time.perf_counter() - s) / n
    del buf
    return f"H2D {st.nbytes / sec / 1e9:.1f} GB/s ({'pinned' if off.pin else 'pageable'})"


def run_offload_section(G, args, dev, cfg, dtype, state):
    """``G``: the gpu_check module (row, guarded, time_forward, ...); rows go into its table."""
    if "offload" in args.skip:
        return
    inp = {1: G.inputs(cfg, args, dev, dtype, 1), 2: G.inputs(cfg, args, dev, dtype, 2, seed=1)}
    steps = {1: "Turbo step (batch 1)", 2: "Base step (CFG, batch 2)"}

    def bf16_model():
        m = state.get("model")
        if m is None or state.get("fmt") is not None or getattr(m, "_sgld_compile", None) or O.get_offload(m):
            state.pop("model", None)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            m = state["model"] = G.random_model(cfg, dev, dtype)
            state["fmt"] = None
        m.attention = A.sdpa
        return m

    def resident(m, weights, key):
        for b in (1, 2):
            s, first, pk, fin = G.time_forward(m, inp[b], dev, args.repeat)
            state[f"{key}_s{b}"], state[f"{key}_out{b}"] = s, G.time_forward.last
            G.row(f"resident, {steps[b]}", "sdpa", weights, s, pk,
                  f"reserved {_reserved(dev)} GiB" + ("" if fin else "; NON-FINITE output"))

    def offloaded(m, weights, key, buffers, label):
        s0 = time.perf_counter()
        off = O.apply_layerwise_offload(m, dev, buffers)
        G.sync(dev)
        apply_s = time.perf_counter() - s0
        bw = _h2d_gbps(off, dev)
        for b in (1, 2):
            off.reset_stats()
            s, first, pk, fin = G.time_forward(m, inp[b], dev, args.repeat)
            per_fwd = off.bytes_transferred / max(1, args.repeat + 1) / 2 ** 30
            ref = state.get(f"{key}_out{b}")
            out = G.time_forward.last
            same = "n/a" if ref is None else ("bit-equal" if torch.equal(out, ref) else
                                              f"rel. error {((out - ref).norm() / ref.norm()).item():.1e}")
            base = state.get(f"{key}_s{b}")
            slow = f"{s / base:.2f}x of resident" if base else "no resident baseline"
            G.row(f"offload {label}, {steps[b]}", "sdpa", weights, s, pk,
                  f"{slow}; {same} vs resident; reserved {_reserved(dev)} GiB; {per_fwd:.2f} GiB moved per forward; "
                  f"stalls {off.stalls}; {bw}; apply {apply_s:.1f} s ({off.block_bytes() / 2 ** 30:.1f} GiB of blocks "
                  f"in {'pinned' if off.pin else 'pageable'} memory, {off.fixed} kept resident)" + ("" if fin else "; NON-FINITE output"))
        return off

    def bf16_rows():
        m = bf16_model()
        resident(m, "bf16", "bf16")
        state["off"] = offloaded(m, "bf16", "bf16", 2, "layer-wise, 2 buffers")

    def bf16_8buf():
        m = state["model"]
        off = state.pop("off", None) or O.get_offload(m)
        if off is not None:
            off.remove()
        state["off"] = offloaded(m, "bf16", "bf16", 8, "layer-wise, 8 buffers (6 kept)")

    def fp8_rows():
        state.pop("off", None)
        state.pop("model", None)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        m = G.random_model(cfg, dev, dtype)
        Q.quantize_model(m, "fp8")
        notes = Q.prepare_fast_paths(m)
        state["model"], state["fmt"] = m, "fp8"
        m.attention = A.sdpa
        w = f"fp8 ({G.gib(Q.weight_bytes(m))} GiB)"
        resident(m, w, "fp8")
        off = offloaded(m, w, "fp8", 2, "layer-wise, 2 buffers")
        off.remove()
        G.row("fp8 matmul", "–", "fp8", None, "–", notes[0] if notes else "dequantize path")

    def engine_run():
        m = state["model"]  # the fp8 model, blocks back in CPU memory (offload removed)
        if O.get_offload(m) is not None:
            O.get_offload(m).remove()
        eng = Engine(m, EngineConfig(device=str(dev), attention="sdpa", offload="layerwise"))
        g = torch.Generator().manual_seed(1)
        cond = [torch.randn(args.text_tokens, cfg.text_in_dim, generator=g)]
        uncond = [torch.randn(max(1, args.text_tokens // 4), cfg.text_in_dim, generator=g)]
        lat = torch.zeros(1, cfg.in_channels, args.height // 16, args.width // 16)
        steps_n = 10
        G.peak_reset(dev)
        eng.offload.reset_stats()
        s = time.perf_counter()
        out = eng.sample(lat, cond, uncond, seed=0, steps=steps_n, cfg=4.0, cache=CacheConfig(preset="fast"))
        G.sync(dev)
        total = time.perf_counter() - s
        mask = eng.last_run.step_mask
        rec = list(eng.offload.record)
        mid = range(1, len(m.layers) - 1)
        only_computed = all(rec.count(k) == sum(mask) for k in mid)
        G.row(f"Engine Base run, fp8 + offload + Cache-DiT fast ({steps_n} steps, cfg 4)", eng.attention_backend,
              "fp8", total / steps_n, G.peak(dev),
              f"total {total:.1f} s; computed {sum(mask)}/{len(mask)} calls; {eng.offload.transfers} block transfers; "
              f"middle blocks moved only on computed calls: {'yes' if only_computed else 'NO'}; reserved {_reserved(dev)} GiB"
              + ("" if bool(torch.isfinite(out).all()) else "; NON-FINITE output"))
        eng.offload.remove()

    G.guarded("off-bf16", args, 40, bf16_rows)
    if state.get("off") is not None:
        G.guarded("off-bf16-8buf", args, 25, bf16_8buf)
    G.guarded("off-fp8", args, 40, fp8_rows)
    if state.get("fmt") == "fp8":
        G.guarded("off-engine", args, 30, engine_run)
