"""Attention with its log-sum-exp, and the exact merge of two key sets' results by it: what lets a kernel
run on part of the keys (sage's block-multiple main part, one ring block) and the rest be added exactly.
Layouts: q, k, v and outputs [B, S, heads, head_dim]; a log-sum-exp [B, S, heads], float32 (natural log)."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch


def attention_with_lse(q, k, v, key_mask: Optional[torch.Tensor] = None, max_scores: int = 1 << 26):
    """Softmax attention of q [B, Sq, H, D] over k, v [B, Sk, H, D] in float32, the float32 reference.

    Returns (out [B, Sq, H, D] float32, lse [B, Sq, H] float32). A query whose keys are all masked gets
    out = 0 and lse = -inf (no NaN), so it merges away. Queries are processed in chunks so the score matrix
    stays below ``max_scores`` elements."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    kf = k.float().permute(0, 2, 3, 1)  # [B, H, D, Sk]
    vf = v.float().transpose(1, 2)  # [B, H, Sk, D]
    mask = None if key_mask is None else ~key_mask[:, None, None, :]
    step = max(1, max_scores // max(1, b * h * sk))
    outs, lses = [], []
    for i in range(0, sq, step):
        qf = q[:, i:i + step].float().transpose(1, 2)  # [B, H, sq', D]
        s = torch.matmul(qf, kf) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, H, sq']
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - safe.unsqueeze(-1))
        outs.append(torch.matmul(p, vf).transpose(1, 2))  # [B, sq', H, D]
        lses.append(lse.transpose(1, 2))  # [B, sq', H]
    return torch.cat(outs, 1), torch.cat(lses, 1)


def merge_lse(out, lse, block_out, block_lse):
    """Merge two partial softmax results by their log-sum-exp (exact; -inf safe; ``out`` None: the first).

    new_lse = log(exp(lse) + exp(block_lse)); out = exp(lse - new) * out + exp(block_lse - new) * block_out."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse.float(), block_lse.float())
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    a = torch.exp(lse.float() - safe).unsqueeze(-1)
    c = torch.exp(block_lse.float() - safe).unsqueeze(-1)
    return a * out.float() + c * block_out.float(), new


def split_tail(kernel_lse: Callable, q, k, v, main: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernel_lse`` (q, k, v -> out, lse; it takes only some key counts) on the first ``main`` keys, the rest
    exact, merged by log-sum-exp: (out, lse) over all keys, as a kernel without a key mask can give it at any
    length. ``main`` >= the key count: the kernel alone; 0: the float32 reference alone."""
    if main >= k.shape[1]:
        return kernel_lse(q, k, v)
    if main <= 0:
        return attention_with_lse(q, k, v)
    o1, l1 = kernel_lse(q, k[:, :main], v[:, :main])
    o2, l2 = attention_with_lse(q, k[:, main:], v[:, main:])
    return merge_lse(o1, l1, o2, l2)


# -- key masks as lengths (for kernels without a mask) -----------------------------------------------------------
def prefix_lengths(key_mask: torch.Tensor) -> Optional[List[int]]:
    """Valid-key counts per sample when every row of the mask is a prefix of True, else None."""
    lens = key_mask.sum(dim=1)
    ar = torch.arange(key_mask.shape[1], device=key_mask.device)
    if not bool((key_mask == (ar[None] < lens[:, None])).all()):  # one host sync per call
        return None
    return [int(x) for x in lens.tolist()]


def block_lens(mask: Optional[torch.Tensor]):
    """A block's key mask -> None (all valid), per-sample valid-prefix lengths, or the mask itself
    when a row is not a prefix. ERNIE-Image's masks are prefixes (text padding at the end of the
    unified sequence), and so is any contiguous block of them. One host sync per forward."""
    if mask is None:
        return None
    lens = prefix_lengths(mask)
    if lens is None:
        return mask
    return None if all(n == mask.shape[1] for n in lens) else lens


def block_attention(q, k, v, block, kernel: Callable):
    """Attention with LSE of q over one K/V block; ``block`` from ``block_lens``; ``kernel`` (q, k, v -> out,
    lse) takes no mask, so a padded block runs per sample on its valid keys."""
    if block is None:
        return kernel(q, k, v)
    if isinstance(block, torch.Tensor):
        return attention_with_lse(q, k, v, block)
    outs, lses = [], []
    b, sq, h, d = q.shape
    for i, n in enumerate(block):
        if n == 0:  # nothing to attend to in this block: weight 0 in the merge
            outs.append(torch.zeros(1, sq, h, d, dtype=torch.float32, device=q.device))
            lses.append(torch.full((1, sq, h), float("-inf"), device=q.device))
        else:
            o, lse = kernel(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n])
            outs.append(o)
            lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# -- torch's flash kernel, which returns the log-sum-exp (sdpa's LSE kernel) ---------------------------------------
def _flash_cuda(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                   v.transpose(1, 2), 0.0, False)[:2]
    return out.transpose(1, 2).float(), lse[..., : q.shape[1]].transpose(1, 2).float()


def _flash_cpu(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.transpose(1, 2), k.transpose(1, 2),
                                                                          v.transpose(1, 2), 0.0, False)[:2]
    return out.transpose(1, 2).float(), lse.transpose(1, 2).float()


def torch_flash_lse(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[Tuple[str, Callable]]:
    """torch's own flash kernel with its log-sum-exp where it has one (CUDA fp16/bf16 head_dim <= 256, or CPU)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
        return "flash (aten, CUDA)", _flash_cuda
    if device.type == "cpu":
        return "flash (aten, CPU)", _flash_cpu
    return None


def reference_lse(device: torch.device, dtype: torch.dtype, head_dim: int) -> Tuple[str, Callable]:
    """The float32 reference as an LSE kernel (any device, dtype, head size)."""
    return "float32 reference (math)", attention_with_lse
