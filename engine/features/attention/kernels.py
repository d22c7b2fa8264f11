"""What the attention kernels share: the float32 reference (``math``), running a kernel without a key mask
per sample on its valid keys, the call-time guard that sends inputs a kernel cannot take to sdpa (warned
once), and reading a kernel package's version and whether a CUDA half-precision kernel can run."""
from __future__ import annotations

import importlib.metadata
import logging
import sys
from typing import Callable, Optional, Tuple

import torch

from ... import device as device_rt
from ...models.family import sdpa  # the model's own attention: the default backend
from .lse import attention_with_lse, prefix_lengths

log = logging.getLogger("sgld.attention")
HALF_DTYPES = (torch.float16, torch.bfloat16)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference attention in plain PyTorch ops, softmax in float32."""
    return attention_with_lse(q, k, v, key_mask)[0].to(q.dtype)


def attention_op(name: str, kernel: Callable) -> Callable:
    """``kernel`` (q, k, v, key_mask) -> [B, S, H, D] as the custom op ``sgld::<name>`` (compiled graphs keep it),
    defined once per process: a second copy of this package in the same process (the tests import the node pack
    under its folder's name beside ``engine``) takes the first copy's op, so one kernel and its counters serve both
    instead of the last import silently replacing it."""
    namespace = torch.ops.sgld
    if hasattr(namespace, name):
        return getattr(namespace, name)

    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        return per_sample(kernel, q, k, v, key_mask).contiguous()

    defined = torch.library.custom_op(f"sgld::{name}", mutates_args=())(op)
    defined.register_fake(lambda q, k, v, key_mask: q.new_empty(q.shape))  # contiguous, like the real op
    return defined


def per_sample(kernel: Callable, q, k, v, key_mask) -> torch.Tensor:
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


_warned: set = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def forget_warnings() -> None:
    """Warn again about what was warned once (tests)."""
    _warned.clear()


def guarded(name: str, op: Callable, max_head_dim: int) -> Callable:
    """Call-time guard: inputs the kernel cannot take (dtype, device, head size) go to SDPA."""

    def attention(q, k, v, key_mask=None):
        if q.dtype not in HALF_DTYPES or q.device.type != "cuda" or q.shape[-1] > max_head_dim:
            warn_once(f"{name}:{q.dtype}:{q.device.type}:{q.shape[-1]}",
                      f"attention '{name}' cannot take {str(q.dtype).replace('torch.', '')} inputs on {q.device.type} "
                      f"with head_dim {q.shape[-1]}: these calls use sdpa")
            return sdpa(q, k, v, key_mask)
        return op(q, k, v, key_mask)

    attention.__name__ = f"{name}_attention"
    attention.__qualname__ = attention.__name__
    return attention


# -- availability ------------------------------------------------------------------------------------------------
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


def package_version(module: str) -> Tuple[bool, str]:
    """Import a kernel package; (ok, version or the reason it cannot be used)."""
    try:
        __import__(module)
    except (ImportError, OSError, RuntimeError, AssertionError) as e:  # missing, or built for another torch/CUDA
        detail = (str(e).splitlines() or [""])[0][:160]
        return False, f"the '{module}' package does not import ({type(e).__name__}: {detail})"
    return True, installed_version(module)


def cuda_half_problem(device: torch.device, dtype: torch.dtype, head_dim: int, max_head_dim: int) -> Optional[str]:
    """Why a CUDA fp16/bf16 kernel that takes head sizes up to ``max_head_dim`` cannot run here, or None."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU (device is {device.type})"
    if not device_rt.available():
        return "CUDA is not available"
    if dtype not in HALF_DTYPES:
        return f"it needs fp16/bf16 weights (model is {str(dtype).replace('torch.', '')})"
    if head_dim > max_head_dim:
        return f"head_dim {head_dim} > {max_head_dim}"
    return None
