"""Offload rows of the GPU check (bench/gpu_check.py; ``bash bench/gpu_check.sh --offload`` runs only these).

At the 8B shape, 1024x1024, sdpa, a forward at batch 1 (= one Turbo step) and at batch 2 (= one Base
step with CFG), weights bf16 and fp8:
  off-bf16       resident (the whole model on the GPU, the baseline), then engine/features/offload/ with 2
                 layer buffers: s/step, peak VRAM, slowdown, bit-equality vs resident, GiB moved per
                 forward, host-to-device GB/s (~20 s)
  off-bf16-8buf  8 buffers (6 blocks kept resident + 2 streaming): VRAM traded for speed (~12 s)
  off-fp8        the same with fp8 weights, 2 buffers (~15 s)
  off-engine     Engine(offload="layerwise") Base run (cfg 4) with fp8 and Cache-DiT "fast": s/step, peak,
                 and that the middle blocks moved only on the computed calls (~10 s)
Targets (issue 7): peak <= 8 GB with bf16 weights, <= 6 GB with fp8; Base slowdown <= 1.3x on PCIe 4+.
Between rows everything is freed (the offloader's ``remove()``, the model, ``gc.collect()``, the CUDA
cache and the pinned host cache) and each row reports what was still allocated when it started, so a
leak would show there instead of inflating the peak. The CUDA context (~0.5 GiB) is in no torch figure.
"""
import time

import torch

from engine.features import offload as O
from engine.features.cache import CacheConfig
from engine.config import EngineConfig
from engine.engine import Engine

STEPS = {1: "Turbo step (batch 1)", 2: "Base step (CFG, batch 2)"}


def _reserved(ctx) -> str:
    return f"{torch.cuda.max_memory_reserved(ctx.dev) / 2 ** 30:.1f}" if ctx.dev.type == "cuda" else "–"


def _h2d_gbps(off, ctx, n=5) -> str:
    """Host-to-device bandwidth of one block's master buffer into a device buffer (copy stream)."""
    if ctx.dev.type != "cuda":
        return "H2D n/a on CPU"
    st = off.stores[-1]
    buf = torch.empty(st.nbytes, dtype=torch.uint8, device=ctx.dev)
    torch.cuda.synchronize(ctx.dev)
    s = time.perf_counter()
    for _ in range(n):
        buf.copy_(st.master, non_blocking=True)
    torch.cuda.synchronize(ctx.dev)
    sec = (time.perf_counter() - s) / n
    del buf
    return f"H2D {st.nbytes / sec / 1e9:.1f} GB/s ({'pinned' if off.pin else 'pageable'})"


