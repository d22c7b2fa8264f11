"""The GPU check's rows that run in its own process (bench/gpu/gpu_check.py lists them in running order): the
model, our forward against diffusers, Turbo / Base images with and without Cache-DiT, and FP8 / INT4 / INT8 /
GGUF Q4_K engines opened from a file the way users open them."""
import time

import torch
from gpu_check_core import (
    _count,
    _round,
    build,
    err_note,
    finite_note,
    inputs,
    interleaved,
    limit_note,
    speed_note,
    time_forward,
)
from safetensors.torch import save_file

from bench.metrics import max_rel_err, psnr, rel_err
from engine.config import EngineConfig
from engine.engine import Engine
from engine.features import quant as Q
from engine.features.cache import USER_PRESETS, CacheConfig
from engine.features.fuse import fuse_projections
from engine.features.quant.gguf.linear import GGUFLinear
from engine.features.quant.gguf.numerics import NAMES as GGUF_NAMES
from engine.router import open_engine
from engine.sampling import MULTIPLIER, sigma_schedule


def row_build(ctx):
    ctx.release()
    start = ctx.start_window()
    s = time.perf_counter()
    ctx.state["model"] = build(ctx.cfg, ctx.dev, ctx.dtype)
    ctx.state["fmt"] = None
    ctx.sync()
    n = sum(p.numel() for p in ctx.state["model"].parameters())
    ctx.report.row("build", "measured", f"random {ctx.args.size} model, bf16, on {ctx.dev}", peak=ctx.peak(),
                   start=start, notes=f"{time.perf_counter() - s:.1f} s, {_count(n)} parameters, built on meta and "
                                       f"materialized once in bf16 on {ctx.dev.type} (no fp32 or CPU copy)")


def row_eager(ctx):
    m = ctx.model()
    inp = ctx.state["inp1"] = inputs(ctx)
    start = ctx.start_window()
    s, first, ok = time_forward(ctx, m, inp)
    ctx.state["eager_s"], ctx.state["eager_out"] = s, time_forward.last
    tensors = {f"input.{i}": t.detach().cpu().contiguous() for i, t in enumerate(inp)}
    tensors["out"] = time_forward.last.detach().cpu().contiguous()
    save_file(tensors, ctx.args.ref, metadata={"eager_s": repr(s)})  # safetensors: the workers read no pickle
    ctx.report.row("eager", "measured", "DiT forward, ours, bf16 sdpa (batch 1 = one Turbo step)", s, None,
                   ctx.peak(), start, f"first call {first:.2f} s; {limit_note(ctx, s)}{finite_note(ok)}")


# -- diffusers side by side ---------------------------------------------------------------------------------------
def diffusers_model(cfg, ours):
    """diffusers' model on our weights: built on the meta device, then our tensors assigned (no copy)."""
    from diffusers import ErnieImageTransformer2DModel

    with torch.device("meta"):
        ref = ErnieImageTransformer2DModel(
            hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, num_layers=cfg.num_layers,
            ffn_hidden_size=cfg.ffn_hidden_size, in_channels=cfg.in_channels, out_channels=cfg.out_channels,
            patch_size=cfg.patch_size, text_in_dim=cfg.text_in_dim, rope_axes_dim=tuple(cfg.rope_axes_dim),
            rope_theta=int(cfg.rope_theta), eps=cfg.eps)
    ref.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return ref.eval().requires_grad_(False)


def set_diffusers_mask(ref, keep: bool) -> None:
    """diffusers always builds a boolean key mask, which sends SDPA from its flash kernel to the memory-efficient
    one. ``keep=False``: each layer's processor drops it (only for unpadded batch-1 inputs, where it is all True),
    so diffusers runs the kernel ours runs; ``keep=True``: diffusers as shipped."""
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageSingleStreamAttnProcessor

    class NoMask(ErnieImageSingleStreamAttnProcessor):
        def __call__(self, attn, hidden_states, attention_mask=None, freqs_cis=None):
            return super().__call__(attn, hidden_states, None, freqs_cis)

    proc = ErnieImageSingleStreamAttnProcessor() if keep else NoMask()
    for layer in ref.layers:
        layer.self_attention.processor = proc


def _diffusers_pair(ctx):
    import diffusers

    ours = ctx.model()
    ref = diffusers_model(ctx.cfg, ours)
    storages = lambda m: {p.untyped_storage().data_ptr() for p in m.parameters()}  # noqa: E731 (fused parts: views)
    return diffusers.__version__, ours, ref, storages(ours) >= storages(ref)


