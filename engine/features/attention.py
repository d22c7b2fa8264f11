"""Attention backends as one table (``BACKEND_TABLE``: sdpa, sage, flash, math; auto picks the best that
runs), chosen once at load and set as the model's ``attention`` slot by the "attention" Patch. A new
backend is one ``register_backend(Backend(...))`` (docs/architecture.md). Every backend takes q, k, v as
[B, S, heads, head_dim] and an optional boolean key mask [B, S] (True = attend). The kernels without a mask
run each padded sample on its valid keys (ERNIE-Image pads only the end of the text), which is exactly
what masked SDPA computes; they are custom ops, so compiled graphs keep them. Each sageattention
version's exactness limits and the fallbacks: docs/attention_compile_quant.md.
"""
from __future__ import annotations

import importlib.metadata
import logging
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
from torch import nn

from ..models.ernie_image import sdpa  # the model's own attention: the default backend
from . import patching
from .tables import LiveNames

log = logging.getLogger("sgld.attention")

# SageAttention 2.x's sageattn() dispatches on these compute capabilities and raises on others.
SAGE_CAPABILITIES = {(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)}
# 1.x is Triton only; its README lists Ampere, Ada and Hopper parts.
SAGE1_CAPABILITIES = {(8, 0), (8, 6), (8, 7), (8, 9), (9, 0)}
# 2.x capabilities whose sageattn() runs a CUDA kernel that masks the key tail (sm86 runs Triton).
SAGE2_MASKED_TAIL = {(8, 0), (8, 9), (9, 0), (12, 0), (12, 1)}
HALF_DTYPES = (torch.float16, torch.bfloat16)


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
@dataclass(frozen=True)
class SageLimits:
    """What one sageattention version computes exactly (see the module docstring)."""

    version: str
    head_dims: Tuple[int, ...]  # head sizes it takes (2.x pads the others up to 128 itself)
    key_block: int  # exact only when the key length is a multiple of this (1: any length)
    copies_key: bool  # it smooths K in place, so it must get a copy
    capabilities: FrozenSet[Tuple[int, int]]
    returns_lse: bool = False  # sageattn(..., return_lse=True): other key lengths split, the tail merged by LSE

    def describe(self) -> str:
        if self.key_block == 1:
            tail = "any key length"
        elif self.returns_lse:
            tail = (f"other key lengths: sage on the largest multiple of {self.key_block} keys, the rest exact sdpa, "
                    "merged by log-sum-exp")
        else:
            tail = (f"key lengths not a multiple of {self.key_block} use sdpa (its last key block is not masked and "
                    "it returns no log-sum-exp to merge an exact tail with)")
        return f"sageattention {self.version}: head_dim {self.head_dim_text()}, {tail}"

    def head_dim_text(self) -> str:
        return "/".join(map(str, self.head_dims)) if len(self.head_dims) < 8 else f"<= {max(self.head_dims)}"


def _major(version: str) -> Optional[int]:
    m = re.match(r"\s*(\d+)\.", version or "")
    return int(m.group(1)) if m else None


def sage_limits(version: str, capability: Optional[Tuple[int, int]] = None) -> SageLimits:
    """The exactness limits of sageattention ``version`` on a GPU of ``capability`` (None: unknown).
    Read from each version's source; an unknown version gets 1.x's limits, the strictest."""
    major = _major(version)
    if major == 2:
        masked = capability is not None and tuple(capability) in SAGE2_MASKED_TAIL
        return SageLimits(version, tuple(range(1, 129)), 1 if masked else 64, False, frozenset(SAGE_CAPABILITIES), True)
    return SageLimits(version, (64, 96, 128), 64, True, frozenset(SAGE1_CAPABILITIES), False)


def sage_route(limits: SageLimits, head_dim: int, key_len: Optional[int] = None) -> Optional[str]:
    """None when sageattn computes this call exactly (whole, or split with an exact tail: ``sage_split``),
    else why it must go to sdpa (``key_len`` None: only the head size is checked, as at selection)."""
    if head_dim not in limits.head_dims:
        return f"sageattention {limits.version} takes head_dim {limits.head_dim_text()}, not {head_dim}"
    if key_len is not None and key_len % limits.key_block and not sage_split(limits, key_len):
        return (f"sageattention {limits.version} does not mask its last key block and returns no log-sum-exp: "
                f"{key_len} keys is not a multiple of {limits.key_block}")
    return None


