"""The error measures the benchmarks report, defined once: ``out`` is what was measured, ``ref`` what it is
compared with (numpy arrays or torch tensors)."""
from __future__ import annotations

import math


def _f64(x):
    return x.double() if hasattr(x, "double") else x.astype("float64")


def rel_err(out, ref) -> float:
    """Relative L2 error of torch tensors: |out - ref| / |ref|."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def max_rel_err(out, ref) -> float:
    """Largest absolute difference relative to ``ref``'s largest magnitude (torch tensors)."""
    out, ref = out.float(), ref.float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def psnr(out, ref, data_range=None) -> float:
    """PSNR in dB of ``out`` against ``ref``; the peak is ``data_range`` (255 for 8-bit images) or, when None,
    ``ref``'s own range (latents have no fixed one)."""
    out, ref = _f64(out), _f64(ref)
    mse = float(((out - ref) ** 2).mean())
    peak = float(ref.max() - ref.min()) if data_range is None else float(data_range)
    return float("inf") if mse == 0 else 10 * math.log10(peak * peak / mse)
