"""Cache-DiT options: ``CacheConfig`` (what nodes, CLI and EngineConfig pass; its fields are declared
options), presets, and the ``SGLANG_CACHE_DIT_*`` environment switches.

Precedence: an explicit ``CacheConfig`` (node / ``Engine.sample(cache=...)`` / ``EngineConfig.cache``)
wins over the environment, which the entry points (CLI, server start, nodes, pipeline) read once through
``resolve_config``: the engine never reads it. Inside one config an explicitly set knob wins over the preset's
value, which wins over the DBCache defaults (SGLang's: F1B0, warm-up 4, rdt 0.24, MC 3, TaylorSeer off).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar, List, Mapping, Optional

from ...errors import CacheConfigError
from ...options import checked, option
from ...options import from_env as from_env_of
from . import masks

POLICIES = ("static", "dynamic")
TS_ORDERS = (1, 2)
UNLIMITED = "an integer >= -1 (-1 = unlimited)"


# DBCache defaults when no preset is chosen (SGLang's integration defaults).
DEFAULTS = dict(fn=1, bn=0, warmup=4, rdt=0.24, mc=3, max_cached_steps=-1, taylorseer=False, ts_order=1,
                scm_policy="dynamic")

# What a preset sets besides its mask. Static masks: the speed is fixed by the mask (no host sync,
# no threshold to tune per model); TaylorSeer order 1 predicts the skipped middle-block residual.
PRESET_KNOBS = {
    "slow": dict(fn=1, bn=0, taylorseer=True, ts_order=1, scm_policy="static"),
    "quality": dict(fn=1, bn=0, taylorseer=True, ts_order=1, scm_policy="static"),
    "balanced": dict(fn=1, bn=0, taylorseer=True, ts_order=1, scm_policy="static"),
    "fast": dict(fn=1, bn=0, taylorseer=True, ts_order=1, scm_policy="static"),
    "ultra": dict(fn=1, bn=0, taylorseer=True, ts_order=1, scm_policy="static"),
}


FROM_PRESET = "from preset"  # a node's text for a knob left to the preset


@dataclass(frozen=True)
class CacheConfig:
    """Cache-DiT settings for one run. ``None`` knobs take the preset's value, then the default (DEFAULTS).
    Each field is a declared option (engine/options.py): the CLI's --cache-* flags, the
    SGLANG_CACHE_DIT_* variables (SGLang's names) and the Cache-DiT node's fields derive from it.
    """

    OPTION_LABEL: ClassVar[str] = "cache option '{name}' ="
    OPTION_ERROR: ClassVar[type] = CacheConfigError

    # master switch: CacheConfig(enabled=False) disables even if the environment says on
    enabled: bool = option(True, bool, "switch the cache on or off (overrides the environment)", flag="--cache",
                           flag_default=None, env="SGLANG_CACHE_DIT_ENABLED", widget="enabled", widget_required=True,
                           tooltip="Off: no caching, even if the environment switches it on.")
    # quality | balanced | fast (users' names), or cache-dit's slow | medium | ultra; None = no mask
    preset: Optional[str] = option(None, str, "step mask preset (implies --cache on)",
                                   choices=masks.ALL_PRESETS, optional=True, labels={None: "none"}, aliases={"": None},
                                   any_case=True, flag="--cache-preset", env="SGLANG_CACHE_DIT_SCM_PRESET",
                                   widget="preset", widget_default="balanced", widget_required=True)
    # first / last blocks always computed (DBCache F and B)
    fn: Optional[int] = option(None, int, "first blocks always computed", optional=True, low=1, flag="--cache-fn",
                               env="SGLANG_CACHE_DIT_FN", widget="Fn", widget_default=DEFAULTS["fn"], widget_max=64,
                               tooltip="First blocks always computed.")
    bn: Optional[int] = option(None, int, "last blocks always computed", optional=True, low=0, flag="--cache-bn",
                               env="SGLANG_CACHE_DIT_BN", widget="Bn", widget_default=DEFAULTS["bn"], widget_max=64,
                               tooltip="Last blocks always computed.")
    # leading steps always computed (ignored when a mask is set: the mask has its own)
    warmup: Optional[int] = option(None, int, "leading steps always computed", optional=True, low=0,
                                   flag="--cache-warmup", env="SGLANG_CACHE_DIT_WARMUP", widget="warmup",
                                   widget_default=DEFAULTS["warmup"], widget_max=1000,
                                   tooltip="Leading steps always computed (without a preset mask).")
    # residual-diff threshold (relative L1 of the first blocks' residual); <= 0 never caches
    rdt: Optional[float] = option(None, float, "residual-diff threshold", optional=True, low=0.0, finite=False,
                                  allowed="a number >= 0 (e.g. 0.08 .. 0.6; 0 = never cache, >= 1 = always cache)",
                                  flag="--cache-rdt", env="SGLANG_CACHE_DIT_RDT", widget="residual_diff_threshold",
                                  widget_default=DEFAULTS["rdt"], widget_max=10.0, widget_step=0.01,
                                  tooltip="Reuse when the first blocks' residual changed less than this (relative L1). "
                                          "0 = never.")
    mc: Optional[int] = option(None, int, "max consecutive cached steps (-1 = unlimited)", optional=True, low=-1,
                               allowed=UNLIMITED, flag="--cache-mc", env="SGLANG_CACHE_DIT_MC",
                               widget="max_continuous_cached", widget_default=DEFAULTS["mc"], widget_max=1000,
                               tooltip="Most cached steps in a row (-1 = unlimited).")
    max_cached_steps: Optional[int] = option(None, int, "max cached steps per run (-1 = unlimited)", optional=True,
                                             low=-1, allowed=UNLIMITED, flag="--cache-max-cached",
                                             env="SGLANG_CACHE_DIT_MAX_CACHED_STEPS", widget="max_cached_steps",
                                             widget_default=DEFAULTS["max_cached_steps"], widget_max=10000,
                                             tooltip="Most cached steps per run (-1 = unlimited).")
    # TaylorSeer prediction of the skipped residual, order 1 or 2
    taylorseer: Optional[bool] = option(None, bool, "TaylorSeer prediction of the reused residual", optional=True,
                                        aliases={FROM_PRESET: None}, flag="--cache-taylorseer",
                                        env="SGLANG_CACHE_DIT_TAYLORSEER", widget="taylorseer",
                                        widget_default=FROM_PRESET,
                                        tooltip="Predict the reused residual from the last computed steps.")
    ts_order: Optional[int] = option(None, int, "TaylorSeer order: 1 or 2", choices=TS_ORDERS, optional=True,
                                     flag="--cache-ts-order", env="SGLANG_CACHE_DIT_TS_ORDER",
                                     widget="taylorseer_order", widget_default=DEFAULTS["ts_order"],
                                     tooltip="TaylorSeer's order: 1 extrapolates the reused residual linearly from the "
                                             "last two computed steps, 2 also follows its curvature (three steps).")
    # static (mask zeros are always cached) | dynamic (mask zeros still pass rdt / mc)
    scm_policy: Optional[str] = option(None, str, "how a preset's mask is applied", choices=POLICIES,
                                       optional=True, aliases={FROM_PRESET: None}, flag="--cache-policy",
                                       env="SGLANG_CACHE_DIT_SCM_POLICY", widget="mask_policy",
                                       widget_default=FROM_PRESET,
                                       tooltip="static: the preset's mask decides alone (fixed speed, no GPU sync). "
                                               "dynamic: masked steps are reused only if the threshold and limits "
                                               "also allow it.")
    # custom mask "1110101..." (1 = compute) instead of a preset
    steps_mask: Optional[str] = option(None, str, "custom step mask, e.g. 1111010101 (1 = compute)", optional=True,
                                       aliases={"": None}, check=masks.parse_mask,
                                       allowed="a string of 0 and 1, one per model call (1 = compute)",
                                       flag="--cache-mask", env="SGLANG_CACHE_DIT_SCM_MASK", widget="steps_mask",
                                       widget_default="",
                                       tooltip="Custom mask, one 0/1 per model call (1 = compute), e.g. 1111010101; "
                                               "replaces the preset's.")

    def __post_init__(self):
        """Checked when built, as EngineConfig is (CacheConfigError naming the field and what is allowed);
        the values normalized (preset case, aliases), so equal settings compare and hash equal."""
        for name, value in checked(self).items():
            object.__setattr__(self, name, value)

    @property
    def preset_name(self) -> Optional[str]:
        if self.preset is None:
            return None
        p = str(self.preset).strip().lower()
        return None if p in ("", "none") else masks.canonical_preset(p)

    def knob(self, name: str):
        v = getattr(self, name)
        if v is not None:
            return v
        p = self.preset_name
        if p is not None and name in PRESET_KNOBS[p]:
            return PRESET_KNOBS[p][name]
        return DEFAULTS[name]

    def resolve(self, calls: int, num_layers: int) -> "ResolvedCache":
        """Concrete settings for a run of ``calls`` model calls on a model with ``num_layers`` blocks."""
        fn, bn = self.knob("fn"), self.knob("bn")
        if fn + bn >= num_layers:
            raise CacheConfigError(
                f"cache option 'fn' + 'bn' = {fn} + {bn} leaves no middle blocks to cache in a model of "
                f"{num_layers} blocks; allowed: fn >= 1, bn >= 0, fn + bn < {num_layers}")
        mask, note, warnings = None, None, []
        if self.steps_mask is not None and str(self.steps_mask).strip():
            given = masks.parse_mask(self.steps_mask)
            mask = masks.fit_mask(given, calls)
            warnings = fit_warnings(given, mask)
        elif self.preset_name is not None:
            mask = masks.preset_mask(self.preset_name, calls)
            note = masks.mask_note(self.preset_name, calls)
        return ResolvedCache(fn=fn, bn=bn, warmup=self.knob("warmup"), rdt=float(self.knob("rdt")), mc=self.knob("mc"),
                             max_cached_steps=self.knob("max_cached_steps"), taylorseer=bool(self.knob("taylorseer")),
                             ts_order=int(self.knob("ts_order")), scm_policy=self.knob("scm_policy"), mask=mask,
                             preset=self.preset_name, note=note, calls=int(calls), warnings=warnings)

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        parts = [f"preset={self.preset_name}"] if self.preset_name else []
        for f in ("fn", "bn", "warmup", "rdt", "mc", "max_cached_steps", "taylorseer", "ts_order", "scm_policy", "steps_mask"):
            v = getattr(self, f)
            if v is not None:
                parts.append(f"{f}={v}")
        return "on (" + ", ".join(parts or ["defaults"]) + ")"

    def to_dict(self) -> dict:
        return asdict(self)


def fit_warnings(given: List[int], used: List[int]) -> List[str]:
    """What ``masks.fit_mask`` changed in a custom steps_mask, for the run's warnings."""
    out = []
    if len(given) > len(used):
        out.append(f"Cache-DiT steps_mask has {len(given)} entries for a run of {len(used)} model calls: "
                   f"the last {len(given) - len(used)} were cut")
    elif len(given) < len(used):
        out.append(f"Cache-DiT steps_mask has {len(given)} entries for a run of {len(used)} model calls: "
                   f"padded with {len(used) - len(given)} computed calls")
    ends = [name for name, i in (("first", 0), ("last", len(used) - 1)) if used and i < len(given) and not given[i]]
    if ends:
        what = "the first and the last model call are" if len(ends) == 2 else f"the {ends[0]} model call is"
        out.append(f"Cache-DiT steps_mask: {what} always computed (a 0 there was made a 1)")
    return out


@dataclass
class ResolvedCache:
    fn: int
    bn: int
    warmup: int
    rdt: float
    mc: int
    max_cached_steps: int
    taylorseer: bool
    ts_order: int
    scm_policy: str
    mask: Optional[List[int]]
    preset: Optional[str]
    note: Optional[str]
    calls: int
    warnings: List[str] = field(default_factory=list)  # how a custom steps_mask was fitted to the run

    def tag(self) -> str:
        """cache-dit style name: F1B0_W4MC3_R0.24[_SCM..._static][_T1O1]."""
        s = f"F{self.fn}B{self.bn}_W{self.warmup}M{self.max_cached_steps}MC{self.mc}_R{self.rdt:g}"
        if self.mask is not None:
            s += f"_SCM{masks.mask_str(self.mask)}_{self.scm_policy}"
        if self.taylorseer:
            s += f"_T1O{self.ts_order}"
        return s


def from_env(env: Optional[Mapping[str, str]] = None) -> CacheConfig:
    """The cache as the ``SGLANG_CACHE_DIT_*`` variables say (declared on CacheConfig's fields; ``docs/cache_dit.md``
    lists them): ``enabled=False`` unless SGLANG_CACHE_DIT_ENABLED is true, and then the others are read."""
    env = os.environ if env is None else env
    if not from_env_of(CacheConfig, env, names=("enabled",)).get("enabled", False):
        return CacheConfig(enabled=False)
    given = from_env_of(CacheConfig, env)
    return CacheConfig(**given)


def run_config(cache) -> Optional[CacheConfig]:
    """``cache`` (a CacheConfig, checked when it was built, or None), refusing anything else. Reads no environment:
    the engine takes what its caller gives."""
    if cache is not None and not isinstance(cache, CacheConfig):
        raise CacheConfigError(f"cache must be a CacheConfig or None, got {type(cache).__name__}")
    return cache


def resolve_config(cache, env: Optional[Mapping[str, str]] = None) -> CacheConfig:
    """``cache`` if given, else the environment's: called once where a run starts from the outside (the CLI, the
    server's start, the ComfyUI nodes, the pipeline), never inside the engine."""
    return from_env(env) if cache is None else run_config(cache)


def config_from_dict(d: Mapping) -> CacheConfig:
    """A CacheConfig from a plain dict (CLI / JSON); unknown keys are an error naming them."""
    known = {f.name for f in fields(CacheConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CacheConfigError(f"unknown cache option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    return CacheConfig(**dict(d))


__all__ = ["CacheConfig", "CacheConfigError", "ResolvedCache", "from_env", "resolve_config", "run_config",
           "config_from_dict", "DEFAULTS", "FROM_PRESET", "PRESET_KNOBS"]

