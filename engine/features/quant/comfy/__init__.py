"""ComfyUI's quantized checkpoints, one weight-format package: ``numerics`` (comfy-kitchen, ComfyUI's kernel
library, imported on first use; the stored shapes; ConvRot's Hadamard rotation), ``linear`` (the nvfp4, mxfp8 and
int8_tensorwise layers, the ``prepare`` probes of comfy-kitchen's GPU kernels and their entries of the format
table, ../registry.py), ``int4`` (the 4-bit integer layers: convrot_w4a4, asym_w4a8_int8, awq_w4a16, and their
entries), ``reader`` (their ``read_layers``: ComfyUI's per-layer tags and each layer's tensors checked from the
header) and ``convert`` (``sgld quantize --format nvfp4`` ...: ComfyUI's layout, the "comfy" writer). Importing it
registers the six and the writer. float8_e4m3fn / e5m2 layers are fp8/'s. Why and how: docs/quantization.md
("ComfyUI's quantized files")."""
from .convert import COMFY_WRITER, comfy_tensors, write_comfy_file
from .int4 import ASYM_W4A8_INT8, AWQ_W4A16, CONVROT_W4A4, AWQW4A16Linear, ConvRotW4A4Linear, W4A8Linear
from .linear import INT8_TENSORWISE, MXFP8, NVFP4, Int8TensorwiseLinear, MXFP8Linear, NVFP4Linear, prepare_comfy
from .numerics import INSTALL, PACKAGE, kitchen, kitchen_missing

__all__ = ["ASYM_W4A8_INT8", "AWQ_W4A16", "AWQW4A16Linear", "COMFY_WRITER", "CONVROT_W4A4", "ConvRotW4A4Linear",
           "comfy_tensors", "write_comfy_file", "INSTALL", "INT8_TENSORWISE", "MXFP8", "NVFP4", "PACKAGE",
           "Int8TensorwiseLinear", "MXFP8Linear", "NVFP4Linear", "W4A8Linear", "kitchen", "kitchen_missing",
           "prepare_comfy"]
