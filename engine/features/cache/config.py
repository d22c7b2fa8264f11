"""Cache-DiT options: ``CacheConfig`` (what nodes, CLI and EngineConfig pass), presets, and the
``SGLANG_CACHE_DIT_*`` environment switches.

Precedence: an explicit ``CacheConfig`` (node / ``Engine.sample(cache=...)`` / ``EngineConfig.cache``)
wins over the environment; inside one config an explicitly set knob wins over the preset's value,
which wins over the DBCache defaults (SGLang's: F1B0, warm-up 4, rdt 0.24, MC 3, TaylorSeer off).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import List, Mapping, Optional

from . import masks
from ...errors import CacheConfigError

ENV_PREFIX = "SGLANG_CACHE_DIT_"
POLICIES = ("static", "dynamic")
TS_ORDERS = (1, 2)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


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


@dataclass(frozen=True)
class CacheConfig:
    """Cache-DiT settings for one run. ``None`` knobs take the preset's value, then the default.

    enabled      master switch (``CacheConfig(enabled=False)`` disables even if the environment says on)
    preset       quality | balanced | fast (users' names), or cache-dit's slow | medium | ultra; None = no mask
    fn, bn       first / last blocks always computed (DBCache F and B)
    warmup       leading steps always computed (ignored when a mask is set: the mask has its own)
    rdt          residual-diff threshold (relative L1 of the first blocks' residual); <= 0 never caches
    mc           max consecutive cached steps (-1 = unlimited)
    max_cached_steps  max cached steps per run (-1 = unlimited)
    taylorseer, ts_order  TaylorSeer prediction of the skipped residual, order 1 or 2
    scm_policy   static (mask zeros are always cached) | dynamic (mask zeros still pass rdt / mc)
    steps_mask   custom mask "1110101..." (1 = compute) instead of a preset
    """

    enabled: bool = True
    preset: Optional[str] = None
    fn: Optional[int] = None
    bn: Optional[int] = None
    warmup: Optional[int] = None
    rdt: Optional[float] = None
    mc: Optional[int] = None
    max_cached_steps: Optional[int] = None
    taylorseer: Optional[bool] = None
    ts_order: Optional[int] = None
    scm_policy: Optional[str] = None
    steps_mask: Optional[str] = None

    # -- validation ----------------------------------------------------------------------------
    def validate(self, names: Optional[Mapping[str, str]] = None) -> "CacheConfig":
        """Raise CacheConfigError naming the field (or the env variable from ``names``) on a bad value."""
        names = names or {}

        def bad(f: str, value, allowed: str):
            if f in names:  # an environment variable: show the text as it was set
                raise CacheConfigError(f"{names[f]}={str(value)!r} is not valid; allowed: {allowed}")
            raise CacheConfigError(f"cache option {f!r} = {value!r} is not valid; allowed: {allowed}")

        if self.preset is not None:
            p = str(self.preset).strip().lower()
            if p not in ("", "none") and p not in masks.ALL_PRESETS:
                bad("preset", self.preset, "none, " + ", ".join(masks.ALL_PRESETS))
        ints = {"fn": (1, "an integer >= 1"), "bn": (0, "an integer >= 0"), "warmup": (0, "an integer >= 0"),
                "mc": (-1, "an integer >= -1 (-1 = unlimited)"), "max_cached_steps": (-1, "an integer >= -1 (-1 = unlimited)")}
        for f, (lo, allowed) in ints.items():
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                bad(f, v, allowed)
        if self.rdt is not None:
            if isinstance(self.rdt, bool) or not isinstance(self.rdt, (int, float)) or not (self.rdt >= 0):
                bad("rdt", self.rdt, "a number >= 0 (e.g. 0.08 .. 0.6; 0 = never cache, >= 1 = always cache)")
        if self.ts_order is not None and self.ts_order not in TS_ORDERS:
            bad("ts_order", self.ts_order, "1, 2")
        if self.scm_policy is not None and self.scm_policy not in POLICIES:
            bad("scm_policy", self.scm_policy, ", ".join(POLICIES))
        if self.taylorseer is not None and not isinstance(self.taylorseer, bool):
            bad("taylorseer", self.taylorseer, "true, false")
        if self.steps_mask is not None and str(self.steps_mask).strip():
            try:
                masks.parse_mask(self.steps_mask)
            except ValueError:
                bad("steps_mask", self.steps_mask, "a string of 0 and 1, one per model call (1 = compute)")
        return self

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
        self.validate()
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


ENV_NAMES = {
    "preset": ENV_PREFIX + "SCM_PRESET", "fn": ENV_PREFIX + "FN", "bn": ENV_PREFIX + "BN", "warmup": ENV_PREFIX + "WARMUP",
    "rdt": ENV_PREFIX + "RDT", "mc": ENV_PREFIX + "MC", "taylorseer": ENV_PREFIX + "TAYLORSEER",
    "ts_order": ENV_PREFIX + "TS_ORDER", "scm_policy": ENV_PREFIX + "SCM_POLICY",
    "max_cached_steps": ENV_PREFIX + "MAX_CACHED_STEPS", "steps_mask": ENV_PREFIX + "SCM_MASK",
}


def _env_bool(env: Mapping[str, str], name: str) -> Optional[bool]:
    raw = env.get(name)
    if raw is None:
        return None
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise CacheConfigError(f"{name}={raw!r} is not valid; allowed: true, false (also 1/0, yes/no, on/off)")


def _env_int(env: Mapping[str, str], name: str, allowed: str) -> Optional[int]:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise CacheConfigError(f"{name}={raw!r} is not valid; allowed: {allowed}") from None


def from_env(env: Optional[Mapping[str, str]] = None) -> CacheConfig:
    """The cache as the ``SGLANG_CACHE_DIT_*`` variables say (``enabled=False`` unless ENABLED is true).

    SGLANG_CACHE_DIT_ENABLED     true | false (default false)
    SGLANG_CACHE_DIT_SCM_PRESET  none | quality | balanced | fast | slow | medium | ultra
    SGLANG_CACHE_DIT_FN / _BN / _WARMUP / _MC / _MAX_CACHED_STEPS   integers
    SGLANG_CACHE_DIT_RDT         number >= 0
    SGLANG_CACHE_DIT_TAYLORSEER  true | false;  SGLANG_CACHE_DIT_TS_ORDER 1 | 2
    SGLANG_CACHE_DIT_SCM_POLICY  static | dynamic;  SGLANG_CACHE_DIT_SCM_MASK custom "1101..." mask
    """
    env = os.environ if env is None else env
    enabled = _env_bool(env, ENV_PREFIX + "ENABLED")
    if not enabled:
        return CacheConfig(enabled=False)
    kw = {}
    preset = env.get(ENV_NAMES["preset"])
    if preset is not None and preset.strip():
        kw["preset"] = preset.strip().lower()
    kw["fn"] = _env_int(env, ENV_NAMES["fn"], "an integer >= 1")
    kw["bn"] = _env_int(env, ENV_NAMES["bn"], "an integer >= 0")
    kw["warmup"] = _env_int(env, ENV_NAMES["warmup"], "an integer >= 0")
    kw["mc"] = _env_int(env, ENV_NAMES["mc"], "an integer >= -1 (-1 = unlimited)")
    kw["max_cached_steps"] = _env_int(env, ENV_NAMES["max_cached_steps"], "an integer >= -1 (-1 = unlimited)")
    raw = env.get(ENV_NAMES["rdt"])
    if raw is not None and raw.strip():
        try:
            kw["rdt"] = float(raw.strip())
        except ValueError:
            raise CacheConfigError(f"{ENV_NAMES['rdt']}={raw!r} is not valid; allowed: a number >= 0 (e.g. 0.24)") from None
    kw["taylorseer"] = _env_bool(env, ENV_NAMES["taylorseer"])
    kw["ts_order"] = _env_int(env, ENV_NAMES["ts_order"], "1, 2")
    pol = env.get(ENV_NAMES["scm_policy"])
    if pol is not None and pol.strip():
        kw["scm_policy"] = pol.strip().lower()
    m = env.get(ENV_NAMES["steps_mask"])
    if m is not None and m.strip():
        kw["steps_mask"] = m.strip()
    cfg = CacheConfig(enabled=True, **kw)
    cfg.validate(names={f: n for f, n in ENV_NAMES.items()})
    return cfg


def resolve_config(cache: Optional[CacheConfig], env: Optional[Mapping[str, str]] = None) -> CacheConfig:
    """``cache`` if given (validated), else the environment's."""
    if cache is None:
        return from_env(env)
    if not isinstance(cache, CacheConfig):
        raise CacheConfigError(f"cache must be a CacheConfig or None, got {type(cache).__name__}")
    return cache.validate() if cache.enabled else cache


def config_from_dict(d: Mapping) -> CacheConfig:
    """A CacheConfig from a plain dict (CLI / JSON); unknown keys are an error naming them."""
    known = {f.name for f in fields(CacheConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CacheConfigError(f"unknown cache option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    return CacheConfig(**dict(d)).validate()


__all__ = ["CacheConfig", "CacheConfigError", "ResolvedCache", "from_env", "resolve_config", "config_from_dict",
           "ENV_NAMES", "ENV_PREFIX", "DEFAULTS", "PRESET_KNOBS"]


# -- command-line flags (for `sgld generate` / `sgld bench`) ------------------------------------------

def add_cli_arguments(parser) -> None:
    """Add --cache-* flags to an argparse parser; ``from_cli_args`` turns them into a CacheConfig."""
    g = parser.add_argument_group("Cache-DiT (default: the SGLANG_CACHE_DIT_* environment)")
    g.add_argument("--cache", choices=["on", "off"], default=None, help="switch the cache on or off (overrides the environment)")
    g.add_argument("--cache-preset", default=None, help="none | quality | balanced | fast | slow | medium | ultra (implies --cache on)")
    g.add_argument("--cache-fn", type=int, default=None, help="first blocks always computed")
    g.add_argument("--cache-bn", type=int, default=None, help="last blocks always computed")
    g.add_argument("--cache-warmup", type=int, default=None, help="leading steps always computed")
    g.add_argument("--cache-rdt", type=float, default=None, help="residual-diff threshold")
    g.add_argument("--cache-mc", type=int, default=None, help="max consecutive cached steps (-1 = unlimited)")
    g.add_argument("--cache-max-cached", type=int, default=None, help="max cached steps per run (-1 = unlimited)")
    g.add_argument("--cache-taylorseer", choices=["on", "off"], default=None, help="TaylorSeer prediction of the reused residual")
    g.add_argument("--cache-ts-order", type=int, default=None, help="TaylorSeer order: 1 or 2")
    g.add_argument("--cache-policy", default=None, help="static | dynamic (how a preset's mask is applied)")
    g.add_argument("--cache-mask", default=None, help="custom step mask, e.g. 1111010101 (1 = compute)")


CLI_NAMES = {"preset": "--cache-preset", "fn": "--cache-fn", "bn": "--cache-bn", "warmup": "--cache-warmup",
             "rdt": "--cache-rdt", "mc": "--cache-mc", "max_cached_steps": "--cache-max-cached",
             "taylorseer": "--cache-taylorseer", "ts_order": "--cache-ts-order", "scm_policy": "--cache-policy",
             "steps_mask": "--cache-mask"}


def from_cli_args(args) -> Optional[CacheConfig]:
    """None when no --cache* flag was given (the environment decides), else an explicit CacheConfig."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    kw = {"preset": get("cache_preset"), "fn": get("cache_fn"), "bn": get("cache_bn"), "warmup": get("cache_warmup"),
          "rdt": get("cache_rdt"), "mc": get("cache_mc"), "max_cached_steps": get("cache_max_cached"),
          "ts_order": get("cache_ts_order"), "scm_policy": get("cache_policy"), "steps_mask": get("cache_mask")}
    if get("cache_taylorseer") is not None:
        kw["taylorseer"] = get("cache_taylorseer") == "on"
    switch = get("cache")
    if switch is None and all(v is None for v in kw.values()):
        return None
    if switch == "off":
        return CacheConfig(enabled=False)
    if isinstance(kw["preset"], str):
        kw["preset"] = kw["preset"].strip().lower()
    if isinstance(kw["scm_policy"], str):
        kw["scm_policy"] = kw["scm_policy"].strip().lower()
    return CacheConfig(enabled=True, **kw).validate(names=CLI_NAMES)
