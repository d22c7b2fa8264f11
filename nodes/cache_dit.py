"""SGLDiffusion Cache-DiT: preset or advanced DBCache settings -> SGLD_CACHE for the SGLDiffusion KSampler.

The SGLD_CACHE value is an ``engine.cache.CacheConfig``; connected to the KSampler it takes
precedence over the SGLANG_CACHE_DIT_* environment variables (``enabled`` off = no cache at all).
"""
from __future__ import annotations

import os
import re

from ..engine.features.cache import ALL_PRESETS, DEFAULTS, CacheConfig, CacheConfigError, mask_str, preset_mask

NODE = "SGLDiffusion Cache-DiT"
PRESET_CHOICES = ["balanced", "quality", "fast"] + [p for p in ALL_PRESETS if p not in ("quality", "balanced", "fast")] + ["none"]
FROM_PRESET = "from preset"
FIELD_NAMES = {"preset": "preset", "fn": "Fn", "bn": "Bn", "warmup": "warmup", "rdt": "residual_diff_threshold",
               "mc": "max_continuous_cached", "max_cached_steps": "max_cached_steps", "taylorseer": "taylorseer",
               "ts_order": "taylorseer_order", "scm_policy": "mask_policy", "steps_mask": "steps_mask"}


BENCH_TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "cache_results.md")
PRESET_ALIASES = {"medium": "quality"}  # cache-dit's medium is our quality


def _speedup_column(cols: dict):
    """The table's speedup column: 'speedup (in-run)' (the figure the bench uses for targets) if there,
    else the first 'speedup ...' one (older tables: 'speedup (wall)')."""
    if "speedup (in-run)" in cols:
        return "speedup (in-run)"
    return next((c for c in cols if c.startswith("speedup")), None)


def preset_benchmarks(path: str = BENCH_TABLE) -> dict:
    """Per preset, what bench/cache_bench.py measured (its markdown table, ``## <setting>`` sections):
    ``{preset: [{"setting", "model", "steps", "speedup", "speedup_kind", "psnr", "ssim", "judge", "computed"}, ...]}``,
    one entry per section in the table's order. ``judge`` only where the section's uncached run passes
    the judge at all (else the pass rate says nothing). Empty when the table is not there or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out, setting, cols, base_judge = {}, None, None, None

    def num(v):
        m = re.match(r"^\s*(-?[0-9.]+|inf)", v or "")
        return None if m is None else float(m.group(1))

    for line in lines:
        if line.startswith("## "):
            setting, cols, base_judge = line[3:].strip(), None, None
            continue
        if setting is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cols is None:
            cols = {c.lower(): i for i, c in enumerate(cells)}
            continue
        if set(cells[0]) <= set("-: "):
            continue
        row = {k: (cells[i] if i < len(cells) else "") for k, i in cols.items()}
        name = row.get("configuration", "")
        if row.get("family") == "base" or name == "uncached":
            base_judge = num(row.get("judge pass %"))
            continue
        if name not in ALL_PRESETS or row.get("family", "ours") != "ours":
            continue
        steps = re.search(r"(\d+) steps", setting)
        blocks = re.search(r"(\d+) blocks", setting)
        model = setting.split(" (")[0].split(",")[0].strip()
        sp_col = _speedup_column(cols)
        entry = {"setting": setting, "model": model + (f" ({blocks.group(1)} blocks)" if blocks else ""),
                 "steps": int(steps.group(1)) if steps else None,
                 "speedup": num(row.get(sp_col)) if sp_col else None, "speedup_kind": sp_col,
                 "psnr": num(row.get("psnr db")), "ssim": num(row.get("ssim")),
                 "judge": num(row.get("judge pass %")) if base_judge else None,
                 "computed": num(row.get("computed calls"))}
        out.setdefault(name, []).append(entry)
    for alias, target in PRESET_ALIASES.items():
        if alias not in out and target in out:
            out[alias] = out[target]
    return out


def _bench_line(preset: str, bench: dict) -> str:
    """"preset: model A: 50 steps 1.67x, PSNR 46.9 dB, SSIM 0.995; 8 steps ... | model B: ..." """
    by_model = {}
    for r in bench.get(preset) or []:
        q = ["?" if r["speedup"] is None else f"{r['speedup']:.2f}x"]
        if r["psnr"] is not None:
            q.append("same image" if r["psnr"] == float("inf") else f"PSNR {r['psnr']:.1f} dB")
        if r["ssim"] is not None and r["psnr"] != float("inf"):
            q.append(f"SSIM {r['ssim']:.3f}")
        if r["judge"] is not None:
            q.append(f"judge {r['judge']:.0f}%")
        by_model.setdefault(r["model"], []).append(f"{r['steps']} steps " + ", ".join(q))
    name = preset + (f" (= {PRESET_ALIASES[preset]})" if preset in PRESET_ALIASES else "")
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
    presets = [p for p in PRESET_CHOICES if p != "none"]
    if not bench:
        lines = [f"{p}: not measured yet" + (f" (target at 50 steps: {TARGETS_50[p]:.2f}x)" if p in TARGETS_50 else "")
                 for p in presets]
        return (head + "\nMeasured speedup and quality per preset: no benchmark table yet (bench/cache_results.md, "
                "python bench/cache_bench.py).\n" + "\n".join(lines))
    lines = [_bench_line(p, bench) for p in presets]
    kinds = {r["speedup_kind"] for rows in bench.values() for r in rows}
    kind = ("model calls priced at the run's own computed calls" if kinds == {"speedup (in-run)"}
            else "wall clock of sampling vs uncached")
    return (head + f"\nMeasured (bench/cache_results.md; speedup = {kind}; PSNR/SSIM vs the uncached image):\n"
            + "\n".join(lines))


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
        return {
            "required": {
                "enabled": ("BOOLEAN", {"default": True, "tooltip": "Off: no caching, even if the environment switches it on."}),
                "preset": (PRESET_CHOICES, {"default": "balanced", "tooltip": preset_tooltip()}),
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
