"""Writes docs/cache_dit.md from the code: ``python -m tools.cache_docs [out.md]``."""
from __future__ import annotations

import json
import sys

from engine.features.cache import MEASURED_PATH
from engine.features.cache.config import DEFAULTS, PRESET_KNOBS
from engine.features.cache.masks import ALIASES, FEW_STEPS, FULL_STEPS, PRESETS, mask_str, preset_mask

STEP_COUNTS = (4, 6, 8, 9, 20, 28, 50)
ORDER = ("quality", "balanced", "fast", "slow", "ultra")


def mask_table() -> str:
    lines = ["| preset | " + " | ".join(f"{n} steps" for n in STEP_COUNTS) + " |",
             "|---|" + "---|" * len(STEP_COUNTS)]
    for p in ORDER:
        cells = []
        for n in STEP_COUNTS:
            m = preset_mask(p, n)
            cells.append(f"`{mask_str(m)}` ({sum(m)}/{n})")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measured_table(path: str = MEASURED_PATH) -> str:
    """The presets' measured figures (what the node's tooltip sums up in a line each), one row per model and steps."""
    with open(path, encoding="utf-8") as f:
        presets = json.load(f)["presets"]
    lines = ["| preset | model | steps | computed | speedup | PSNR | SSIM | judge |", "|---|---|---|---|---|---|---|---|"]
    for preset, rows in presets.items():
        for r in rows:
            same = r.get("same_image")
            psnr = "same picture" if same else "-" if r["psnr"] is None else f"{r['psnr']:.1f} dB"
            ssim = "1" if same else "-" if r["ssim"] is None else f"{r['ssim']:.3f}"
            judge = "-" if r["judge"] is None else f"{r['judge']:.0f}%"
            lines.append(f"| {preset} | {r['model']} | {r['steps']} | {r['computed']:.0f} | {r['speedup']:.2f}x | {psnr} "
                         f"| {ssim} | {judge} |")
    return "\n".join(lines)