def row_diffusers(ctx):
    """Three forwards interleaved: ours, diffusers as shipped (masked SDPA), diffusers without the mask (the
    SDPA kernel ours runs at batch 1): the last ratio is what the engine's own work is worth."""
    version, ours, ref, shared = _diffusers_pair(ctx)
    inp = ctx.state["inp1"]
    assert int(inp[0].shape[0]) == 1 and bool((inp[3] == inp[2].shape[1]).all())  # unpadded batch 1: the mask is all True

    def masked():
        set_diffusers_mask(ref, keep=True)
        return ref(*inp, return_dict=False)[0]

    def unmasked():
        set_diffusers_mask(ref, keep=False)
        return ref(*inp, return_dict=False)[0]

    start = ctx.start_window()
    times, outs = interleaved(ctx, {"ours": lambda: ours(*inp), "diffusers": masked, "diffusers-nomask": unmasked})
    set_diffusers_mask(ref, keep=True)
    a = outs["ours"].float()
    par = {k: max_rel_err(a, outs[k]) for k in ("diffusers", "diffusers-nomask")}
    so, sd, sn = times["ours"], times["diffusers"], times["diffusers-nomask"]
    ref = outs = None
    peak = ctx.peak()
    ctx.report.row("diffusers", "measured", f"DiT forward, diffusers {version} as shipped (boolean mask: SDPA's masked kernel)",
                   sd, None, peak, start, f"{limit_note(ctx, sd)}; same weights ({'shared storage' if shared else 'COPIED'}) "
                   f"and inputs; max abs(ours - diffusers) / max abs(diffusers) {par['diffusers']:.1e}",
                   ours_s=_round(so), diffusers_s=_round(sd), ratio=_round(so / sd), parity=par["diffusers"])
    ctx.report.row("diffusers", "measured", f"DiT forward, diffusers {version} with ours' attention kernel (no mask at batch 1)",
                   sn, None, peak, start, f"{limit_note(ctx, sn)}; parity {par['diffusers-nomask']:.1e}",
                   diffusers_nomask_s=_round(sn), ratio_same_kernel=_round(so / sn), parity=par["diffusers-nomask"])
    ctx.report.row("diffusers", "measured", "DiT forward, ours, interleaved with both", so, None, peak, start,
                   f"**ours / diffusers {so / sd:.2f}x** as shipped (target <= 0.85x); **{so / sn:.2f}x on the same "
                   f"attention kernel** (the engine's own work); {limit_note(ctx, so)}",
                   ratio=_round(so / sd), ratio_same_kernel=_round(so / sn))


