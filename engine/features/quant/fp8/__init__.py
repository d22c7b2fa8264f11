"""fp8, one weight-format package: ``numerics`` (e4m3 quantize / dequantize, the ``torch._scaled_mm`` path and its
probe) and ``linear`` (``FP8Linear``, the file dialects' readers, the "fp8" entry). Importing it registers "fp8"."""
from .linear import FP8, FP8_STORAGE, FP8Linear, prepare_fp8, read_fp8_layers
from .numerics import FP8_DTYPE, FP8_MAX, dequantize_fp8, fp8_scaled_mm_linear, fp8_scaled_mm_supported, quantize_fp8

__all__ = ["FP8", "FP8_DTYPE", "FP8_MAX", "FP8_STORAGE", "FP8Linear", "dequantize_fp8", "fp8_scaled_mm_linear",
           "fp8_scaled_mm_supported", "prepare_fp8", "quantize_fp8", "read_fp8_layers"]
