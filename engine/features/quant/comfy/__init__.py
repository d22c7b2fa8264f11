"""ComfyUI's quantized checkpoints, one weight-format package: ``numerics`` (comfy-kitchen, ComfyUI's kernel
library, imported on first use; the stored shapes; Blackwell's block-scaled GEMMs), ``linear`` (the layers, their
``prepare`` probes and the "nvfp4", "mxfp8", "int8-tensorwise" entries of the format table, ../registry.py),
``reader`` (their ``read_layers``: ComfyUI's per-layer tags and each layer's tensors checked from the header) and
``convert`` (``sgld quantize --format nvfp4``: ComfyUI's layout, the "comfy" writer). Importing it registers the
three and the writer. float8_e4m3fn / e5m2 layers are fp8/'s. Why and how:
docs/quantization.md ("ComfyUI's quantized files")."""
from .convert import COMFY_WRITER, comfy_tensors, write_comfy_file
from .linear import INT8_TENSORWISE, MXFP8, NVFP4, Int8TensorwiseLinear, MXFP8Linear, NVFP4Linear, prepare_comfy
from .numerics import INSTALL, PACKAGE, kitchen, kitchen_missing

__all__ = ["COMFY_WRITER", "comfy_tensors", "write_comfy_file", "INSTALL", "INT8_TENSORWISE", "MXFP8", "NVFP4", "PACKAGE", "Int8TensorwiseLinear", "MXFP8Linear",
           "NVFP4Linear", "kitchen", "kitchen_missing", "prepare_comfy"]
