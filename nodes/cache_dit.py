"""SGLDiffusion Cache-DiT: preset or advanced DBCache settings -> SGLD_CACHE for the SGLDiffusion KSampler.

The SGLD_CACHE value is an ``engine.features.cache.CacheConfig``; connected to the KSampler it takes
precedence over the SGLANG_CACHE_DIT_* environment variables (``enabled`` off = no cache at all).
"""
from __future__ import annotations

import json

from ..engine.features.cache import ALIASES, MEASURED_PATH, CacheConfig, CacheConfigError, mask_str, preset_mask
from ..engine.options import from_widgets, node_inputs

NODE = "SGLDiffusion Cache-DiT"


def preset_benchmarks(path: str = MEASURED_PATH) -> dict:
    """Per preset, what bench/speed/cache_bench.py measured (engine/features/cache/measured.json):
    ``{preset: [{"setting", "model", "steps", "speedup", "speedup_kind", "psnr", "same_image", "ssim", "judge",
    "computed"}, ...]}``; an alias (cache-dit's medium) shares its preset's entries. Empty when the file is
    not there or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            out = dict(json.load(f)["presets"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    for alias, target in ALIASES.items():
        if alias not in out and target in out:
            out[alias] = out[target]
    return out


def _bench_line(preset: str, bench: dict) -> str:
    """"preset: model A: 50 steps 1.67x, PSNR 46.9 dB, SSIM 0.995; 8 steps ... | model B: ..." """
    by_model = {}
    for r in bench.get(preset) or []:
        q = ["?" if r["speedup"] is None else f"{r['speedup']:.2f}x"]
        if r.get("same_image"):
            q.append("same image")
        elif r["psnr"] is not None:
            q.append(f"PSNR {r['psnr']:.1f} dB")
        if r["ssim"] is not None and not r.get("same_image"):
            q.append(f"SSIM {r['ssim']:.3f}")
        if r["judge"] is not None:
            q.append(f"judge {r['judge']:.0f}%")
        by_model.setdefault(r["model"], []).append(f"{r['steps']} steps " + ", ".join(q))
    name = preset + (f" (= {ALIASES[preset]})" if preset in ALIASES else "")
    parts = [f"{m}: " + "; ".join(v) for m, v in by_model.items()]
    return f"{name}: " + (" | ".join(parts) if parts else "not measured")


TARGETS_50 = {"quality": 1.67, "balanced": 2.0, "fast": 2.69, "medium": 1.67}  # design targets, 50 steps


def preset_tooltip(bench: dict = None) -> str:
    """The preset widget's tooltip: what each preset does, then one line per preset ("name: ...") with the
    benchmark's speedup and quality (the web extension marks the selected preset's line)."""
    bench = preset_benchmarks() if bench is None else bench
    head = ("Which steps are computed. quality / balanced / fast (cache-dit's medium = quality; slow and ultra "
            "are the gentlest and the most aggressive). none: no mask, the threshold decides (advanced). "
            "Balanced: " + _preview("balanced"))
    presets = [p for p in preset_choices() if p != "none"]
    if not bench:
        lines = [f"{p}: not measured yet" + (f" (target at 50 steps: {TARGETS_50[p]:.2f}x)" if p in TARGETS_50 else "")
                 for p in presets]
        return (head + "\nMeasured speedup and quality per preset: no benchmark table yet (python bench/speed/cache_bench.py "
                "writes engine/features/cache/measured.json).\n" + "\n".join(lines))
    lines = [_bench_line(p, bench) for p in presets]
    kinds = {r["speedup_kind"] for rows in bench.values() for r in rows}
    kind = ("model calls priced at the run's own computed calls" if kinds == {"in-run"}
            else "wall clock of sampling vs uncached")
    return (head + f"\nMeasured (bench/speed/cache_bench.py; speedup = {kind}; PSNR/SSIM vs the uncached image):\n"
            + "\n".join(lines))


def preset_choices() -> list:
    """The preset widget's list (balanced, the default, first; none last), as CacheConfig declares it."""
    return node_inputs(CacheConfig)["required"]["preset"][0]


def _preview(preset: str) -> str:
    """The preset's mask at 8 and 20 steps (1 = computed), and how many of 50 calls it computes."""
    m50 = preset_mask(preset, 50)
    return "; ".join(f"{n} steps: {mask_str(preset_mask(preset, n))}" for n in (8, 20)) + f"; 50 steps: {sum(m50)} of 50 computed"


class SGLDiffusionCacheDiT:
    DESCRIPTION = ("Cache-DiT step caching for SGLDiffusion KSampler: reuse the middle transformer blocks' "
                   "residual on some steps (DBCache, with TaylorSeer prediction). Presets at 50 steps: quality "
                   "~1.67x, balanced ~2x, fast ~2.7x. With 'advanced' on, the fields below replace the preset's "
                   "values. Connected, it overrides the SGLANG_CACHE_DIT_* environment variables.")
    CATEGORY = "SGLDiffusion"
    RETURN_TYPES = ("SGLD_CACHE",)
    RETURN_NAMES = ("cache",)
    OUTPUT_TOOLTIPS = ("Cache settings for the 'cache' input of SGLDiffusion KSampler.",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        """CacheConfig's declared fields (widget names, defaults, ranges, tooltips), with the node's 'advanced'
        switch after the preset."""
        inputs = node_inputs(CacheConfig)
        required = inputs["required"]
        required["preset"][1]["tooltip"] = preset_tooltip()
        required["advanced"] = ("BOOLEAN", {"default": False,
                                            "tooltip": "Use the fields below instead of the preset's values."})
        return {"required": required, "optional": inputs["optional"]}

    def build(self, enabled, preset, advanced, **fields):
        """``fields``: the advanced inputs by their widget names (None or absent: not set, the preset decides)."""
        if not enabled:
            return (CacheConfig(enabled=False),)
        try:
            given = from_widgets(CacheConfig, {"enabled": True, "preset": preset, **(fields if advanced else {})}, NODE)
            cfg = CacheConfig(**given)
        except CacheConfigError as e:
            raise ValueError(str(e)) from None  # ComfyUI shows a ValueError without the pack's module path
        return (cfg,)


NODE_CLASS_MAPPINGS = {"SGLDiffusionCacheDiT": SGLDiffusionCacheDiT}
NODE_DISPLAY_NAME_MAPPINGS = {"SGLDiffusionCacheDiT": "SGLDiffusion Cache-DiT"}