def sage_split(limits: SageLimits, key_len: int) -> int:
    """Keys the kernel takes when this call is split (0: not split): the largest multiple of its block, the
    rest exact through ``attention_lse`` and merged by log-sum-exp (``split_tail``)."""
    if key_len % limits.key_block == 0 or not limits.returns_lse or key_len < limits.key_block:
        return 0
    return key_len - key_len % limits.key_block


# -- exact tails merged by log-sum-exp ------------------------------------------------------------------------
def attention_lse(q, k, v) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact attention [B, S, H, D] and its log-sum-exp [B, H, S] (float32), for a few keys (a tail)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse[..., None]).exp(), v.float())
    return out, lse


def merge_lse(o1, l1, o2, l2) -> torch.Tensor:
    """Softmax attention over the union of two key sets from each set's output and log-sum-exp (exact)."""
    lse = torch.logaddexp(l1.float(), l2.float())
    w1 = (l1.float() - lse).exp().transpose(1, 2)[..., None]  # [B, S, H, 1]
    w2 = (l2.float() - lse).exp().transpose(1, 2)[..., None]
    return o1.float() * w1 + o2.float() * w2


def split_tail(kernel_lse: Callable, q, k, v, main: int) -> torch.Tensor:
    """``kernel_lse`` (q, k, v -> out, lse; it takes only key counts of its block) on the first ``main`` keys,
    the rest exact, merged by log-sum-exp: the attention over all keys, as a kernel without a key mask can
    give it at any length."""
    o1, l1 = kernel_lse(q, k[:, :main], v[:, :main])
    o2, l2 = attention_lse(q, k[:, main:], v[:, main:])
    return merge_lse(o1, l1, o2, l2).to(q.dtype)


def installed_version(module: str, dist: Optional[str] = None) -> str:
    """The imported package's version: its ``__version__``, else the installed distribution's metadata
    (sageattention 1.0.6 has no ``__version__``), else "unknown"."""
    mod = sys.modules.get(module)
    ver = getattr(mod, "__version__", None) if mod is not None else None
    if ver:
        return str(ver)
    for name in (dist or module, module.replace("_", "-")):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


# Calls of the sage op by where they ran (``sage`` kernel or exact ``sdpa`` fallback); the GPU check
# reports these so that a sage timing says how much of it was sage.
sage_calls: Dict[str, int] = {"sage": 0, "split": 0, "sdpa": 0}
_limits_cache: Dict[tuple, SageLimits] = {}


def _current_sage_limits(device: torch.device) -> SageLimits:
    mod = sys.modules.get("sageattention")
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    key = (id(mod), getattr(mod, "__version__", None), cap)  # the version too: an id can be reused
    if key not in _limits_cache:
        _limits_cache.clear()
        _limits_cache[key] = sage_limits(installed_version("sageattention"), cap)
    return _limits_cache[key]


def _sage_kernel(q, k, v):
    """One unpadded call: sageattn where it is exact for these shapes, else sdpa (no mask needed)."""
    from sageattention import sageattn

    limits = _current_sage_limits(q.device)
    why = sage_route(limits, q.shape[-1], k.shape[1])
    if why is not None:
        sage_calls["sdpa"] += 1
        _warn_once(f"sage-route:{why.split(':')[0]}", f"attention 'sage': {why}; these calls use sdpa")
        return sdpa(q, k, v)
    main = sage_split(limits, k.shape[1])
    if main:
        try:
            out = split_tail(lambda qq, kk, vv: _sage_lse(sageattn, limits, qq, kk, vv), q, k, v, main)
        except TypeError as e:  # a build whose sageattn takes no return_lse: exact sdpa, said once
            sage_calls["sdpa"] += 1
            _warn_once("sage-lse", f"attention 'sage': sageattn(return_lse=True) failed ({e}); such calls use sdpa")
            return sdpa(q, k, v)
        sage_calls["split"] += 1
        return out
    sage_calls["sage"] += 1
    k = k.clone() if limits.copies_key else k.contiguous()  # 1.x: ``k -= mean`` in place (smooth_k)
    return sageattn(q.contiguous(), k, v.contiguous(), tensor_layout="NHD", is_causal=False)


