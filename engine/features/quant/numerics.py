"""What every weight format's layer shares: frozen parameters, the 8-bit scaled GEMM of the dequantized path
(fp8 and both int8 layers), per-row activation quantization and row-wise products in chunks, and the relative
error the tests and benchmarks report. Each format's own numerics live in its package (fp8/, int4/, int8/, gguf/)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

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


ROW_CHUNK_ELEMENTS = 1 << 24  # the float32 temporaries of one chunk: 64 MiB


def quantize_rows(x2: torch.Tensor, quantize: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]],
                  dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic quantization ``quantize`` of [rows, in] (-> (q in ``dtype``, float32 scale [rows, 1])),
    run over chunks of rows: its float32 copies stay ~64 MiB instead of several of the whole activation, which
    at the 8B model's widest block input for a 2048² CFG batch are 1.6 GB each and set the fp8 / int8 peak (docs/memory.md).
    Row-wise, so the result is the same bits as one call. Compiled graphs fuse these ops: one call there."""
    rows, cols = x2.shape
    step = max(1, ROW_CHUNK_ELEMENTS // max(cols, 1))
    if rows <= step or torch.compiler.is_compiling():
        return quantize(x2)
    q = torch.empty(rows, cols, dtype=dtype, device=x2.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x2.device)
    for start in range(0, rows, step):
        q[start:start + step], scale[start:start + step] = quantize(x2[start:start + step])
    return q, scale


GEMM_CHUNK_ELEMENTS = 1 << 26  # output elements of one chunk of a row-wise product: its int32 + float32 temporaries, 512 MiB
GEMM_CHUNK_ALIGN = 256  # rows of a chunk: a multiple of the GEMM tiles
GEMM_MIN_TAIL = 32  # a last chunk this short joins the one before (cuBLAS's int8 GEMM wants more than 16 rows)


def product_rows(x2: torch.Tensor, out_features: int, dtype: torch.dtype,
                 product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x2)`` ([rows, in] -> [rows, out_features], any dtype) cast to ``dtype``, computed over chunks
    of rows into one output: the W8A8 GEMMs' int32 sums and their float32 rescale are each 4 bytes an output,
    which for the 8B model's widest block output at a 2048² CFG batch is 3.3 GB twice (docs/memory.md).
    ``product`` must treat rows independently (per-token quantization, integer sums): then the result is the
    same bits as one call. Compiled graphs fuse these ops: one call there."""
    rows = x2.shape[0]
    step = max(GEMM_CHUNK_ALIGN, GEMM_CHUNK_ELEMENTS // max(out_features, 1) // GEMM_CHUNK_ALIGN * GEMM_CHUNK_ALIGN)
    if rows <= step + GEMM_MIN_TAIL or torch.compiler.is_compiling():
        return product(x2).to(dtype)
    out = torch.empty(rows, out_features, dtype=dtype, device=x2.device)
    starts = list(range(0, rows, step))
    if rows - starts[-1] < GEMM_MIN_TAIL:
        starts.pop()
    for start, stop in zip(starts, starts[1:] + [rows]):
        out[start:stop] = product(x2[start:stop])
    return out
