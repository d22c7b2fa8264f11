"""Weight-only FP8 / INT4 quantization of the blocks' linear layers (98% of the 8B model's weights).

numerics: quantize / dequantize; modules: FP8Linear, Int4Linear and ``apply_quant`` (the "quant" patch);
formats: pre-quantized files (``QuantPlan``); loading: quantize-on-read in the load loop and
``load_model``; convert: ``sgld quantize``. Formats and compute paths: docs/quantization.md.
"""
from .convert import quantize_file
from .formats import QuantPlan
from .loading import QuantTransform, estimate_bytes, load_model, plan_load
from .modules import (BLOCK_LINEARS, QUANT_MODULES, FP8Linear, Int4Linear, QuantPatch, apply_quant, fp8_scaled_mm_linear,
                      fp8_scaled_mm_supported, is_block_linear, make_quant_linear, model_quant_format, prepare_fast_paths,
                      remove_quant, weight_bytes)
from .numerics import (FORMATS, FP8_DTYPE, FP8_MAX, dequantize_fp8, dequantize_int4, int4_group, parse_format, quantize_fp8,
                       quantize_int4, relative_error, unpack_int4)

__all__ = ["BLOCK_LINEARS", "FORMATS", "FP8_DTYPE", "FP8_MAX", "QUANT_MODULES", "FP8Linear", "Int4Linear", "QuantPatch", "QuantPlan",
           "QuantTransform", "apply_quant", "dequantize_fp8", "dequantize_int4", "estimate_bytes", "fp8_scaled_mm_linear",
           "fp8_scaled_mm_supported", "int4_group", "is_block_linear", "load_model", "make_quant_linear",
           "model_quant_format", "parse_format", "plan_load", "prepare_fast_paths", "quantize_file", "quantize_fp8",
           "quantize_int4", "relative_error", "remove_quant", "unpack_int4", "weight_bytes"]
