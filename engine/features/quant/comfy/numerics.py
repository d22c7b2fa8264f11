"""ComfyUI's quantized formats computed by comfy-kitchen (PyPI ``comfy-kitchen``, ComfyUI's own kernel library):
its quantizers and dequantizers define the bytes (nibble order, the cuBLAS tile swizzle of the block scales), so
this engine reads the files exactly as ComfyUI does. Imported on first use: a missing package is named with the
command that installs it (``INSTALL``, right for a cloned pack and a pip install alike) instead of failing the
engine's import.

Shapes (ComfyUI pads a layer to whole tiles; comfy_kitchen/tensor/*.py):
- nvfp4: ``weight`` U8 [out16, in16 / 2] (two e2m1 values a byte, the even one in the high nibble),
  ``weight_scale`` F8_E4M3 [out128, in16 / 16 rounded up to 4] (one per 16 values, swizzled),
  ``weight_scale_2`` F32 scalar (w = value * block scale * weight_scale_2);
- mxfp8: ``weight`` F8_E4M3 [out32, in32], ``weight_scale`` F8_E8M0 [out128, in32 / 32 rounded up to 4];
- int8_tensorwise: ``weight`` I8 [out, in], ``weight_scale`` F32 scalar (or one per output row); with ConvRot
  (tag ``convrot``) the weight is stored rotated: each group of ``convrot_groupsize`` inputs times a regular
  Hadamard matrix (``rotate_inputs``), the activations rotated alike at run time;
- convrot_w4a4: ``weight`` I8 [out, in / 2] (signed int4 pairs, the even value in the low nibble), rotated
  as above, ``weight_scale`` F32 [out];
- asym_w4a8_int8: ``weight`` I8 [out, in / 2] (4-bit codes) or [out, 3 in / 4] (6-bit), rotated as above,
  ``weight_s_rel`` F8_E4M3 or F32 [out, in / group_size], ``weight_s_channel`` F32 [out], optional
  ``weight_codebook`` F32 [16];
- awq_w4a16: ``weight`` I8 [out, in / 2] (unsigned int4 pairs, low nibble first), ``weight_scale`` and
  ``weight_zeros`` BF16 / F16 [in / group_size, out] (w = (q - 8) * scale + zero).
(outN: out rounded up to a multiple of N.)"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

PACKAGE = "comfy-kitchen"
# a pack cloned into custom_nodes has no package to add an extra to: the package itself, into ComfyUI's Python
INSTALL = "python -m pip install comfy-kitchen"
NVFP4_BLOCK, MXFP8_BLOCK = 16, 32
W4A4_GROUP = 64  # ConvRot W4A4's int4 GEMM tile (ComfyUI's loader fixes quant_group_size to it)
E2M1_MAX, E4M3_MAX = 6.0, 448.0
_kitchen = None


def kitchen_missing() -> Optional[str]:
    """None when comfy-kitchen imports, else why not (the message users read, naming the package and how to install it)."""
    try:
        kitchen()
    except ImportError as e:
        return str(e)
    return None


def kitchen():
    """The ``comfy_kitchen`` module (imported once; its import takes a second)."""
    global _kitchen
    if _kitchen is None:
        try:
            import comfy_kitchen
        except ImportError as e:
            raise ImportError(f"ComfyUI's quantized layers (nvfp4, mxfp8, int8, 4-bit) are computed by the package "
                              f"'{PACKAGE}', which does not import here ({e}); install it with the Python that runs "
                              f"ComfyUI (or sgld): {INSTALL}") from None
        _kitchen = comfy_kitchen
    return _kitchen


def roundup(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_scale_shape(rows: int, blocks: int) -> Tuple[int, int]:
    """The swizzled block-scale tensor of ``rows`` x ``blocks`` scales (cuBLAS tiles of 128 rows x 4 blocks)."""
    return roundup(rows, 128), roundup(blocks, 4)


def dequantize_nvfp4(weight: torch.Tensor, block_scale: torch.Tensor, scale: torch.Tensor, shape: Tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] in ``dtype`` from nvfp4 bytes (padding cut off)."""
    ck = kitchen()
    full = ck.dequantize_nvfp4(weight, scale.float(), block_scale.view(torch.float8_e4m3fn), dtype)
    return full[: shape[0], : shape[1]]