# -- whole images ------------------------------------------------------------------------------------------------
def conditioning(ctx, cfg_scale):
    g = torch.Generator().manual_seed(1)
    cond = [torch.randn(ctx.args.text_tokens, ctx.cfg.text_in_dim, generator=g)]
    uncond = [torch.randn(max(1, ctx.args.text_tokens // 4), ctx.cfg.text_in_dim, generator=g)] if cfg_scale != 1.0 else None
    lat = torch.zeros(1, ctx.cfg.in_channels, ctx.args.height // 16, ctx.args.width // 16)
    return lat, cond, uncond


def sample(ctx, eng, steps, cfg_scale, preset, seed=0):
    """(seconds, latent) of one Engine.sample from the same start, text and seed as every image row."""
    lat, cond, uncond = conditioning(ctx, cfg_scale)
    cache = CacheConfig(preset=preset) if preset else CacheConfig(enabled=False)
    s = time.perf_counter()
    out = eng.sample(lat, cond, uncond, seed=seed, steps=steps, cfg=cfg_scale, cache=cache)
    ctx.sync()
    return time.perf_counter() - s, out


def quality_note(ctx, key, out) -> str:
    """Relative error and PSNR of a latent against the uncached one of the same seed, run and settings."""
    ref = ctx.state.get(key)
    if ref is None:
        return "; no uncached latent to compare with"
    return f"; vs uncached: rel. error {rel_err(out, ref):.1e}, PSNR {psnr(out, ref):.1f} dB"


def row_turbo(ctx):
    """Turbo, 8 steps, bf16 sdpa eager: Engine.sample end to end against diffusers' transformer in the same
    8-step Euler loop on the same schedule, interleaved; the uncached latent is every cache row's reference."""
    version, m, ref, _ = _diffusers_pair(ctx)
    eng = Engine(m, EngineConfig(device=str(ctx.dev), attention="sdpa"))
    sigmas = [float(x) for x in sigma_schedule(8)]  # the engine's own Turbo schedule
    inp = ctx.state["inp1"]
    x0, _, text, lens = inp

    def ours():
        ctx.state["turbo_latent"] = sample(ctx, eng, 8, 1.0, None)[1]
        return ctx.state["turbo_latent"]

    def theirs():
        x = x0.clone()
        for a, b in zip(sigmas[:-1], sigmas[1:]):
            v = ref(x, torch.full((1,), a * MULTIPLIER, device=ctx.dev), text, lens, return_dict=False)[0]
            x = x + (b - a) * v
        return x

    start = ctx.start_window()
    times, _ = interleaved(ctx, {"ours": ours, "diffusers": theirs}, repeat=max(1, ctx.args.repeat - 1))
    ref = None
    so, sd = times["ours"], times["diffusers"]
    ctx.report.row("turbo", "measured", "Turbo image: 8 steps, cfg 1, bf16 sdpa eager, no cache (Engine.sample end to end)",
                   so / 8, so, ctx.peak(), start, f"**{sd / so:.2f}x the speed of diffusers {version}** "
                   f"(its transformer in the same 8-step Euler loop: {sd:.2f} s, interleaved){finite_note(bool(torch.isfinite(ctx.state['turbo_latent']).all()))}",
                   diffusers_s=_round(sd), ratio=_round(so / sd))


def whole_run(name, steps, cfg_scale, preset):
    def run(ctx):
        m = ctx.model()
        eng = Engine(m, EngineConfig(device=str(ctx.dev), attention="sdpa"))
        key = "turbo_latent" if cfg_scale == 1.0 else "base_latent"
        if preset and key not in ctx.state:  # the uncached latent of this run (its row was not run: --only)
            ctx.state[key] = sample(ctx, eng, steps, cfg_scale, None)[1]
        start = ctx.start_window()
        total, out = sample(ctx, eng, steps, cfg_scale, preset)
        if preset is None:
            ctx.state[key] = out
        label = "Turbo" if cfg_scale == 1.0 else "Base"
        ctx.report.row(name, "measured", f"{label} image: {steps} steps, cfg {cfg_scale:g}, bf16 sdpa eager, "
                       f"{'Cache-DiT ' + preset if preset else 'no cache'}", total / steps, total, ctx.peak(), start,
                       f"{eng.last_run.calls_computed}/{eng.last_run.model_calls} calls computed"
                       + (quality_note(ctx, key, out) if preset else "")
                       + finite_note(bool(torch.isfinite(out).all())), **({"quality": _quality(ctx, key, out)} if preset else {}))
    return run


def _quality(ctx, key, out):
    ref = ctx.state.get(key)
    return None if ref is None else {"rel_err": _round(rel_err(out, ref), 6), "psnr_db": _round(psnr(out, ref), 2)}


# -- FP8 / INT4 as users open them ---------------------------------------------------------------------------------
def gguf_type(cfg) -> str:
    """The GGUF row's block type: Q4_K (the type most GGUF users run) where the block linears' inputs are whole
    256-value blocks (the 8B model's 4096 / 12288), else Q8_0 (32-value blocks: the CPU rehearsal's tiny model)."""
    return "q4_k" if cfg.hidden_size % 256 == 0 and cfg.ffn_hidden_size % 256 == 0 else "q8_0"


def opened(row):
    """open_engine(file, quant=...): the quantize-on-load peak (window opened with nothing allocated), then the
    inference peak with the window opened after loading, a forward and a Turbo image with their errors against
    bf16, and the model's state_dict (the engine's order: quantized, then fused). ``row`` is the format, or
    "gguf" for ``gguf_type``'s."""
    def run(ctx):
        fmt = gguf_type(ctx.cfg) if row == "gguf" else row
        path = ctx.checkpoint()
        ctx.release()
        start = ctx.start_window()
        s = time.perf_counter()
        eng = open_engine(path, EngineConfig(device=str(ctx.dev), dtype="bf16", quant=fmt, attention="sdpa"))
        ctx.sync()
        load_s, load_peak = time.perf_counter() - s, ctx.peak()
        m = eng.model
        gib = Q.weight_bytes(m) / 2 ** 30
        ctx.report.row(row, "measured", f"open_engine(file, quant={fmt}): quantize-on-load", None, None, load_peak, start,
                       f"{load_s:.1f} s from a {ctx.model_bytes() / 2 ** 30:.1f} GiB bf16 file; {gib:.1f} GiB of weights after",
                       load_s=_round(load_s, 2), check=True)
        start = ctx.start_window()
        st, first, ok = time_forward(ctx, m, ctx.state["inp1"])
        notes = matmul_note(eng, fmt, ctx.state["inp1"])
        ctx.report.row(row, "measured", f"DiT forward, {fmt} weights ({gib:.1f} GiB), sdpa (inference memory)", st, None,
                       ctx.peak(), start, f"{notes}{speed_note(ctx, st)}{err_note(ctx)}{finite_note(ok)}")
        if fmt == "fp8" or ctx.left() > 10 * st + 5:
            start = ctx.start_window()
            total, out = sample(ctx, eng, 8, 1.0, None)
            ctx.report.row(row, "measured", f"Turbo image: 8 steps, cfg 1, {fmt} sdpa eager, no cache", total / 8, total,
                           ctx.peak(), start, f"{quality_note(ctx, 'turbo_latent', out).lstrip('; ').replace('uncached', 'bf16')}"
                           f"{finite_note(bool(torch.isfinite(out).all()))}")
            if fmt == "fp8":
                presets_on_fp8(ctx, eng, total, out)
        ctx.state["engine_sd_keys"] = state_dict_check(m)
        eng = m = None
        ctx.release()
    return run


def presets_on_fp8(ctx, eng, uncached_s, uncached):
    """Turbo with each Cache-DiT preset on the fp8 weights: the speedup over fp8's own uncached image and the PSNR
    against it (issue 45: the presets where ComfyUI users run Turbo)."""
    for preset in USER_PRESETS:
        start = ctx.start_window()
        total, out = sample(ctx, eng, 8, 1.0, preset)
        ctx.report.row("fp8", "measured", f"Turbo image: 8 steps, cfg 1, fp8 sdpa eager, Cache-DiT {preset}",
                       total / 8, total, ctx.peak(), start,
                       f"{eng.last_run.calls_computed}/8 calls computed; {uncached_s / total:.2f}x fp8 uncached; "
                       f"vs fp8 uncached: PSNR {psnr(out, uncached):.1f} dB{finite_note(bool(torch.isfinite(out).all()))}",
                       quality={"psnr_db": _round(psnr(out, uncached), 2)}, speedup=_round(uncached_s / total))


def matmul_note(eng, fmt, inp) -> str:
    """Which matmul the row's layers ran: fp8's torch._scaled_mm note, int8's torch._int_mm probe (cached by
    the forward just timed, for its token count), GGUF's per-layer dequantization, ComfyUI's formats' notes
    (quant/comfy's prepare), else the dequantize path."""
    if fmt == "int8":
        lin = next(m for m in eng.model.modules() if isinstance(m, Q.Int8Linear))
        tokens = inp[0].shape[0] * inp[0].shape[2] * inp[0].shape[3] // eng.model.config.patch_size ** 2
        if Q.int_mm_accepts(lin.weight.device, tokens, lin.in_features, lin.out_features):
            return "W8A8: torch._int_mm int8 x int8 -> int32, per-token activation scales"
        return "torch._int_mm refused these shapes here: dequantized matmul"
    if fmt in GGUF_NAMES:
        n = sum(isinstance(m, GGUFLinear) for m in eng.model.modules())
        return f"{n} GGUF {fmt.upper()} layers: their bytes dequantized per layer each forward (bf16 matmul)"
    return "; ".join(n for n in eng.notes if n.startswith(("fp8 matmul", "int8_tensorwise matmul", "nvfp4 / mxfp8"))) \
        or "dequantize path"


def state_dict_check(m) -> str:
    """state_dict() of a quantized, fused model: the checkpoint's names (what a save or LoRA key match reads)."""
    try:
        keys = m.state_dict().keys()
    except Exception as e:  # noqa: BLE001 - reported in the row
        return f"state_dict() raised {type(e).__name__}: {e}"
    fused = sum(k.endswith((".qkv.weight", ".gate_up.weight")) for k in keys)
    return f"state_dict() gives {len(keys)} tensors under the checkpoint's names ({fused} fused names)"


def row_fuse_quant(ctx):
    """Point 7 of issue 29: the engine's order (quantize, then fuse; through the router) and the reverse one
    (fuse, then apply_quant), which must give the same layers and a working state_dict."""
    fmt = "fp8"
    ctx.release()
    a = build(ctx.cfg, ctx.dev, ctx.dtype, fmt)  # the engine's order
    b = build(ctx.cfg, ctx.dev, ctx.dtype)
    fuse_projections(b)
    try:
        Q.apply_quant(b, fmt)  # the reverse order
        Q.prepare_fast_paths(b)
        sa, sb = a.state_dict(), b.state_dict()
        same = list(sa) == list(sb) and all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)
        inp = ctx.state["inp1"]
        with torch.no_grad():
            err = rel_err(b(*inp), a(*inp))
        reverse = f"fuse then quantize: {'the same tensors' if same else 'DIFFERENT tensors'}, forward rel. diff {err:.1e}"
    except ValueError as e:
        reverse = f"fuse then quantize refused: {e}"
    ctx.report.row("fuse-quant", "measured", f"fuse / {fmt} order", notes=f"engine order (quantize, then fuse): "
                   f"{ctx.state.get('engine_sd_keys') or state_dict_check(a)}; {reverse}", check=True)
    a = b = sa = sb = None
    ctx.release()
