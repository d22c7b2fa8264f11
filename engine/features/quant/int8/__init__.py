"""int8, one weight-format package: ``linear`` (``Int8Linear``, W8A8 with ``torch._int_mm``; ``Int8WeightLinear``,
weight-only; the file layout's reader and the "int8" / "int8-weight" entries). Importing it registers both."""
from .linear import (
                     INT8,
                     INT8_WEIGHT,
                     WEIGHT_ONLY,
                     Int8Linear,
                     Int8WeightLinear,
                     dequantize_int8,
                     int_mm_accepts,
                     quantize_int8,
                     quantize_tokens,
)

__all__ = ["INT8", "INT8_WEIGHT", "WEIGHT_ONLY", "Int8Linear", "Int8WeightLinear", "dequantize_int8", "int_mm_accepts",
           "quantize_int8", "quantize_tokens"]
