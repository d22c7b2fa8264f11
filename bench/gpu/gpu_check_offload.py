"""Offload rows of the GPU check (bench/gpu/gpu_check.py; ``bash bench/gpu_check.sh --offload`` runs only these).

At the 8B shape, 1024x1024, sdpa, a forward at batch 1 (= one Turbo step) and at batch 2 (= one Base
step with CFG), weights bf16 and fp8, every ratio against a resident model timed in this process:
  off-bf16       first a test of the pinned memory the offloader will ask for (one allocation per block,
                 36 x ~436 MB at 8B: time, GB/s, or the error; a failure falls back to pageable memory), then
                 resident (the baseline), then engine/features/offload/ with 2 layer buffers: s/step, peak
                 VRAM, slowdown, bit-equality vs resident, GiB moved per forward, host-to-device GB/s, and
                 ``remove()``'s copy of the blocks back into pageable memory, timed (~25 s)
  off-bf16-8buf  8 buffers (6 blocks kept resident + 2 streaming): VRAM traded for speed (~12 s)
  off-fp8        the same with fp8 weights, 2 buffers (~15 s)
  off-engine     an Engine Base run (cfg 4) with fp8 and Cache-DiT "fast", resident, then with
                 offload="layerwise": s/step of both, **the slowdown against the target <= 1.3x**, peak, and
                 that the middle blocks moved only on the computed calls (~10 s)
Targets (issue 7): peak <= 8 GB with bf16 weights, <= 6 GB with fp8; Base slowdown <= 1.3x on PCIe 4+.
Between rows everything is freed (the offloader's ``remove()``, the model, ``gc.collect()``, the CUDA
cache and the pinned host cache) and each row reports what was still allocated when it started, so a
leak would show there instead of inflating the peak. The CUDA context (~0.5 GiB) is in no torch figure.
"""
import gc
import time

import torch
from gpu_check_core import _cell, build_model_meta, finite_note, inputs, time_forward
from gpu_check_rows import sample

from bench.metrics import rel_err
from engine.config import EngineConfig
from engine.engine import Engine
from engine.features import offload as O
from engine.features import quant as Q
from engine.features.cache import masks

OFFLOAD_ROWS = ("off-bf16", "off-bf16-8buf", "off-fp8", "off-engine")
STEPS = {1: "Turbo step (batch 1)", 2: "Base step (CFG, batch 2)"}
ENGINE_STEPS = 10


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


def pinned_test(ctx, m):
    """Allocate what the offloader will pin (one buffer per block, its bytes) before relying on it: (ok, note)."""
    sizes = [sum(t.numel() * t.element_size() for t in list(b.parameters()) + list(b.buffers())) for b in m.layers]
    if ctx.dev.type != "cuda":
        return False, f"no pinned memory on CPU ({len(sizes)} x {max(sizes) / 2 ** 20:.0f} MiB would be pinned on a GPU)"
    bufs = []
    s = time.perf_counter()
    try:
        for n in sizes:
            bufs.append(torch.empty(n, dtype=torch.uint8, pin_memory=True))
        ok, why = True, ""
    except RuntimeError as e:
        ok, why = False, f": FAILED at allocation {len(bufs) + 1} ({str(e).splitlines()[0][:120]}); offload runs pageable"
    sec = time.perf_counter() - s
    got = sum(b.numel() for b in bufs)
    bufs.clear()
    gc.collect()
    O.empty_host_cache()
    return ok, (f"pinned test: {len(sizes)} x {max(sizes) / 1e6:.0f} MB, {got / 1e9:.1f} GB in {sec:.1f} s "
                f"({got / max(sec, 1e-9) / 1e9:.1f} GB/s){why}")


