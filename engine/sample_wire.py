"""The POST /v1/sample wire format, in one place: encoded by the remote KSampler (nodes/server_nodes.py) and
decoded by the server's route (engine/serve/sample_route.py). A ``SampleRequest`` travels; its settings are
``SamplingOptions``' fields by their names, so a new sampling option crosses the wire with no change here.

Request body: safetensors bytes (never a pickle) with the float32 tensors ``latent`` [C, h, w] or [B, C, h, w],
``cond`` [T, C_text], optionally ``uncond`` [T', C_text], ``noise_mask`` (a LATENT's mask, any size) and
``sigmas`` [steps + 1]; in the safetensors metadata, under ``sgld``, a JSON object of the settings: the sampling
options (seed, steps and cfg required), ``batch_index``, ``cache`` (a preset name, "off", an object of
CacheConfig fields, or null for the server's) and ``loras`` (``lora_setting``: the per-request LoRAs by name,
the rule /v1/images/generations' field shares). The answer's latent: base64 of safetensors bytes holding the
float32 tensor ``latent``.

Plain Python, torch and safetensors only: the nodes import it inside ComfyUI, where the server's packages are not.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .errors import CheckpointError
from .features.cache import ALL_PRESETS, CacheConfig, CacheConfigError
from .features.cache.config import config_from_dict
from .features.cache.masks import canonical_preset
from .io.safetensors import load_json_object
from .options import declared
from .sampling import cfg_on
from .sampling_options import SampleRequest, SamplingOptions

PATH = "/v1/sample"
METADATA_KEY = "sgld"
TENSORS = ("latent", "cond", "uncond", "noise_mask", "sigmas")
REQUIRED = ("seed", "steps", "cfg")  # the sampling options a body must give (the others: their declared defaults)
EXTRAS = ("batch_index", "cache", "loras")  # the settings besides the sampling options
MAX_LORAS = 8  # entries of a request's loras
MAX_LORA_NAME = 512  # characters of a LoRA's name (a path inside the server's --lora-dir, or a nickname)
MAX_LORA_STRENGTH = 100.0  # |strength|, as the LoRA Loader node's widget
MAX_HEADER = 100_000  # bytes of safetensors header: five tensors and a few settings need far less
CACHE_OFF = ("off", "none")
_KINDS = {int: "a valid integer", float: "a valid number", str: "a valid string"}


class WireError(ValueError):
    """A body that is not a /v1/sample request: ``param`` the field at fault (None: the body), ``code`` the
    OpenAI error code the server answers with."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_body"):
        super().__init__(message)
        self.param, self.code = param, code


def settings_fields() -> tuple:
    """The names the settings object may hold, in order."""
    return tuple(declared(SamplingOptions)) + EXTRAS


# -- encoding (the remote KSampler) -----------------------------------------------------------------------
def _f32(t) -> torch.Tensor:
    return torch.as_tensor(t).detach().to("cpu", torch.float32).contiguous()


def encode(request: SampleRequest) -> bytes:
    """The body for ``request``: its ``cond`` / ``uncond`` one tensor [T, C] each (or a list of one), its
    ``noise`` not sent (the server draws the seed's). The server checks every value, as the local engine does."""
    def one(value):
        return value[0] if isinstance(value, (list, tuple)) else value

    options = request.options
    tensors = {"latent": _f32(request.latent), "cond": _f32(one(request.cond))}
    if cfg_on(options.cfg, request.uncond):
        tensors["uncond"] = _f32(one(request.uncond))
    if request.noise_mask is not None:
        tensors["noise_mask"] = _f32(request.noise_mask)
    if request.sigmas is not None:
        tensors["sigmas"] = _f32(request.sigmas).reshape(-1)
    settings = {}
    for name, opt in declared(SamplingOptions).items():
        value = getattr(options, name)
        if value is not None:
            settings[name] = opt.kind(value) if opt.kind in (int, float) else value
    settings["cache"] = None if request.cache is None else dataclasses.asdict(request.cache)
    if request.batch_index is not None:
        settings["batch_index"] = list(request.batch_index)
    if request.loras is not None:
        settings["loras"] = [{"name": name, "strength": float(strength)} for name, strength in request.loras]
    return save_tensors(tensors, metadata={METADATA_KEY: json.dumps(settings)})


