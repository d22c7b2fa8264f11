"""The dtype a model computes in when its caller does not say (``--dtype`` / the loader's ``weight_dtype``
"default"): one rule for every entry point (the nodes, ``comfy_model``, the CLI, the pipeline, the server, bench).

The family's safe compute dtypes (``Family.compute_dtypes``, fastest first: ComfyUI's ``supported_inference_dtypes``;
never fp16 for a family that overflows in it), narrowed to what the device computes natively: bf16 on a GPU that
has it and on a CPU with AVX-512 BF16 or AMX (elsewhere torch emulates it, several times slower than float32),
fp16 on a GPU where the family allows it, else float32. How the weights are stored (F16 beside fp8 layers, GGUF's
F32 norms) plays no part: a file's format never drags compute to float32 or into fp16. ``SGLD_CPU_BF16=1`` / ``0``
overrides the CPU detection (docs/attention_compile_quant.md); ``cpu_int8`` tells int8's W8A8 whether this CPU's
int8 products pay (``SGLD_CPU_INT8``)."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Tuple

import torch

from . import device as device_rt

NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo: bf16 dot products in hardware
CPU_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products (torch._int_mm is fast only with them)
ENV, INT8_ENV = "SGLD_CPU_BF16", "SGLD_CPU_INT8"


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), ()))
    except OSError:  # not Linux: no flags read, float32
        return frozenset()


def _cpu_has(env: str, flags: Tuple[str, ...], what: str) -> Tuple[bool, str]:
    """(whether this CPU has one of ``flags``, why); ``env`` = 1 / 0 overrides the detection."""
    value = os.environ.get(env)
    if value is not None:
        if value not in ("0", "1"):
            raise ValueError(f"environment variable {env}={value!r} is not valid: 1 (this CPU computes {what} natively) "
                             "or 0 (it does not), or unset (read from the CPU's flags)")
        return value == "1", f"{env}={value}"
    found = [f for f in flags if f in _cpu_flags()]
    return (True, f"the CPU has {found[0]}") if found else (False, f"no {'/'.join(flags)} on this CPU")


def cpu_bf16() -> Tuple[bool, str]:
    """(whether this CPU computes bf16 natively, why): else torch emulates it, several times slower than float32."""
    return _cpu_has(ENV, CPU_BF16_FLAGS, "bf16")


def cpu_int8() -> Tuple[bool, str]:
    """(whether this CPU has int8 dot products, why): without them torch._int_mm is ~20x slower than a float GEMM."""
    return _cpu_has(INT8_ENV, CPU_INT8_FLAGS, "int8 products")


def native(dtype: torch.dtype, device: torch.device) -> Tuple[bool, str]:
    """(whether ``device`` computes ``dtype`` natively, why)."""
    if device.type == "cpu":
        if dtype == torch.bfloat16:
            return cpu_bf16()
        return dtype == torch.float32, "" if dtype == torch.float32 else "a CPU emulates fp16"
    if device.type == "cuda" and dtype == torch.bfloat16:
        if not device_rt.available():  # no driver: a rehearsal on fake tensors, of a card of the release's dtype
            return True, "a CUDA device"
        major, minor = device_rt.capability(device)
        return major >= 8, f"a GPU of compute capability {major}.{minor}: bf16 {'native' if major >= 8 else 'from 8.0'}"
    return True, ""


def default_compute_dtype(family, device) -> Tuple[str, str]:
    """(dtype name, why) the family's model computes in on ``device`` when nobody says."""
    device = torch.device(device)
    skipped = []
    for dtype in family.compute_dtypes:
        ok, why = native(dtype, device)
        if ok:
            said = f" ({why})" if why else ""
            return NAMES[dtype], f"the default for {family.title} on {device.type}{said}" + "".join(skipped)
        skipped.append(f"; {NAMES[dtype]} not native ({why})")
    return "fp32", f"the default for {family.title} on {device.type}" + "".join(skipped)


def with_compute_dtype(config, family) -> Tuple[object, str]:
    """(``config`` with its dtype decided, why): an EngineConfig whose dtype is None takes the rule's for its
    device; one given stays."""
    if config.dtype is not None or family is None:  # no family: the load names the file and what it is instead
        return config, f"asked for ({config.dtype})" if config.dtype else "as stored"
    dtype, why = default_compute_dtype(family, config.device)
    return dataclasses.replace(config, dtype=dtype), why
