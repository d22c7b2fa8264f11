"""The ``sage`` backend: SageAttention within the installed version's exactness limits (``SageLimits``, read from
each version's source: docs/attention_compile_quant.md), as a custom op run per sample on its valid keys, and as
an attention-with-LSE kernel for ring attention's blocks where the version returns the log-sum-exp (2.x)."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Optional, Tuple

import torch

from ... import device as device_rt
from ...models.family import sdpa
from .kernels import attention_op, cuda_half_problem, guarded, installed_version, package_version, warn_once
from .lse import attention_with_lse, split_tail

# SageAttention 2.x's sageattn() dispatches on these compute capabilities and raises on others.
SAGE_CAPABILITIES = {(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)}
# 1.x is Triton only; its README lists Ampere, Ada and Hopper parts.
SAGE1_CAPABILITIES = {(8, 0), (8, 6), (8, 7), (8, 9), (9, 0)}
# 2.x capabilities whose sageattn() runs a CUDA kernel that masks the key tail (sm86 runs Triton).
SAGE2_MASKED_TAIL = {(8, 0), (8, 9), (9, 0), (12, 0), (12, 1)}

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
    rest exact through ``attention_with_lse`` and merged by log-sum-exp (``split_tail``)."""
    if key_len % limits.key_block == 0 or not limits.returns_lse or key_len < limits.key_block:
        return 0
    return key_len - key_len % limits.key_block


def check_sage(device: torch.device, dtype: torch.dtype, head_dim: int) -> Tuple[bool, str]:
    why = cuda_half_problem(device, dtype, head_dim, 128)
    if why is not None:
        return False, why
    cap = device_rt.capability(device)
    ok, ver = package_version("sageattention")
    if not ok:
        return False, ver
    limits = sage_limits(ver, cap)
    if cap not in limits.capabilities:
        return False, f"sageattention {ver} has no kernel for compute capability sm{cap[0]}{cap[1]}"
    why = sage_route(limits, head_dim)
    if why is not None:
        return False, why
    return True, f"{limits.describe()}, on sm{cap[0]}{cap[1]}"


# Calls of the sage op by where they ran (``sage`` kernel or exact ``sdpa`` fallback); the GPU check
# reports these so that a sage timing says how much of it was sage.
sage_calls: Dict[str, int] = {"sage": 0, "split": 0, "sdpa": 0}
_limits_cache: Dict[tuple, SageLimits] = {}


def _current_sage_limits(device: torch.device) -> SageLimits:
    mod = sys.modules.get("sageattention")
    cap = device_rt.capability(device) if device.type == "cuda" else None
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
        warn_once(f"sage-route:{why.split(':')[0]}", f"attention 'sage': {why}; these calls use sdpa")
        return sdpa(q, k, v)
    main = sage_split(limits, k.shape[1])
    if main:
        try:
            out = split_tail(lambda qq, kk, vv: _sage_lse(sageattn, limits, qq, kk, vv), q, k, v, main)[0].to(q.dtype)
        except TypeError as e:  # a build whose sageattn takes no return_lse: exact sdpa, said once
            sage_calls["sdpa"] += 1
            warn_once("sage-lse", f"attention 'sage': sageattn(return_lse=True) failed ({e}); such calls use sdpa")
            return sdpa(q, k, v)
        sage_calls["split"] += 1
        return out
    sage_calls["sage"] += 1
    k = k.clone() if limits.copies_key else k.contiguous()  # 1.x: ``k -= mean`` in place (smooth_k)
    return sageattn(q.contiguous(), k, v.contiguous(), tensor_layout="NHD", is_causal=False)


def _sage_lse(sageattn, limits: SageLimits, q, k, v):
    """sageattn's output and its natural-log LSE as [B, S, H] (2.x: ``return_lse``, [B, H, S] in every layout; it
    corrects the LSE for its K smoothing itself)."""
    k = k.clone() if limits.copies_key else k.contiguous()
    out, lse = sageattn(q.contiguous(), k, v.contiguous(), tensor_layout="NHD", is_causal=False, return_lse=True)
    return out, lse.float().transpose(1, 2)


sage = guarded("sage", attention_op("sage_attention", _sage_kernel), 128)


# -- ring attention's blocks --------------------------------------------------------------------------------------
def sage_lse(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[Tuple[str, Callable]]:
    """sage as an attention-with-LSE kernel (ring attention's blocks) where it runs here and the installed version
    returns the log-sum-exp (2.x); None otherwise (1.x returns none)."""
    ok, _ = check_sage(device, dtype, head_dim)
    if not ok:
        return None
    limits = _current_sage_limits(device)
    return (f"sage (sageattention {limits.version}, return_lse)", _sage_block_lse) if limits.returns_lse else None


def _sage_block_lse(q, k, v):
    """One unmasked block with its LSE: sageattn whole, or on the largest multiple of its key block with the
    rest exact; a block it cannot take exactly gets the float32 reference (counted in ``sage_calls`` too)."""
    from sageattention import sageattn

    limits = _current_sage_limits(q.device)
    if sage_route(limits, q.shape[-1], k.shape[1]) is not None:
        sage_calls["sdpa"] += 1
        return attention_with_lse(q, k, v)
    main = sage_split(limits, k.shape[1]) or k.shape[1]
    sage_calls["split" if main < k.shape[1] else "sage"] += 1
    out, lse = split_tail(lambda qq, kk, vv: _sage_lse(sageattn, limits, qq, kk, vv), q, k, v, main)
    return out.float(), lse
