"""SGLDiffusion Cache-DiT: preset or advanced DBCache settings -> SGLD_CACHE for the SGLDiffusion KSampler.

The SGLD_CACHE value is an ``engine.features.cache.CacheConfig``; connected to the KSampler it takes
precedence over the SGLANG_CACHE_DIT_* environment variables (``enabled`` off = no cache at all).
"""
from __future__ import annotations

import json

from ..engine.features.cache import ALIASES, MEASURED_PATH, USER_PRESETS, CacheConfig, CacheConfigError
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


def _speed(rows: list, steps: int, label: str) -> str:
    """The measured speedups at ``steps`` steps over the models measured: "1.6-2.1x faster at 50 steps" (``label``:
    the words after the figure), "every step runs at 8" when the preset caches none there, "" when not measured."""
    rows = [r for r in rows if r["steps"] == steps and r["speedup"] is not None]
    if rows and all(r.get("computed") == steps for r in rows):
        return f"every step runs at {steps}"
    got = sorted({round(r["speedup"], 1) for r in rows})
    return "" if not got else f"{got[0]:g}x {label}" if len(got) == 1 else f"{got[0]:g}-{got[-1]:g}x {label}"


def _closeness(rows: list) -> str:
    """How close to the uncached picture, in words, from the worst PSNR measured (same picture: no cached step)."""
    psnr = [r["psnr"] for r in rows if not r.get("same_image") and r["psnr"] is not None]
    if not psnr:
        return "the same picture as uncached"
    worst = min(psnr)
    return ("hard to tell from the uncached picture" if worst >= 45 else "close to the uncached picture" if worst >= 35
            else "some visible differences from the uncached picture")


def _preset_line(preset: str, bench: dict) -> str:
    """One line a user reads: "balanced: 1.7-2.1x faster at 50 steps, 1.1-1.2x at 8; close to the uncached picture"."""
    rows = bench.get(preset) or []
    if not rows:
        target = f" (aim: {TARGETS_50[preset]:g}x faster at 50 steps)" if preset in TARGETS_50 else ""
        return f"{preset}: not measured yet{target}"
    speed = ", ".join(filter(None, [_speed(rows, 50, "faster at 50 steps"), _speed(rows, 8, "at 8")]))
    return f"{preset}: {speed}; {_closeness(rows)}"


TARGETS_50 = {"quality": 1.67, "balanced": 2.0, "fast": 2.69}  # design targets, 50 steps
MORE = "Other presets, the step masks and how these were measured: docs/cache_dit.md"


def preset_tooltip(bench: dict = None) -> str:
    """The preset widget's tooltip, a few lines a user reads: what a preset does, one line per preset to use ("name:
    ...", the measured speedup and closeness in words; the web extension marks the selected one), and where the rest is
    (docs/cache_dit.md: cache-dit's other names, the masks, the benchmark's figures)."""
    bench = preset_benchmarks() if bench is None else bench
    presets = [p for p in preset_choices() if p in USER_PRESETS]
    lines = [_preset_line(p, bench) for p in presets]
    return "\n".join(["Which sampling steps run the whole model; the others reuse its cached work.", *lines,
                      "none: no fixed steps; the advanced threshold decides.", MORE])


def preset_choices() -> list:
    """The preset widget's list (balanced, the default, first; none last), as CacheConfig declares it."""
    return node_inputs(CacheConfig)["required"]["preset"][0]


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
