"""Weight-only quantization of the blocks' linear layers (98% of the 8B model's weights), one table of formats.

registry: the format table (``WeightFormat``, ``FORMATS``, ``register_format``); numerics: quantize /
dequantize; modules: FP8Linear, Int4Linear, their table entries and ``apply_quant`` (the "quant" patch);
int8: Int8Linear (W8A8, ``torch._int_mm``) and Int8WeightLinear, their entries ("int8", "int8-weight");
formats: pre-quantized files (``QuantPlan``); loading: quantize-on-read in the load loop (engine/loading.py's ``load_model`` uses it);
convert: ``sgld quantize``. Formats and compute paths: docs/quantization.md; adding a format:
docs/architecture.md.
"""
from ..tables import LiveNames
from .convert import quantize_file
from .formats import QuantPlan
from .int8 import Int8Linear, Int8WeightLinear, dequantize_int8, int_mm_accepts, quantize_int8, quantize_tokens
from .loading import QuantTransform
from .modules import (
                      QUANT_MODULES,
                      FP8Linear,
                      Int4Linear,
                      QuantPatch,
                      apply_quant,
                      fp8_scaled_mm_linear,
                      fp8_scaled_mm_supported,
                      make_quant_linear,
                      model_quant_format,
                      prepare_fast_paths,
                      remove_quant,
                      stored_tensors,
                      weight_bytes,
)
from .numerics import (
                      FP8_DTYPE,
                      FP8_MAX,
                      dequantize_fp8,
                      dequantize_int4,
                      int4_group,
                      quantize_fp8,
                      quantize_int4,
                      relative_error,
                      unpack_int4,
)
from .registry import FORMATS as FORMAT_TABLE
from .registry import (
                      WeightFormat,
                      choices,
                      format_of,
                      get_format,
                      parse_format,
                      quant_modules,
                      register_format,
                      unregister_format,
)

FORMATS = LiveNames(choices)  # EngineConfig.quant's choices: the table's, read when asked (int4 = groups of 128)
from . import gguf_linear  # noqa: E402, F401  (the GGUF block types q8_0 ... q6_k, registered after fp8 and int4)

__all__ = ["FORMATS", "FORMAT_TABLE", "FP8_DTYPE", "FP8_MAX", "QUANT_MODULES", "FP8Linear", "Int4Linear",
           "Int8Linear", "Int8WeightLinear", "dequantize_int8", "int_mm_accepts", "quantize_int8", "quantize_tokens",
           "QuantPatch", "QuantPlan", "QuantTransform", "WeightFormat", "apply_quant", "choices", "dequantize_fp8",
           "dequantize_int4", "format_of", "fp8_scaled_mm_linear", "fp8_scaled_mm_supported",
           "get_format", "int4_group", "make_quant_linear", "model_quant_format",
           "parse_format", "prepare_fast_paths", "quant_modules", "quantize_file", "quantize_fp8",
           "quantize_int4", "register_format", "relative_error", "remove_quant", "stored_tensors", "unpack_int4",
           "unregister_format", "weight_bytes"]