def render() -> str:
    notes = [f"Below {min(PRESETS[p].min_steps for p in ORDER)} steps every preset computes every step (the run's "
             f"note says so)."]
    knobs = PRESET_KNOBS["balanced"]
    return f"""# Cache-DiT (step caching)

Cache-DiT reuses work between sampling steps: on a *cached* step the first `Fn` transformer blocks
run, the saved residual of the middle blocks (predicted by TaylorSeer) is added, and the last `Bn`
blocks run; every other step computes all blocks (DBCache). Which steps are cached is decided by a
**step computation mask** (the presets) or by a threshold on how much the first blocks' output
changed since the last computed step. It needs no training and works with CFG, batches, denoise < 1,
inpainting masks (blended outside the DiT), every sampler (heun: the mask counts model calls) and any
resolution; with the cache off the output is bit-identical to the uncached engine.

## Switching it on

Two environment variables (the same names SGLang uses):

```bash
SGLANG_CACHE_DIT_ENABLED=true SGLANG_CACHE_DIT_SCM_PRESET=balanced python main.py   # ComfyUI
SGLANG_CACHE_DIT_ENABLED=true SGLANG_CACHE_DIT_SCM_PRESET=fast sgld generate ...
```

or the **SGLDiffusion Cache-DiT** node (preset, or `advanced` fields) connected to the `cache` input of
**SGLDiffusion KSampler**, or to **SGLDiffusion Apply Cache-DiT** for any sampler on the loader's
`comfy_model`; the node wins over the environment (`enabled` off there = no cache). CLI: `--cache-preset`
and the other `--cache-*` flags (`sgld generate --help`); `sgld serve`: a request's `"cache"` field (a
preset or `off`; none: the server's flags, else the environment as it was at its start). From Python:
`Engine.sample(..., cache=CacheConfig(preset="balanced"))` or `EngineConfig(cache=...)`; the engine's `last_run` then holds the step mask that happened,
`calls_computed` and the measured speedup.

| variable | values | default | meaning |
|---|---|---|---|
| `SGLANG_CACHE_DIT_ENABLED` | true / false | false | master switch |
| `SGLANG_CACHE_DIT_SCM_PRESET` | none, quality, balanced, fast, slow, medium, ultra | none | step mask preset |
| `SGLANG_CACHE_DIT_FN` | integer >= 1 | {DEFAULTS['fn']} (presets: {knobs['fn']}) | first blocks always computed |
| `SGLANG_CACHE_DIT_BN` | integer >= 0 | {DEFAULTS['bn']} | last blocks always computed |
| `SGLANG_CACHE_DIT_WARMUP` | integer >= 0 | {DEFAULTS['warmup']} | leading steps always computed (no preset) |
| `SGLANG_CACHE_DIT_RDT` | number >= 0 | {DEFAULTS['rdt']} | residual-diff threshold: reuse when the first blocks' residual changed less (relative L1); 0 = never |
| `SGLANG_CACHE_DIT_MC` | integer >= -1 | {DEFAULTS['mc']} | most cached steps in a row (-1 = unlimited) |
| `SGLANG_CACHE_DIT_MAX_CACHED_STEPS` | integer >= -1 | -1 | most cached steps per run |
| `SGLANG_CACHE_DIT_TAYLORSEER` | true / false | false (presets: true) | predict the reused residual (TaylorSeer) |
| `SGLANG_CACHE_DIT_TS_ORDER` | 1, 2 | 1 | TaylorSeer order |
| `SGLANG_CACHE_DIT_SCM_POLICY` | static, dynamic | presets: static | static: the mask alone decides (fixed speed, no GPU sync); dynamic: a masked step is reused only if the threshold and limits allow |
| `SGLANG_CACHE_DIT_SCM_MASK` | 0/1 string | - | custom mask, one digit per model call (1 = compute) |

The variables are read once where a run starts from the outside: when `sgld generate`, `sgld bench` or
`sgld serve` starts (an invalid value stops it before anything loads, with an error naming the variable and the
allowed values), when a ComfyUI KSampler runs without a Cache-DiT node, and when an `ErnieImagePipeline` is built
(or `engine.accelerate` / `engine.open_demo` is called). The engine itself never reads them: from Python,
`Engine.sample(cache=None)` runs with the `EngineConfig`'s cache, else none (`features.cache.resolve_config(None)`
gives the environment's). A `CacheConfig` is checked when it is built (an error naming the field and the allowed
values), once.
Explicitly set knobs override the preset's. Without a preset the threshold decides (SGLang's
defaults: F1B0, warm-up 4, rdt 0.24, MC 3); the threshold's scale depends on the model, so the
presets use static masks by default.

## Presets

`quality`, `balanced` and `fast` are the names to use; cache-dit's `medium` is an alias of
`quality`{' (' + ', '.join(f'{a} = {b}' for a, b in ALIASES.items() if a != 'medium') + ')' if len(ALIASES) > 1 else ''},
cache-dit's `fast` means the same as ours, `slow` and `ultra` are the gentlest and the most aggressive.
All masks keep the first and last steps computed, have no long runs of cached steps, and are
made for every step count by one rule (`engine/features/cache/masks.py`):

* **below {FEW_STEPS} steps** (a distilled few-step model: ERNIE-Image Turbo at 8) the preset computes its few-step
  share of the calls ({', '.join(f'{p} {PRESETS[p].few_compute:g}' for p in ORDER)}; rounded up, more if a
  cached run would be longer than the preset allows), evenly spaced from the first call to the last. No warm-up
  run: every step of such a model moves the picture a lot, so the reused residual is extrapolated (TaylorSeer
  order 1) from computed calls on both sides of the composition, which keeps it far better than caching the last
  steps (measured on the 36-block demo-turbo: `bench/RESULTS.md`, "Turbo at 8 steps");
* **from {FEW_STEPS} steps on** a warm-up run of computed steps, then the compute budget spread evenly; the cached
  share ramps up to the preset's full share at {FULL_STEPS} steps and stays there.

Masks (1 = compute, 0 = cached; computed/total):

{mask_table()}

{' '.join(notes)}

Targets (sampling time at one CPU thread, side by side with the uncached run): at 8 steps quality 1.5x,
balanced 1.8x, fast 2.2x, on the demo-turbo (`python bench/speed/turbo_cache_bench.py`); at 50 steps quality
1.67x, balanced 2.0x, fast 2.69x (`python bench/speed/cache_bench.py`). The measured figures are in
`bench/RESULTS.md`.

### What the preset tooltip says, and the figures behind it

Hovering the Cache-DiT node's `preset` shows one line per preset to use (balanced, quality, fast; the selected one
marked) and `none`: the speedup measured at 50 and at 8 steps, as a range over the models measured, and how close
the picture stays to the uncached one, in words from the worst PSNR measured ("the same picture" where no step is
cached). The figures are `engine/features/cache/measured.json`, written by `bench/speed/cache_bench.py` (the speedup
prices the model calls of the run itself; `random tiny (36 blocks)`: random weights with ERNIE-Image's 36 blocks at a
tiny width; `demo (4 blocks)`: the embedded demo model, whose judge (`tools/demo/judge.py`) gives the pass rate on
its captions):

{measured_table()}
"""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if argv:
        with open(argv[0], "w") as f:
            f.write(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
