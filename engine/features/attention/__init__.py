"""Attention backends as one table (``BACKEND_TABLE``: sdpa, sage, flash, math; auto picks the best that
runs), chosen once at load and set as the model's ``attention`` slot by the "attention" Patch. A new
backend is one ``register_backend(Backend(...))`` (docs/architecture.md). Every backend takes q, k, v as
[B, S, heads, head_dim] and an optional boolean key mask [B, S] (True = attend). The kernels without a mask
run each padded sample on its valid keys (ERNIE-Image pads only the end of the text), which is exactly
what masked SDPA computes; they are custom ops, so compiled graphs keep them. Each sageattention
version's exactness limits and the fallbacks: docs/attention_compile_quant.md.

The modules: ``backends`` (the table, selection, the Patch, ring attention's kernel probe), ``lse``
(attention with its log-sum-exp, the merge, key masks as lengths: sage's tail split and ring attention's
blocks), ``kernels`` (the float32 reference and what the mask-less kernels share), ``sage``, ``flash``.
"""
from ...models.family import sdpa
from .backends import (
    BACKEND_TABLE,
    BACKENDS,
    FUNCTIONS,
    AttentionBackend,
    AttentionChoice,
    Backend,
    apply_attention,
    available_backends,
    backend_names,
    check_backend,
    lse_kernel,
    register_backend,
    remove_attention,
    select_backend,
    unregister_backend,
)
from .flash import flash
from .kernels import HALF_DTYPES, forget_warnings, installed_version, math_attention, package_version, per_sample
from .lse import attention_with_lse, block_attention, block_lens, merge_lse, prefix_lengths, split_tail
from .sage import SageLimits, sage, sage_calls, sage_limits, sage_route, sage_split

__all__ = [
    "BACKEND_TABLE", "BACKENDS", "FUNCTIONS", "HALF_DTYPES", "AttentionBackend", "AttentionChoice", "Backend", "SageLimits",
    "apply_attention", "attention_with_lse", "available_backends", "backend_names", "block_attention", "block_lens",
    "check_backend", "flash", "forget_warnings", "installed_version", "lse_kernel", "math_attention", "merge_lse",
    "package_version", "per_sample", "prefix_lengths", "register_backend", "remove_attention", "sage", "sage_calls",
    "sage_limits", "sage_route", "sage_split", "sdpa", "select_backend", "split_tail", "unregister_backend",
]