def offload_rows(G, ctx):
    """(name, need seconds, fn(ctx)) for the plan of bench/gpu_check.py; ``G`` is that module."""
    inp = {}

    def batch_inputs(b):
        if b not in inp:
            inp[b] = G.inputs(ctx, b, seed=b)
        return inp[b]

    def resident(ctx, m, weights, key, name):
        for b in (1, 2):
            start = ctx.start_window()
            s, first, fin = G.time_forward(ctx, m, batch_inputs(b))
            ctx.state[f"{key}_s{b}"], ctx.state[f"{key}_out{b}"] = s, G.time_forward.last
            ctx.report.row(name, "measured", f"resident, {STEPS[b]}, {weights}", s, None, ctx.peak(), start,
                           f"reserved {_reserved(ctx)} GiB{G.finite_note(fin)}")

    def offloaded(ctx, m, weights, key, buffers, name):
        start_apply = ctx.allocated()
        s0 = time.perf_counter()
        off = ctx.state["off"] = O.apply_layerwise_offload(m, ctx.dev, buffers)
        ctx.sync()
        apply_s = time.perf_counter() - s0
        bw = _h2d_gbps(off, ctx)
        for b in (1, 2):
            off.reset_stats()
            start = ctx.start_window()
            s, first, fin = G.time_forward(ctx, m, batch_inputs(b))
            per_fwd = off.bytes_transferred / max(1, ctx.args.repeat + 1) / 2 ** 30
            ref, out = ctx.state.get(f"{key}_out{b}"), G.time_forward.last
            same = "n/a" if ref is None else ("bit-equal" if torch.equal(out, ref) else f"rel. error {G.rel_err(out, ref):.1e}")
            base = ctx.state.get(f"{key}_s{b}")
            ctx.report.row(name, "measured", f"offload, {buffers} buffers ({off.fixed} kept), {STEPS[b]}, {weights}", s, None,
                           ctx.peak(), start,
                           f"{f'{s / base:.2f}x of resident' if base else 'no resident baseline'}; {same} vs resident; "
                           f"reserved {_reserved(ctx)} GiB; {per_fwd:.2f} GiB moved per forward; stalls {off.stalls}; {bw}; "
                           f"apply {apply_s:.1f} s from {G._cell(start_apply, 1)} GiB allocated ({off.block_bytes() / 2 ** 30:.1f} "
                           f"GiB of blocks in {'pinned' if off.pin else 'pageable'} memory){G.finite_note(fin)}")
        return off

    def bf16_rows(ctx):
        ctx.release()
        m = ctx.model()
        resident(ctx, m, "bf16", "bf16", "off-bf16")
        offloaded(ctx, m, "bf16", "bf16", 2, "off-bf16")

    def bf16_8buf(ctx):
        m = ctx.state.get("model")
        off = ctx.state.pop("off", None)
        if m is None or off is None or ctx.state.get("fmt") is not None:
            ctx.report.row("off-bf16-8buf", "skipped", notes="needs the off-bf16 row's model")
            return
        off.remove()  # blocks back to their CPU masters; the 8-buffer offloader starts from there
        del off
        G.gc.collect()
        if ctx.dev.type == "cuda":
            torch.cuda.empty_cache()
        offloaded(ctx, m, "bf16", "bf16", 8, "off-bf16-8buf")

    def fp8_rows(ctx):
        m = ctx.model("fp8")
        w = f"fp8 ({G.Q.weight_bytes(m) / 2 ** 30:.1f} GiB)"
        resident(ctx, m, w, "fp8", "off-fp8")
        offloaded(ctx, m, w, "fp8", 2, "off-fp8")

    def engine_run(ctx):
        m = ctx.state.get("model")
        if m is None or ctx.state.get("fmt") != "fp8":
            m = ctx.model("fp8")
        if O.get_offload(m) is not None:
            O.get_offload(m).remove()
        ctx.state.pop("off", None)
        G.gc.collect()
        start = ctx.start_window()
        eng = Engine(m, EngineConfig(device=str(ctx.dev), attention="sdpa", offload="layerwise"))
        g = torch.Generator().manual_seed(1)
        cond = [torch.randn(ctx.args.text_tokens, ctx.cfg.text_in_dim, generator=g)]
        uncond = [torch.randn(max(1, ctx.args.text_tokens // 4), ctx.cfg.text_in_dim, generator=g)]
        lat = torch.zeros(1, ctx.cfg.in_channels, ctx.args.height // 16, ctx.args.width // 16)
        steps = 10
        eng.offload.reset_stats()
        s = time.perf_counter()
        out = eng.sample(lat, cond, uncond, seed=0, steps=steps, cfg=4.0, cache=CacheConfig(preset="fast"))
        ctx.sync()
        total = time.perf_counter() - s
        mask = eng.last_run.step_mask
        rec = list(eng.offload.record)
        only_computed = all(rec.count(k) == sum(mask) for k in range(1, len(m.layers) - 1))
        ctx.report.row("off-engine", "measured", f"Engine Base run, fp8 + offload + Cache-DiT fast ({steps} steps, cfg 4)",
                       total / steps, total, ctx.peak(), start,
                       f"computed {sum(mask)}/{len(mask)} calls; {eng.offload.transfers} block transfers; middle blocks "
                       f"moved only on computed calls: {'yes' if only_computed else 'NO'}; reserved {_reserved(ctx)} GiB"
                       f"{G.finite_note(bool(torch.isfinite(out).all()))}")
        ctx.state["off"] = eng.offload
        del eng
        ctx.release()

    # budget: copies at ~20 GB/s host to device, pinning at ~5 GB/s (leads, not readings)
    f, c = ctx.forward_estimate, ctx.args.repeat + 1
    blocks = 2 * sum(p.numel() for n, p in G.build_model_meta(ctx.cfg).named_parameters() if n.startswith("layers."))
    xfer, pin = (blocks / 20e9, blocks / 5e9) if ctx.dev.type == "cuda" else (0.01, 0.1)
    return [("off-bf16", lambda: 3 + pin + c * (f(1) + f(2)) + 2 * c * max(xfer, f(2)), bf16_rows),
            ("off-bf16-8buf", lambda: pin + 2 * c * max(xfer * 0.85, f(2)), bf16_8buf),
            ("off-fp8", lambda: 5 + pin / 2 + c * (f(1) + f(2)) + 2 * c * max(xfer / 2, f(2)), fp8_rows),
            ("off-engine", lambda: pin / 2 + 10 * max(xfer / 2, f(2)), engine_run)]