def offload_rows(ctx):
    """(name, need seconds, fn(ctx)) for the plan of bench/gpu/gpu_check.py."""
    inp = {}

    def batch_inputs(b):
        if b not in inp:
            inp[b] = inputs(ctx, b, seed=b)
        return inp[b]

    def resident(ctx, m, weights, key, name):
        for b in (1, 2):
            start = ctx.start_window()
            s, first, fin = time_forward(ctx, m, batch_inputs(b))
            ctx.state[f"{key}_s{b}"], ctx.state[f"{key}_out{b}"] = s, time_forward.last
            ctx.report.row(name, "measured", f"resident, {STEPS[b]}, {weights}", s, None, ctx.peak(), start,
                           f"reserved {_reserved(ctx)} GiB{finite_note(fin)}")

    def offloaded(ctx, m, weights, key, buffers, name, pin=None, pin_note=""):
        start_apply = ctx.allocated()
        s0 = time.perf_counter()
        off = ctx.state["off"] = O.apply_layerwise_offload(m, ctx.dev, buffers, pin=pin)
        ctx.sync()
        apply_s = time.perf_counter() - s0
        bw = _h2d_gbps(off, ctx)
        for b in (1, 2):
            off.reset_stats()
            start = ctx.start_window()
            s, first, fin = time_forward(ctx, m, batch_inputs(b))
            per_fwd = off.bytes_transferred / max(1, ctx.args.repeat + 1) / 2 ** 30
            ref, out = ctx.state.get(f"{key}_out{b}"), time_forward.last
            same = "n/a" if ref is None else ("bit-equal" if torch.equal(out, ref) else f"rel. error {rel_err(out, ref):.1e}")
            base = ctx.state.get(f"{key}_s{b}")
            ctx.report.row(name, "measured", f"offload, {buffers} buffers ({off.fixed} kept), {STEPS[b]}, {weights}", s, None,
                           ctx.peak(), start,
                           f"{f'**{s / base:.2f}x of resident**' if base else 'no resident baseline'}; {same} vs resident; "
                           f"reserved {_reserved(ctx)} GiB; {per_fwd:.2f} GiB moved per forward; stalls {off.stalls}; {bw}; "
                           f"apply {apply_s:.1f} s from {_cell(start_apply, 1)} GiB allocated ({off.block_bytes() / 2 ** 30:.1f} "
                           f"GiB of blocks in {'pinned' if off.pin else 'pageable'} memory){pin_note if b == 1 else ''}"
                           f"{finite_note(fin)}", slowdown=None if not base else round(s / base, 3))
        return off

    def remove_timed(ctx, off) -> str:
        s = time.perf_counter()
        off.remove()  # the blocks copied back into pageable CPU memory, one at a time
        ctx.sync()
        return f"remove() {time.perf_counter() - s:.1f} s ({off_bytes[0] / 1e9:.1f} GB back into pageable memory)"

    def bf16_rows(ctx):
        m = ctx.model()
        pin_ok, pin_note = pinned_test(ctx, m)
        resident(ctx, m, "bf16", "bf16", "off-bf16")
        off = offloaded(ctx, m, "bf16", "bf16", 2, "off-bf16", pin=None if pin_ok else False, pin_note="; " + pin_note)
        ctx.state["pin_ok"] = pin_ok
        off_bytes[0] = off.block_bytes()

    def bf16_8buf(ctx):
        m = ctx.state.get("model")
        off = ctx.state.pop("off", None)
        if m is None or off is None or ctx.state.get("fmt") is not None:
            ctx.report.row("off-bf16-8buf", "skipped", notes="needs the off-bf16 row's model")
            return
        note = remove_timed(ctx, off)  # blocks back to pageable CPU tensors; the 8-buffer offloader starts from there
        del off
        gc.collect()
        if ctx.dev.type == "cuda":
            torch.cuda.empty_cache()
        offloaded(ctx, m, "bf16", "bf16", 8, "off-bf16-8buf", pin=None if ctx.state.get("pin_ok", True) else False,
                  pin_note=f"; the 2-buffer offloader's {note}")

    def fp8_rows(ctx):
        m = ctx.model("fp8")
        w = f"fp8 ({Q.weight_bytes(m) / 2 ** 30:.1f} GiB)"
        resident(ctx, m, w, "fp8", "off-fp8")
        offloaded(ctx, m, w, "fp8", 2, "off-fp8", pin=None if ctx.state.get("pin_ok", True) else False)

    def engine_run(ctx):
        m = ctx.state.get("model")
        if m is None or ctx.state.get("fmt") != "fp8":
            m = ctx.model("fp8")
        if O.get_offload(m) is not None:
            O.get_offload(m).remove()
        ctx.state.pop("off", None)
        gc.collect()
        runs = {}
        for mode in ("none", "layerwise"):  # resident first: the baseline of the slowdown, in this process
            start = ctx.start_window()
            eng = Engine(m, EngineConfig(device=str(ctx.dev), attention="sdpa", offload=mode))
            if mode == "layerwise":
                eng.offload.reset_stats()
            total, out = sample(ctx, eng, ENGINE_STEPS, 4.0, "fast")
            runs[mode] = (total, out, eng.last_run.step_mask, ctx.peak(), start)
            if mode == "layerwise":
                offl = eng.offload
            del eng
        total, out, mask, peak, start = runs["layerwise"]
        rec = list(offl.record)
        only_computed = all(rec.count(k) == sum(mask) for k in range(1, len(m.layers) - 1))
        res = runs["none"][0]
        same = "bit-equal" if torch.equal(out, runs["none"][1]) else f"rel. error {rel_err(out, runs['none'][1]):.1e}"
        ctx.report.row("off-engine", "measured", f"Engine Base run, fp8 + Cache-DiT fast ({ENGINE_STEPS} steps, cfg 4), resident",
                       res / ENGINE_STEPS, res, runs["none"][3], runs["none"][4], "the baseline of the slowdown below")
        ctx.report.row("off-engine", "measured", f"Engine Base run, fp8 + offload + Cache-DiT fast ({ENGINE_STEPS} steps, cfg 4)",
                       total / ENGINE_STEPS, total, peak, start,
                       f"**{total / res:.2f}x of resident** (target <= 1.3x); {same} vs resident; computed {sum(mask)}/"
                       f"{len(mask)} calls; {offl.transfers} block transfers; middle blocks moved only on computed calls: "
                       f"{'yes' if only_computed else 'NO'}; reserved {_reserved(ctx)} GiB"
                       f"{finite_note(bool(torch.isfinite(out).all()))}", slowdown=round(total / res, 3))
        ctx.state["off"] = offl
        ctx.release()

    # budget: copies at ~20 GB/s host to device, pinning at ~5 GB/s, remove() into pageable memory at ~5 GB/s
    # (leads, not readings)
    f, c = ctx.forward_estimate, ctx.args.repeat + 1
    blocks = 2 * sum(p.numel() for n, p in build_model_meta(ctx.cfg).named_parameters() if n.startswith("layers."))
    off_bytes = [blocks]
    xfer, pin = (blocks / 20e9, blocks / 5e9) if ctx.dev.type == "cuda" else (0.01, 0.1)
    back = pin
    calls = sum(masks.preset_mask("fast", ENGINE_STEPS))
    return [("off-bf16", lambda: 3 + 2 * pin + c * (f(1) + f(2)) + 2 * c * max(xfer, f(2)), bf16_rows),
            ("off-bf16-8buf", lambda: back + pin + 2 * c * max(xfer * 0.85, f(2)), bf16_8buf),
            ("off-fp8", lambda: 5 + back + pin / 2 + c * (f(1) + f(2)) + 2 * c * max(xfer / 2, f(2)), fp8_rows),
            ("off-engine", lambda: back / 2 + pin / 2 + 1.3 * calls * (f(2) + max(xfer / 2, f(2))) + 4, engine_run)]
