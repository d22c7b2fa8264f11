"""Weight-only quantization of the blocks' linear layers (98% of the 8B model's weights), one table of formats.

registry: the format table (``WeightFormat``, ``FORMATS``, ``register_format``) and the writer table; numerics:
what every format's layer shares; one package per format, each registering itself: fp8/, int4/, int8/ ("int8",
W8A8 with ``torch._int_mm``, and "int8-weight"), gguf/ (its block types and its .gguf writer), comfy/ (ComfyUI's
nvfp4, mxfp8, int8_tensorwise, convrot_w4a4, asym_w4a8_int8 and awq_w4a16 layers, computed by comfy-kitchen, and
its writer); modules: the "quant"
feature (``apply_quant``, the "quant" patch); prequantized: pre-quantized files (``QuantPlan``); transform:
quantize-on-read in the load loop (engine/loading.py, the public loader, uses it); convert: ``sgld quantize``'s
sgld writer. Formats and compute paths: docs/quantization.md (the table: docs/attention_compile_quant.md,
``python -m tools.format_docs``); adding a format: docs/architecture.md.
"""
from ..tables import LiveNames
from . import fp8, int4, int8  # noqa: F401, I001  (registered in this order: the order of choices, messages and docs)
from .convert import quantize_file
from .fp8 import FP8_DTYPE, FP8_MAX, FP8Linear, dequantize_fp8, fp8_scaled_mm_linear, fp8_scaled_mm_supported, quantize_fp8
from .int4 import Int4Linear, dequantize_int4, int4_group, quantize_int4, unpack_int4
from .int8 import Int8Linear, Int8WeightLinear, dequantize_int8, int_mm_accepts, quantize_int8, quantize_tokens
from .modules import (
                  QuantPatch,
                  apply_quant,
                  make_quant_linear,
                  model_quant_format,
                  prepare_fast_paths,
                  remove_quant,
                  stored_tensors,
                  weight_bytes,
                  weights_format,
)
from .numerics import relative_error
from .prequantized import QuantPlan
from .registry import (
                  FILE_WRITERS,
                  FileWriter,
                  WeightFormat,
                  choices,
                  describe_formats,
                  format_of,
                  get_format,
                  parse_format,
                  quant_modules,
                  register_format,
                  register_writer,
                  unregister_format,
                  unregister_writer,
                  writable_formats,
                  writer_for,
                  writer_formats,
)
from .registry import FORMATS as FORMAT_TABLE
from .transform import QuantTransform, tensor_parallel_shard

FORMATS = LiveNames(choices)  # EngineConfig.quant's choices: the table's, read when asked (int4 = groups of 128)
from . import gguf  # noqa: E402, F401, I001  (the GGUF block types q8_0 ... q6_k, registered after the others)
from . import comfy  # noqa: E402, F401  (ComfyUI's layouts, nvfp4 ... awq-w4a16, computed by comfy-kitchen)

QUANT_MODULES = quant_modules()  # the layer classes registered here; code that must see later ones calls quant_modules()

__all__ = ["FILE_WRITERS", "FORMATS", "FORMAT_TABLE", "FileWriter", "describe_formats",
           "register_writer", "unregister_writer", "writable_formats", "writer_for", "writer_formats",
           "FP8_DTYPE", "FP8_MAX", "QUANT_MODULES", "FP8Linear", "Int4Linear",
           "Int8Linear", "Int8WeightLinear", "dequantize_int8", "int_mm_accepts", "quantize_int8", "quantize_tokens",
           "QuantPatch", "QuantPlan", "QuantTransform", "WeightFormat", "apply_quant", "choices", "dequantize_fp8",
           "dequantize_int4", "format_of", "fp8_scaled_mm_linear", "fp8_scaled_mm_supported",
           "get_format", "int4_group", "make_quant_linear", "model_quant_format",
           "parse_format", "prepare_fast_paths", "quant_modules", "quantize_file", "quantize_fp8",
           "quantize_int4", "register_format", "relative_error", "remove_quant", "stored_tensors", "tensor_parallel_shard", "unpack_int4",
           "unregister_format", "weight_bytes", "weights_format"]
