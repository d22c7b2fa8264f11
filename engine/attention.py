"""Attention backends. Every backend takes q, k, v as [B, S, heads, head_dim] and an optional
boolean key mask [B, S] (True = attend) and returns [B, S, heads, head_dim].

Backends
  sdpa   ``torch.nn.functional.scaled_dot_product_attention`` (default on CPU; on CUDA torch picks
         its own flash / cuDNN / memory-efficient kernel). Handles the key mask natively.
  sage   SageAttention (``sageattention.sageattn``, INT8 QK / FP8 PV kernels): CUDA only, on the
         architectures its dispatcher supports (sm80, sm86, sm89, sm90, sm120, sm121), fp16/bf16,
         head_dim <= 128.
  flash  FlashAttention 2 (``flash_attn.flash_attn_func``): CUDA sm80+, fp16/bf16, head_dim <= 256.
  math   a pure-PyTorch reference (softmax in float32); slow, for tests and debugging.
  auto   the best that can run: sage, then flash, then sdpa.

Masks. Neither SageAttention nor ``flash_attn_func`` takes a mask. ERNIE-Image pads only the text
at the end of the sequence, so a sample's valid keys are always a prefix ``[0, L_i)``. These two
backends therefore run each padded sample separately with all of its queries against its first
``L_i`` keys (unpadded per sample). That is exactly what masked SDPA computes, also for the padded
query rows. A mask that is not such a prefix (no ERNIE-Image input makes one) goes to SDPA.

Selection happens once, at load (``select_backend``), with one log line saying which backend and
why; a requested backend that cannot run here falls back to ``sdpa`` and the reason is returned as
a warning (``AttentionChoice.warnings``, collected into ``Engine.warnings`` for the node and CLI).
Inputs that a selected backend cannot take at call time (e.g. float32 activations) go to SDPA with
a warning logged once.

External kernels are registered as ``torch.library.custom_op`` with a fake implementation, so
``torch.compile`` treats them as opaque ops instead of breaking the graph (engine/compile.py).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

log = logging.getLogger("sgld.attention")

BACKENDS = ("auto", "sdpa", "sage", "flash", "math")
# SageAttention's sageattn() dispatches on these compute capabilities and raises on others.
SAGE_CAPABILITIES = {(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)}
HALF_DTYPES = (torch.float16, torch.bfloat16)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference attention in plain PyTorch ops, softmax in float32."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)


# -- unpadded-per-sample helper (for backends without masks) --------------------------------------------
def prefix_lengths(key_mask: torch.Tensor) -> Optional[List[int]]:
    """Valid-key counts per sample when every row of the mask is a prefix of True, else None."""
    lens = key_mask.sum(dim=1)
    ar = torch.arange(key_mask.shape[1], device=key_mask.device)
    if not bool((key_mask == (ar[None] < lens[:, None])).all()):  # one host sync per call
        return None
    return [int(x) for x in lens.tolist()]


def _per_sample(kernel: Callable, q, k, v, key_mask) -> torch.Tensor:
    """Run ``kernel(q, k, v)`` ([B, S, H, D], no mask) per sample on each sample's valid keys."""
    if key_mask is None:
        return kernel(q, k, v)
    lens = prefix_lengths(key_mask)
    if lens is None:
        return sdpa(q, k, v, key_mask)
    s = k.shape[1]
    if all(n == s for n in lens):
        return kernel(q, k, v)
    outs = [kernel(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]) for i, n in enumerate(lens)]
    return torch.cat(outs, dim=0)


# -- SageAttention ------------------------------------------------------------------------------------------
def _sage_kernel(q, k, v):
    from sageattention import sageattn

    return sageattn(q.contiguous(), k.contiguous(), v.contiguous(), tensor_layout="NHD", is_causal=False)


@torch.library.custom_op("sgld::sage_attention", mutates_args=())
def _sage_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    return _per_sample(_sage_kernel, q, k, v, key_mask).contiguous()


@_sage_op.register_fake
def _(q, k, v, key_mask):
    return q.new_empty(q.shape)  # contiguous, like the real op


# -- FlashAttention 2 ---------------------------------------------------------------------------------------
def _flash_kernel(q, k, v):
    from flash_attn import flash_attn_func

    return flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=False)


@torch.library.custom_op("sgld::flash_attention", mutates_args=())
def _flash_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    return _per_sample(_flash_kernel, q, k, v, key_mask).contiguous()


@_flash_op.register_fake
def _(q, k, v, key_mask):
    return q.new_empty(q.shape)


