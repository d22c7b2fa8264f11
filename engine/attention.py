"""Attention backends. Every backend takes q, k, v as [B, S, heads, head_dim] and an optional
boolean key mask [B, S] (True = attend) and returns [B, S, heads, head_dim]."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)
