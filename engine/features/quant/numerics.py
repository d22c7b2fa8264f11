"""What every weight format's layer shares: frozen parameters, the 8-bit scaled GEMM of the dequantized path
(fp8 and both int8 layers) and the relative error the tests and benchmarks report. Each format's own numerics
live in its package (fp8/, int4/, int8/, gguf/)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def frozen(t: torch.Tensor) -> nn.Parameter:
    """A layer's stored tensor as a parameter that never takes a gradient."""
    return nn.Parameter(t, requires_grad=False)


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x`` times an 8-bit weight (fp8 e4m3 or int8, either cast exactly to ``x``'s dtype) with its scale (one
    per output channel, or one) applied to the output, plus the bias: the dequantized path of FP8Linear and
    both int8 layers."""
    y = torch.nn.functional.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)