def encode_latent(latent: torch.Tensor) -> str:
    """The answer's latent: base64 of safetensors bytes holding ``latent``."""
    return base64.b64encode(save_tensors({"latent": latent.contiguous()})).decode("ascii")


def decode_latent(text: str) -> torch.Tensor:
    return load_tensors(base64.b64decode(text))["latent"]


# -- decoding (the server's route) --------------------------------------------------------------------------
def _bad_body(message: str) -> WireError:
    return WireError(f"the body of {PATH} must be safetensors bytes (latent, cond, optional uncond, noise_mask, "
                     f"sigmas; settings in the metadata key '{METADATA_KEY}'): {message}")


def _header(body: bytes) -> dict:
    """The safetensors header, read strictly (its length, JSON without repeated keys) before any tensor is."""
    if len(body) < 8:
        raise _bad_body(f"{len(body)} bytes is too short")
    size = int.from_bytes(body[:8], "little")
    if size < 2 or body[8:9] != b"{":
        raise _bad_body("no safetensors header at the start (a pickle or another format?)")
    if size > MAX_HEADER:
        raise _bad_body(f"its header is {size} bytes, more than the {MAX_HEADER} this endpoint reads (three tensors "
                        "and the settings need a few hundred)")
    if size > len(body) - 8:
        raise _bad_body(f"its header length {size} does not fit the {len(body)}-byte body (a truncated body?)")
    try:
        return load_json_object(body[8:8 + size], "the safetensors header")
    except CheckpointError as e:
        raise _bad_body(str(e)) from None


def _invalid(name: str, what: str, value) -> WireError:
    return WireError(f"{name}: Input should be {what} (got {value!r:.80})", name, "invalid_value")


def _strict(name: str, kind: type, value):
    """``value`` as the settings' JSON must hold it: no "5" for 5, no 1.0 for an integer, no true for a number."""
    ok = (not isinstance(value, bool) and (isinstance(value, int) if kind is int else
                                           isinstance(value, (int, float)) if kind is float else isinstance(value, kind)))
    if not ok:
        raise _invalid(name, _KINDS.get(kind, kind.__name__), value)
    return float(value) if kind is float else value


def cache_setting(value) -> Optional[CacheConfig]:
    """A request's cache: None (the server's), "off", a preset name, or an object of CacheConfig fields."""
    if value is None:
        return None
    if isinstance(value, dict):
        try:
            return config_from_dict(value)
        except (CacheConfigError, TypeError, ValueError) as e:
            raise WireError(f"cache: {e}", "cache", "invalid_value") from None
    if not isinstance(value, str):
        raise _invalid("cache", "a preset name, 'off', an object of cache fields or null", value)
    if value.strip().lower() in CACHE_OFF:
        return CacheConfig(enabled=False)
    if canonical_preset(value) not in ALL_PRESETS:
        raise WireError(f"cache must be a preset ({', '.join(ALL_PRESETS)}) or 'off' (got {value!r:.40})", "cache",
                        "invalid_value")
    return CacheConfig(enabled=True, preset=canonical_preset(value))


