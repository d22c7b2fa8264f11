"""SGLDiffusion Cache-DiT: preset or advanced DBCache settings -> SGLD_CACHE for the SGLDiffusion KSampler.

The SGLD_CACHE value is an ``engine.cache.CacheConfig``; connected to the KSampler it takes
precedence over the SGLANG_CACHE_DIT_* environment variables (``enabled`` off = no cache at all).
"""
from __future__ import annotations

from ..engine.cache import ALL_PRESETS, DEFAULTS, CacheConfig, CacheConfigError, mask_str, preset_mask

NODE = "SGLDiffusion Cache-DiT"
PRESET_CHOICES = ["balanced", "quality", "fast"] + [p for p in ALL_PRESETS if p not in ("quality", "balanced", "fast")] + ["none"]
FROM_PRESET = "from preset"
FIELD_NAMES = {"preset": "preset", "fn": "Fn", "bn": "Bn", "warmup": "warmup", "rdt": "residual_diff_threshold",
               "mc": "max_continuous_cached", "max_cached_steps": "max_cached_steps", "taylorseer": "taylorseer",
               "ts_order": "taylorseer_order", "scm_policy": "mask_policy", "steps_mask": "steps_mask"}


def _preview(preset: str) -> str:
    return "; ".join(f"{n} steps: {mask_str(preset_mask(preset, n))}" for n in (8, 20, 50))


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
        return {
            "required": {
                "enabled": ("BOOLEAN", {"default": True, "tooltip": "Off: no caching, even if the environment switches it on."}),
                "preset": (PRESET_CHOICES, {"default": "balanced", "tooltip": (
                    "Which steps are computed. quality / balanced / fast (cache-dit's medium = quality; slow and ultra "
                    "are the gentlest and the most aggressive). none: no mask, the threshold decides (advanced). "
                    "Balanced: " + _preview("balanced"))}),
                "advanced": ("BOOLEAN", {"default": False, "tooltip": "Use the fields below instead of the preset's values."}),
            },
            "optional": {
                "Fn": ("INT", {"default": DEFAULTS["fn"], "min": 1, "max": 64, "tooltip": "First blocks always computed."}),
                "Bn": ("INT", {"default": DEFAULTS["bn"], "min": 0, "max": 64, "tooltip": "Last blocks always computed."}),
                "warmup": ("INT", {"default": DEFAULTS["warmup"], "min": 0, "max": 1000,
                                   "tooltip": "Leading steps always computed (without a preset mask)."}),
                "residual_diff_threshold": ("FLOAT", {"default": DEFAULTS["rdt"], "min": 0.0, "max": 10.0, "step": 0.01,
                                                      "tooltip": "Reuse when the first blocks' residual changed less than this (relative L1). 0 = never."}),
                "max_continuous_cached": ("INT", {"default": DEFAULTS["mc"], "min": -1, "max": 1000,
                                                  "tooltip": "Most cached steps in a row (-1 = unlimited)."}),
                "max_cached_steps": ("INT", {"default": -1, "min": -1, "max": 10000, "tooltip": "Most cached steps per run (-1 = unlimited)."}),
                "taylorseer": ([FROM_PRESET, "on", "off"], {"default": FROM_PRESET,
                                                            "tooltip": "Predict the reused residual from the last computed steps."}),
                "taylorseer_order": ("INT", {"default": 1, "min": 1, "max": 2}),
                "mask_policy": ([FROM_PRESET, "static", "dynamic"], {"default": FROM_PRESET, "tooltip": (
                    "static: the preset's mask decides alone (fixed speed, no GPU sync). dynamic: masked steps are "
                    "reused only if the threshold and limits also allow it.")}),
                "steps_mask": ("STRING", {"default": "", "tooltip": "Custom mask, one 0/1 per model call (1 = compute), e.g. 1111010101; replaces the preset's."}),
            },
        }

    def build(self, enabled, preset, advanced, Fn=None, Bn=None, warmup=None, residual_diff_threshold=None,
              max_continuous_cached=None, max_cached_steps=None, taylorseer=FROM_PRESET, taylorseer_order=None,
              mask_policy=FROM_PRESET, steps_mask=""):
        if not enabled:
            return (CacheConfig(enabled=False),)
        kw = {"preset": None if preset == "none" else preset}
        if advanced:
            kw.update(fn=Fn, bn=Bn, warmup=warmup, mc=max_continuous_cached, max_cached_steps=max_cached_steps,
                      ts_order=taylorseer_order,
                      rdt=None if residual_diff_threshold is None else float(residual_diff_threshold))
            if taylorseer != FROM_PRESET:
                kw["taylorseer"] = taylorseer == "on"
            if mask_policy != FROM_PRESET:
                kw["scm_policy"] = mask_policy
            if steps_mask and str(steps_mask).strip():
                kw["steps_mask"] = str(steps_mask).strip()
        try:
            cfg = CacheConfig(enabled=True, **kw).validate(names={f: f"{NODE} field '{w}'" for f, w in FIELD_NAMES.items()})
        except CacheConfigError as e:
            raise ValueError(str(e)) from None
        return (cfg,)


NODE_CLASS_MAPPINGS = {"SGLDiffusionCacheDiT": SGLDiffusionCacheDiT}
NODE_DISPLAY_NAME_MAPPINGS = {"SGLDiffusionCacheDiT": "SGLDiffusion Cache-DiT"}
