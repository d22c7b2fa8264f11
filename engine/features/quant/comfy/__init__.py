"""ComfyUI's quantized checkpoints, one weight-format package: ``numerics`` (comfy-kitchen, ComfyUI's kernel
library, imported on first use; the stored shapes) and ``linear`` (the layers and the "nvfp4", "mxfp8",
"int8-tensorwise" entries of the format table, ../registry.py, each reading its layers from ComfyUI's per-layer
tags). Importing it registers the three. float8_e4m3fn / e5m2 layers are fp8/'s. Why and how:
docs/quantization.md ("ComfyUI's quantized files")."""
from .linear import INT8_TENSORWISE, MXFP8, NVFP4, Int8TensorwiseLinear, MXFP8Linear, NVFP4Linear, prepare_comfy
from .numerics import INSTALL, PACKAGE, kitchen, kitchen_missing

__all__ = ["INSTALL", "INT8_TENSORWISE", "MXFP8", "NVFP4", "PACKAGE", "Int8TensorwiseLinear", "MXFP8Linear",
           "NVFP4Linear", "kitchen", "kitchen_missing", "prepare_comfy"]