def _sage_lse(sageattn, limits: SageLimits, q, k, v):
    """sageattn's output and its natural-log LSE, [B, H, S] in every layout (2.x: ``return_lse``; it corrects the
    LSE for its K smoothing itself)."""
    k = k.clone() if limits.copies_key else k.contiguous()
    out, lse = sageattn(q.contiguous(), k, v.contiguous(), tensor_layout="NHD", is_causal=False, return_lse=True)
    return out, lse.float()


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

# -- availability: each backend's check ------------------------------------------------------------------------
def _package_version(module: str) -> Tuple[bool, str]:
    """Import a kernel package; (ok, version or the reason it cannot be used)."""
    try:
        __import__(module)
    except (ImportError, OSError, RuntimeError, AssertionError) as e:  # missing, or built for another torch/CUDA
        detail = (str(e).splitlines() or [""])[0][:160]
        return False, f"the '{module}' package does not import ({type(e).__name__}: {detail})"
    return True, installed_version(module)


def _pytorch(device: torch.device, dtype: torch.dtype, head_dim: int) -> Tuple[bool, str]:
    return True, "PyTorch"


def _cuda_half(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why a CUDA fp16/bf16 kernel cannot run here, or None."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU (device is {device.type})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if dtype not in HALF_DTYPES:
        return f"it needs fp16/bf16 weights (model is {str(dtype).replace('torch.', '')})"
    return None


def _check_sage(device: torch.device, dtype: torch.dtype, head_dim: int) -> Tuple[bool, str]:
    why = _cuda_half(device, dtype)
    if why is not None:
        return False, why
    cap = torch.cuda.get_device_capability(device)
    if head_dim > 128:
        return False, f"head_dim {head_dim} > 128"
    ok, ver = _package_version("sageattention")
    if not ok:
        return False, ver
    limits = sage_limits(ver, cap)
    if cap not in limits.capabilities:
        return False, f"sageattention {ver} has no kernel for compute capability sm{cap[0]}{cap[1]}"
    why = sage_route(limits, head_dim)
    if why is not None:
        return False, why
    return True, f"{limits.describe()}, on sm{cap[0]}{cap[1]}"


def _check_flash(device: torch.device, dtype: torch.dtype, head_dim: int) -> Tuple[bool, str]:
    why = _cuda_half(device, dtype)
    if why is not None:
        return False, why
    cap = torch.cuda.get_device_capability(device)
    if head_dim > 256:
        return False, f"head_dim {head_dim} > 256"
    if cap < (8, 0):
        return False, f"flash-attn 2 needs sm80+ (GPU is sm{cap[0]}{cap[1]})"
    ok, ver = _package_version("flash_attn")
    return (True, f"flash-attn {ver} on sm{cap[0]}{cap[1]}") if ok else (False, ver)


# -- the table ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """One attention backend: ``fn(q, k, v, key_mask=None)`` ([B, S, heads, head_dim], mask [B, S] True =
    attend); ``check(device, dtype, head_dim)`` -> (runs here, why); ``package``: the module whose version
    describes it (None: torch); ``auto``: its rank when "auto" chooses (higher first; 0: never chosen)."""

    name: str
    fn: Callable
    check: Callable[[torch.device, torch.dtype, int], Tuple[bool, str]]
    package: Optional[str] = None
    auto: int = 0


BACKEND_TABLE: Dict[str, Backend] = {}  # in registration order: the order of lists and messages


def register_backend(backend: Backend) -> Backend:
    if backend.name == "auto" or backend.name in BACKEND_TABLE:
        raise ValueError(f"attention backend '{backend.name}' is registered twice (or named 'auto')")
    BACKEND_TABLE[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Take a backend out of the table (tests that register one of their own); sdpa, the fallback, stays."""
    if name != "sdpa":
        BACKEND_TABLE.pop(name, None)


def backend_names() -> Tuple[str, ...]:
    """What EngineConfig.attention accepts: "auto" and every registered backend."""
    return ("auto", *BACKEND_TABLE)