def dequantize_mxfp8(weight: torch.Tensor, block_scale: torch.Tensor, shape: Tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    full = kitchen().dequantize_mxfp8(weight, block_scale.view(torch.float8_e8m0fnu), dtype)
    return full[: shape[0], : shape[1]]


def int8_scale(scale: torch.Tensor) -> torch.Tensor:
    """A stored int8_tensorwise scale as float32, one or one per output row ([out, 1])."""
    s = scale.float()
    return s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return kitchen().dequantize_int8_simple(weight, int8_scale(scale)).to(dtype)


def is_rotation_size(n) -> bool:
    """A ConvRot group: a power of 4 from 4 on (comfy-kitchen builds its Hadamard matrix only for those)."""
    return type(n) is int and n >= 4 and n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


_hadamards: Dict[tuple, torch.Tensor] = {}


def hadamard(size: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ConvRot's regular Hadamard matrix of ``size`` (a power of 4): Kronecker powers of the 4 x 4 one with a
    single -1 per row, on the anti-diagonal, normalized (exact in any float dtype); symmetric, its own inverse."""
    key = (size, str(device), dtype)
    if key not in _hadamards:
        h4 = torch.ones(4, 4, dtype=torch.float64) - 2 * torch.eye(4, dtype=torch.float64).flip(0)
        h = h4
        while h.shape[0] < size:
            h = torch.kron(h, h4)
        _hadamards[key] = (h / size ** 0.5).to(device=device, dtype=dtype)
    return _hadamards[key]


def rotate_inputs(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [..., in] with each group of ``group`` inputs times the Hadamard matrix: the basis a ConvRot weight
    is stored in, so that ``rotate_inputs(x) @ w_rotated.T == x @ w.T``."""
    shape = x.shape
    return (x.reshape(-1, shape[-1] // group, group) @ hadamard(group, x.device, x.dtype)).reshape(shape)


def dequantize_int8_convrot(weight: torch.Tensor, scale: torch.Tensor, group: int,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An int8_tensorwise ConvRot weight in the original basis (comfy-kitchen's layout dequantizer)."""
    layout = kitchen().tensor.TensorWiseINT8Layout
    params = layout.Params(scale=int8_scale(scale), orig_dtype=torch.float32, orig_shape=tuple(weight.shape),
                           convrot=True, convrot_groupsize=group)
    return layout.dequantize(weight, params).to(dtype)


def dequantize_convrot_w4a4(weight: torch.Tensor, scale: torch.Tensor, group: int,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return kitchen().dequantize_convrot_w4a4_weight(weight, scale.float(), group, W4A4_GROUP, torch.float32).to(dtype)


def dequantize_w4a8(weight, s_rel, s_channel, codebook, group: int, rotation: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return kitchen().dequantize_w4a8_int8_weight(weight, s_rel, s_channel, codebook=codebook, group_size=group,
                                                 convrot_groupsize=rotation, output_dtype=torch.float32).to(dtype)


def dequantize_awq(weight, scale, zeros, group: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    layout = kitchen().tensor.TensorCoreAWQW4A16Layout
    out, cols = weight.shape[0], weight.shape[1] * 2
    params = layout.Params(scale=scale, zeros=zeros, group_size=group, orig_dtype=torch.float32, orig_shape=(out, cols))
    return layout.dequantize(weight, params).to(dtype)


def quantize_nvfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (weight, weight_scale, weight_scale_2) as ComfyUI stores them (comfy-kitchen's quantizer)."""
    wf = w.float()
    scale = (wf.abs().amax() / (E4M3_MAX * E2M1_MAX)).clamp(min=1e-30)
    pad = roundup(wf.shape[0], 16) != wf.shape[0] or roundup(wf.shape[1], 16) != wf.shape[1]
    q, block = kitchen().quantize_nvfp4(wf, scale, pad_16x=pad)
    return q, block, scale


def quantize_mxfp8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    pad = roundup(wf.shape[0], 32) != wf.shape[0] or roundup(wf.shape[1], 32) != wf.shape[1]
    return kitchen().quantize_mxfp8(wf, pad_32x=pad)


def quantize_int8_tensorwise(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return kitchen().quantize_int8_tensorwise(w.float())


def quantize_convrot_w4a4(w: torch.Tensor, rotation: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (I8 [out, in / 2], F32 [out]) rotated by groups of ``rotation`` inputs."""
    return kitchen().quantize_convrot_w4a4_weight(w.float(), rotation, W4A4_GROUP)


def quantize_w4a8(w: torch.Tensor, group: int, rotation: int):
    """[out, in] -> (weight, s_rel, s_channel, codebook) as comfy-kitchen's default W4A8 writes them (symmetric,
    Lloyd-Max codebook, e4m3 group scales)."""
    q, s_rel, s_channel, _correction, codebook = kitchen().quantize_w4a8_int8_weight(w.float(), group, rotation)
    return q, s_rel, s_channel, codebook


# -- Blackwell's block-scaled GEMMs (comfy-kitchen's CUDA kernels, sm100+): the activations quantized per forward --
def nvfp4_linear(x2: torch.Tensor, weight, block_scale, scale, out_features: int, bias=None) -> torch.Tensor:
    """[tokens, in] x nvfp4 weight -> [tokens, out]: ``x2`` quantized to nvfp4 (one scale per tensor, e4m3 per 16
    values, padded to tiles), then ``scaled_mm_nvfp4``, as ComfyUI's nvfp4 linear does on Blackwell."""
    ck = kitchen()
    xs = (x2.abs().amax().float() / (E4M3_MAX * E2M1_MAX)).clamp(min=1e-30)
    xq, xb = ck.quantize_nvfp4(x2, xs, pad_16x=True)
    y = ck.scaled_mm_nvfp4(xq, weight, xs, scale.float(), xb, block_scale, bias=bias, out_dtype=x2.dtype)
    return y[: x2.shape[0], :out_features]


def mxfp8_linear(x2: torch.Tensor, weight, block_scale, out_features: int, bias=None) -> torch.Tensor:
    """[tokens, in] x mxfp8 weight: ``x2`` quantized to mxfp8 (padded to tiles of 32), then ``scaled_mm_mxfp8``."""
    ck = kitchen()
    xq, xb = ck.quantize_mxfp8(x2, pad_32x=True)
    y = ck.scaled_mm_mxfp8(xq, weight, xb, block_scale, bias=bias, out_dtype=x2.dtype)
    return y[: x2.shape[0], :out_features]


def gpu_backend(device: torch.device, op: str):
    """The name of comfy-kitchen's GPU backend that has ``op`` for this device, or None (with why)."""
    if device.type != "cuda":
        return None, "not a CUDA / HIP device"
    names = [n for n, b in kitchen().list_backends().items() if n in ("cuda", "hip") and b.get("available")
             and op in b.get("capabilities", ())]
    return (names[0], "") if names else (None, f"comfy-kitchen has no GPU kernel '{op}' here")
