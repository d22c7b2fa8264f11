"""GGUF test files written by the real ``gguf`` package (GGUFWriter) from a state dict, in the two layouts
users hold: unsloth's (diffusers names, ``general.architecture = "wan"``, 4-D tensors kept 4-D) and
ComfyUI-GGUF's (the ComfyUI prefix ``model.diffusion_model.``, a 4-D tensor stored reshaped to 2-D with its
torch shape in ``comfy.gguf.orig_shape.<name>``). The reference weights are the same bytes dequantized by
``gguf``'s own numpy code (``reference_state``), read back through ``gguf.GGUFReader``."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gq

from engine.models.ernie_image import ErnieImageConfig

Q = GGMLQuantizationType
QUANT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
DENSE_TYPES = (Q.F32, Q.F16, Q.BF16)
ALL_TYPES = DENSE_TYPES + QUANT_TYPES
COMFY_PREFIX = "model.diffusion_model."
# Every linear has 256-multiple inputs, so the K types (blocks of 256) fit each one.
CFG = ErnieImageConfig(hidden_size=256, num_layers=2, num_attention_heads=4, ffn_hidden_size=512, in_channels=16,
                       out_channels=16, text_in_dim=256, rope_axes_dim=(16, 24, 24))
# (byte offset of the fp16 scale d, of the fp16 min m or None, largest |level x sub-scale|) per block type:
# random blocks get scales that keep the weights near 0.05 and finite
SCALES = {Q.Q8_0: (0, None, 127), Q.Q4_0: (0, None, 8), Q.Q4_1: (0, 2, 15), Q.Q5_0: (0, None, 16),
          Q.Q5_1: (0, 2, 31), Q.Q2_K: (80, 82, 45), Q.Q3_K: (108, None, 128), Q.Q4_K: (0, 2, 945),
          Q.Q5_K: (0, 2, 1953), Q.Q6_K: (208, None, 4064)}


def random_blocks(qtype, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid blocks: random levels and sub-scales, fp16 scales of a sane size."""
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * n // block, size), dtype=np.uint8)
    d_at, m_at, most = SCALES[qtype]
    d = (rng.uniform(0.5, 1.0, data.shape[0]) * 0.05 / most).astype(np.float16)
    data[:, d_at:d_at + 2] = d.view(np.uint8).reshape(-1, 2)
    if m_at is not None:
        m = (rng.uniform(0.0, 1.0, data.shape[0]) * 0.05 / max(1, most // 15)).astype(np.float16)
        data[:, m_at:m_at + 2] = m.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def encode(t: torch.Tensor, qtype, rng: np.random.Generator) -> np.ndarray:
    """A tensor's GGUF data (numpy, torch order): dense types cast, Q4_0..Q8_0 by gguf's quantizer, the K
    types (which gguf cannot quantize) as random valid blocks of the same shape."""
    a = t.detach().float().numpy()
    if qtype == Q.F32:
        return a
    if qtype == Q.F16:
        return a.astype(np.float16)
    if qtype in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        return gq.quantize(a, qtype)
    rows = a.size // a.shape[-1]
    return random_blocks(qtype, rows, a.shape[-1], rng).reshape(*a.shape[:-1], -1)


def types_for(sd: dict, qtype) -> dict:
    """The type of each tensor in a file "of type ``qtype``": every 2-D weight whose rows are whole blocks in
    ``qtype``, everything else (norms, biases, the 4-D patch embedding) F32, as converters do."""
    block = GGML_QUANT_SIZES[qtype][0]
    return {k: qtype if v.dim() == 2 and v.shape[-1] % block == 0 else Q.F32 for k, v in sd.items()}


def mixed_types(sd: dict) -> dict:
    """Every listed type in one file (as Q4_K_M-style files mix types): the 2-D weights take the types in turn."""
    out, i = {}, 0
    for k, v in sorted(sd.items()):
        if v.dim() == 2:
            out[k] = ALL_TYPES[i % len(ALL_TYPES)]
            i += 1
        else:
            out[k] = Q.F32
    return out


def write_gguf(path, sd: dict, types: dict, layout: str = "unsloth", seed: int = 0, arch: str = None,
               reshape: dict = None) -> str:
    """Write ``sd`` as a GGUF file through GGUFWriter, each tensor in ``types[key]``; ``layout``: "unsloth" |
    "comfy" (see the module docstring); ``reshape``: key -> a torch shape to store that tensor in, its own
    shape in ``comfy.gguf.orig_shape.<name>``."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch or ("wan" if layout == "unsloth" else "ernie_image"))
    for k in sorted(sd):
        t, qtype = sd[k], types[k]
        name = k if layout == "unsloth" else COMFY_PREFIX + k
        if (layout == "comfy" and t.dim() > 2) or k in (reshape or {}):
            w.add_array(f"comfy.gguf.orig_shape.{name}", [int(d) for d in t.shape])
            t = t.reshape((reshape or {}).get(k, (t.shape[0], -1)))
        data = encode(t, qtype, rng)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def reference_state(path) -> dict:
    """The file's tensors dequantized by gguf's numpy code, float32, names without the ComfyUI prefix, torch
    shapes (the orig_shape metadata applied)."""
    r = GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        values = gq.dequantize(t.data, t.tensor_type).astype(np.float32)
        field = r.get_field(f"comfy.gguf.orig_shape.{t.name}")
        shape = tuple(field.contents()) if field is not None else tuple(int(d) for d in reversed(t.shape.tolist()))
        name = t.name[len(COMFY_PREFIX):] if t.name.startswith(COMFY_PREFIX) else t.name
        out[name] = torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).clone()
    return out


def model_inputs(cfg: ErnieImageConfig = CFG, b: int = 1):
    """The DiT's call arguments (a 4x4 latent, t = 500, five text tokens) the GGUF tests compare models on."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(b, cfg.in_channels, 4, 4, generator=g), torch.tensor([500.0] * b),
            torch.randn(b, 5, cfg.text_in_dim, generator=g), torch.tensor([5] * b))