for _b in (Backend("sdpa", sdpa, _pytorch), Backend("sage", sage, _check_sage, "sageattention", auto=2),
           Backend("flash", flash, _check_flash, "flash_attn", auto=1), Backend("math", math_attention, _pytorch)):
    register_backend(_b)
BACKENDS = LiveNames(backend_names)  # EngineConfig.attention's choices: the table's, read when asked
FUNCTIONS: Dict[str, Callable] = {n: b.fn for n, b in BACKEND_TABLE.items()}  # the built-ins' functions (benchmarks)


# -- selection ------------------------------------------------------------------------------------------------
def check_backend(name: str, device="cpu", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> Tuple[bool, str]:
    """Can backend ``name`` run for this device / dtype / head size? (ok, reason)."""
    backend = BACKEND_TABLE.get(name)
    if backend is None:
        return False, f"unknown backend '{name}'"
    return backend.check(torch.device(device), dtype, head_dim)


def available_backends(device="cpu", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> List[str]:
    return [n for n in BACKEND_TABLE if check_backend(n, device, dtype, head_dim)[0]]


@dataclass
class AttentionChoice:
    requested: str
    name: str  # the backend in use
    fn: Callable
    reason: str
    warnings: List[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"attention: {self.name} (requested {self.requested}; {self.reason})"

    @property
    def version(self) -> str:
        """The version of what computes it: the kernel package, or torch for sdpa / math."""
        backend = BACKEND_TABLE.get(self.name)
        package = backend.package if backend is not None else None
        return installed_version(package) if package else f"torch {torch.__version__}"


def select_backend(requested: Optional[str] = "auto", device="cpu", dtype: torch.dtype = torch.bfloat16,
                   head_dim: int = 128, log_choice: bool = True) -> AttentionChoice:
    """Choose the attention backend once; one log line says which and why. Never raises for a
    backend that cannot run here: that falls back to sdpa with a warning in ``.warnings``."""
    req = (requested or "auto").lower()
    if req not in backend_names():
        raise ValueError(f"attention '{requested}' is not supported; choose one of {', '.join(backend_names())}")
    warnings: List[str] = []
    if req == "auto":
        reasons = []
        ranked = sorted((b for b in BACKEND_TABLE.values() if b.auto > 0), key=lambda b: -b.auto)
        for backend in ranked:
            ok, why = check_backend(backend.name, device, dtype, head_dim)
            if ok:
                choice = AttentionChoice(req, backend.name, backend.fn, why)
                break
            reasons.append(f"{backend.name}: {why}")
        else:
            choice = AttentionChoice(req, "sdpa", sdpa, "best available; " + "; ".join(reasons))
    else:
        ok, why = check_backend(req, device, dtype, head_dim)
        if ok:
            choice = AttentionChoice(req, req, BACKEND_TABLE[req].fn, why)
        else:
            msg = f"attention '{req}' cannot run here ({why}); using sdpa instead"
            warnings.append(msg)
            log.warning(msg)
            choice = AttentionChoice(req, "sdpa", sdpa, f"fallback: {why}", warnings)
    if log_choice:
        log.info(choice.describe())
    return choice


class AttentionBackend(patching.Patch):
    """The "attention" Patch: the chosen backend in the model's ``attention`` slot, the one before kept."""

    name = "attention"

    def __init__(self, model: nn.Module, choice: AttentionChoice):
        super().__init__(model)
        self.choice = choice
        self.previous = patching.set_slot(model, "attention", choice.fn)

    def remove(self) -> None:
        model = self.model
        if model is not None:
            patching.set_slot(model, "attention", self.previous)

    def describe(self) -> dict:
        c = self.choice
        return {"backend": c.name, "requested": c.requested, "reason": c.reason, "version": c.version}


def apply_attention(model: nn.Module, choice: AttentionChoice) -> AttentionBackend:
    """Set ``choice`` (from ``select_backend``) as the model's attention; a backend set before is replaced."""
    patching.detach(model, "attention")
    return patching.attach(model, AttentionBackend(model, choice))


def remove_attention(model: nn.Module) -> bool:
    """The model's attention back to what it was before ``apply_attention``. False when none was set."""
    return patching.detach(model, "attention")