_warned: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _guarded(name: str, op: Callable, max_head_dim: int) -> Callable:
    """Call-time guard: inputs the kernel cannot take (dtype, device, head size) go to SDPA."""

    def attention(q, k, v, key_mask=None):
        if q.dtype not in HALF_DTYPES or q.device.type != "cuda" or q.shape[-1] > max_head_dim:
            _warn_once(f"{name}:{q.dtype}:{q.device.type}:{q.shape[-1]}",
                       f"attention '{name}' cannot take {str(q.dtype).replace('torch.', '')} inputs on {q.device.type} "
                       f"with head_dim {q.shape[-1]}: these calls use sdpa")
            return sdpa(q, k, v, key_mask)
        return op(q, k, v, key_mask)

    attention.__name__ = f"{name}_attention"
    attention.__qualname__ = attention.__name__
    return attention


sage = _guarded("sage", _sage_op, 128)
flash = _guarded("flash", _flash_op, 256)

FUNCTIONS: Dict[str, Callable] = {"sdpa": sdpa, "sage": sage, "flash": flash, "math": math_attention}


# -- availability and selection -----------------------------------------------------------------------------
def _package_version(module: str) -> Tuple[bool, str]:
    """Import a kernel package; (ok, version or the reason it cannot be used)."""
    try:
        mod = __import__(module)
    except (ImportError, OSError, RuntimeError) as e:  # missing, or a wheel built for another torch/CUDA
        detail = (str(e).splitlines() or [""])[0][:160]
        return False, f"the '{module}' package does not import ({type(e).__name__}: {detail})"
    return True, str(getattr(mod, "__version__", "?"))


def check_backend(name: str, device="cpu", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> Tuple[bool, str]:
    """Can backend ``name`` run for this device / dtype / head size? (ok, reason)."""
    device = torch.device(device)
    dt = str(dtype).replace("torch.", "")
    if name in ("sdpa", "math"):
        return True, "PyTorch"
    if name not in ("sage", "flash"):
        return False, f"unknown backend '{name}'"
    if device.type != "cuda":
        return False, f"it needs a CUDA GPU (device is {device.type})"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if dtype not in HALF_DTYPES:
        return False, f"it needs fp16/bf16 weights (model is {dt})"
    cap = torch.cuda.get_device_capability(device)
    if name == "sage":
        if head_dim > 128:
            return False, f"head_dim {head_dim} > 128"
        if cap not in SAGE_CAPABILITIES:
            return False, f"sageattn has no kernel for compute capability sm{cap[0]}{cap[1]}"
        ok, ver = _package_version("sageattention")
        return (True, f"sageattention {ver} on sm{cap[0]}{cap[1]}") if ok else (False, ver)
    if head_dim > 256:
        return False, f"head_dim {head_dim} > 256"
    if cap < (8, 0):
        return False, f"flash-attn 2 needs sm80+ (GPU is sm{cap[0]}{cap[1]})"
    ok, ver = _package_version("flash_attn")
    return (True, f"flash-attn {ver} on sm{cap[0]}{cap[1]}") if ok else (False, ver)


def available_backends(device="cpu", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> List[str]:
    return [n for n in ("sdpa", "sage", "flash", "math") if check_backend(n, device, dtype, head_dim)[0]]


@dataclass
class AttentionChoice:
    requested: str
    name: str  # the backend in use
    fn: Callable
    reason: str
    warnings: List[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"attention: {self.name} (requested {self.requested}; {self.reason})"


def select_backend(requested: Optional[str] = "auto", device="cpu", dtype: torch.dtype = torch.bfloat16,
                   head_dim: int = 128, log_choice: bool = True) -> AttentionChoice:
    """Choose the attention backend once; one log line says which and why. Never raises for a
    backend that cannot run here: that falls back to sdpa with a warning in ``.warnings``."""
    req = (requested or "auto").lower()
    if req not in BACKENDS:
        raise ValueError(f"attention '{requested}' is not supported; choose one of {', '.join(BACKENDS)}")
    warnings: List[str] = []
    if req == "auto":
        reasons = []
        for name in ("sage", "flash"):
            ok, why = check_backend(name, device, dtype, head_dim)
            if ok:
                choice = AttentionChoice(req, name, FUNCTIONS[name], why)
                break
            reasons.append(f"{name}: {why}")
        else:
            choice = AttentionChoice(req, "sdpa", sdpa, "best available; " + "; ".join(reasons))
    else:
        ok, why = check_backend(req, device, dtype, head_dim)
        if ok:
            choice = AttentionChoice(req, req, FUNCTIONS[req], why)
        else:
            msg = f"attention '{req}' cannot run here ({why}); using sdpa instead"
            warnings.append(msg)
            log.warning(msg)
            choice = AttentionChoice(req, "sdpa", sdpa, f"fallback: {why}", warnings)
    if log_choice:
        log.info(choice.describe())
    return choice
