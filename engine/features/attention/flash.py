"""The ``flash`` backend: FlashAttention 2 (the flash_attn package), CUDA sm80+, fp16/bf16, head_dim <= 256, as a
custom op (compiled graphs keep it) run per sample on its valid keys."""
from __future__ import annotations

from typing import Tuple

import torch

from ... import device as device_rt
from .kernels import attention_op, cuda_half_problem, guarded, package_version


def _flash_kernel(q, k, v):
    from flash_attn import flash_attn_func

    return flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=False)


flash = guarded("flash", attention_op("flash_attention", _flash_kernel), 256)


def check_flash(device: torch.device, dtype: torch.dtype, head_dim: int) -> Tuple[bool, str]:
    why = cuda_half_problem(device, dtype, head_dim, 256)
    if why is not None:
        return False, why
    cap = device_rt.capability(device)
    if cap < (8, 0):
        return False, f"flash-attn 2 needs sm80+ (GPU is sm{cap[0]}{cap[1]})"
    ok, ver = package_version("flash_attn")
    return (True, f"flash-attn {ver} on sm{cap[0]}{cap[1]}") if ok else (False, ver)