def lora_setting(value) -> Optional[tuple]:
    """A request's ``loras``: None (the server's active set), or a list of at most MAX_LORAS objects ``{"name":
    a LoRA of the server's --lora-dir (a path inside it, or a nickname /v1/set_lora gave), "strength": a finite
    number from -MAX_LORA_STRENGTH to MAX_LORA_STRENGTH (default 1)}``, each name once ([]: no LoRA at all).
    ((name, strength), ...); WireError naming the entry."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise _invalid("loras", 'a list of {"name", "strength"} objects or null', value)
    if len(value) > MAX_LORAS:
        raise WireError(f"loras: at most {MAX_LORAS} LoRAs per request (got {len(value)})", "loras", "invalid_value")
    out, seen = [], set()
    for i, item in enumerate(value):
        where = f"loras[{i}]"
        if not isinstance(item, dict) or "name" not in item or set(item) - {"name", "strength"}:
            raise _invalid(where, 'an object {"name": ..., "strength": ...} (strength optional, default 1)', item)
        name, strength = item["name"], item.get("strength", 1.0)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME or not name.isprintable():
            raise _invalid(where + ".name", f"a LoRA name of 1 to {MAX_LORA_NAME} printable characters", name)
        strength = _strict(where + ".strength", float, strength)
        if not math.isfinite(strength) or abs(strength) > MAX_LORA_STRENGTH:
            raise _invalid(where + ".strength", f"a finite number from -{MAX_LORA_STRENGTH:g} to {MAX_LORA_STRENGTH:g}",
                           strength)
        if name in seen:
            raise WireError(f"{where}.name: '{name:.80}' is named twice; give each LoRA once", "loras", "invalid_value")
        seen.add(name)
        out.append((name, strength))
    return tuple(out)


def _settings(raw) -> tuple:
    """(SamplingOptions, batch_index, cache, loras) of the settings object; WireError naming the field."""
    if not isinstance(raw, dict):
        raise WireError("the request body must be a JSON object", code="invalid_json")
    allowed = settings_fields()
    for name in raw:
        if name not in allowed:
            raise WireError(f"'{name}' is not a field of this endpoint (its fields: {', '.join(allowed)})", name,
                            "unknown_field")
    for name in REQUIRED:
        if name not in raw:
            raise WireError(f"{name}: Field required (got {raw!r:.80})", name, "invalid_value")
    options = {name: _strict(name, opt.kind, raw[name]) for name, opt in declared(SamplingOptions).items()
               if name in raw}
    index = raw.get("batch_index")
    if index is not None and not (isinstance(index, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                                 for i in index)):
        raise _invalid("batch_index", "a valid list of integers", index)
    return SamplingOptions(**options), index, cache_setting(raw.get("cache")), lora_setting(raw.get("loras"))


def decode(body: bytes) -> SampleRequest:
    """The body as a request; WireError naming what is wrong (its tensors are read only once the header and the
    settings are right)."""
    header = _header(body)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise _bad_body(f"'__metadata__' must be a JSON object of strings (got {json.dumps(metadata)[:40]})")
    unknown = sorted(set(header) - set(TENSORS))
    if unknown:
        raise _bad_body(f"unknown tensor(s) {', '.join(unknown)[:200]}")
    for name in ("latent", "cond"):
        if name not in header:
            raise _bad_body(f"the tensor '{name}' is missing")
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") != "F32":
            raise _bad_body(f"the tensor '{name}' must be float32 (F32), not "
                            f"{info.get('dtype') if isinstance(info, dict) else info!r:.20}")
    if METADATA_KEY not in metadata:
        raise _bad_body(f"the metadata key '{METADATA_KEY}' (the run's settings as JSON) is missing")
    try:
        raw = load_json_object(metadata[METADATA_KEY], f"metadata '{METADATA_KEY}'")
    except CheckpointError as e:
        raise _bad_body(str(e)) from None
    options, batch_index, cache, loras = _settings(raw)
    try:
        tensors = load_tensors(body)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise _bad_body(str(e)[:200]) from None
    return SampleRequest.from_options(tensors["latent"], tensors["cond"], tensors.get("uncond"), options,
                                      sigmas=tensors.get("sigmas"), noise_mask=tensors.get("noise_mask"),
                                      batch_index=batch_index, cache=cache, loras=loras)
