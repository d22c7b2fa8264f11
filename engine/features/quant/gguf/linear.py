"""GGUF block types as weight formats (../registry.py): "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k",
"q4_k", "q5_k", "q6_k". A layer keeps its GGUF bytes (a uint8 parameter [out, bytes per row], so offload moves
and LoRA side paths see it as any quantized layer) and dequantizes them per forward, on their device, to the
input's dtype (numerics.dequantize). One class per type, so ``format_of`` tells them apart. A GGUF
file's quantized tensors are found by ``read_layers`` (the reader, engine/io/gguf.py, reports each one's
type); ``quant=q4_k`` quantizes a dense model's block linears at load (numerics.quantize). Why and
how: docs/quantization.md, "Loading GGUF files"."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ....errors import CheckpointError
from ..numerics import frozen
from ..registry import WeightFormat, register_format
from . import numerics as G

DENSE_TYPES = ("f32", "f16", "bf16")  # read as ordinary tensors, not a weight format


class GGUFLinear(nn.Module):
    """Linear whose weight is GGUF blocks of type ``QTYPE`` (set by each type's subclass)."""

    QTYPE: int = 0

    def __init__(self, raw: torch.Tensor, in_features: int, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.in_features = int(in_features)
        per_row = G.row_bytes(self.QTYPE, self.in_features)
        if raw.dtype != torch.uint8 or raw.numel() % per_row:
            raise ValueError(f"{G.type_name(self.QTYPE)} weight: {raw.numel()} {raw.dtype} bytes are not rows of "
                             f"{per_row} bytes ({self.in_features} values)")
        self.out_features = raw.numel() // per_row
        self.weight = frozen(raw.reshape(self.out_features, per_row))
        self.bias = frozen(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "GGUFLinear":
        return cls(G.quantize(weight, cls.QTYPE).to(weight.device), weight.shape[1], bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return G.dequantize(self.weight, self.QTYPE, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gguf {G.type_name(self.QTYPE)}"


def _read_layers(name: str, qtype: int):
    """The format's ``read_layers``: every weight the reader reports stored in block type ``name``."""

    def read(plan, keys) -> Dict[str, dict]:
        ckpt, layers = plan.ckpt, {}
        for k in sorted(keys):
            if ckpt.kind(k) != name:
                continue
            f, fk = ckpt.index[k]
            if not k.endswith(".weight"):
                raise CheckpointError(f"{ckpt.where(k)}: stored as {G.type_name(qtype)}; only weights may be "
                                      "block-quantized (biases and norms are F32 / F16 / BF16)")
            layer = k[: -len(".weight")]
            if ckpt.family is not None and ckpt.family.is_block_linear(layer) and f.stored_shape(fk) != f.shape(fk):
                raise CheckpointError(f"{ckpt.where(k)}: a {G.type_name(qtype)} block linear stored reshaped as "
                                      f"{list(f.stored_shape(fk))} (its shape is {list(f.shape(fk))}); block linears "
                                      "are read as rows of [out, in]: convert the file without reshaping them")
            layers[layer] = {"shape": f.shape(fk), "stored_shape": f.stored_shape(fk), "stored_bytes": f.stored_bytes(fk)}
            plan.sources.add("gguf")
        return layers

    return read


def _dequantize(qtype: int):
    def dequantize(parts) -> torch.Tensor:
        shape = parts.get("shape")
        stored = parts.get("stored_shape") or shape
        return G.dequantize(parts["weight"], qtype, stored, torch.float32).reshape(shape)

    return dequantize


def _from_stored(cls):
    def from_stored(parts) -> GGUFLinear:
        shape = tuple(parts["shape"])
        if len(shape) != 2 or tuple(parts.get("stored_shape") or shape) != shape:
            raise ValueError(f"a {G.type_name(cls.QTYPE)} linear weight is [out, in], not {list(shape)}")
        return cls(parts["weight"], shape[1])

    return from_stored


def _concat(parts: List[GGUFLinear], bias: Optional[torch.Tensor]) -> Optional[GGUFLinear]:
    if any(type(p) is not type(parts[0]) or p.in_features != parts[0].in_features for p in parts):
        return None
    return type(parts[0])(torch.cat([p.weight for p in parts]), parts[0].in_features, bias)


def _rows(fused: GGUFLinear, start: int, stop: int, bias: Optional[torch.Tensor]) -> GGUFLinear:
    return type(fused)(fused.weight[start:stop].clone(), fused.in_features, bias)


def _quantize(cls):
    block = G.block_size(cls.QTYPE)[0]

    def quantize(weight: torch.Tensor, bias: Optional[torch.Tensor], group: int) -> Optional[GGUFLinear]:
        return cls.from_dense(weight, bias) if weight.shape[1] % block == 0 else None

    return quantize


def _bytes(qtype: int):
    block = G.block_size(qtype)[0]

    def weight_bytes(shape: Tuple[int, int], group: int, dense: torch.dtype) -> int:
        if shape[1] % block:
            return shape[0] * shape[1] * dense.itemsize
        return G.tensor_bytes(qtype, shape)

    return weight_bytes


def split_rows(module: GGUFLinear, index: int, parts: int, dim: int) -> GGUFLinear:
    """Tensor parallel: rank ``index``'s share of a GGUF layer, split along the weight's ``dim`` (0: output
    rows, any count that ``parts`` divides; 1: inputs, only on block boundaries)."""
    out, n = module.out_features, module.in_features
    block, size = G.block_size(module.QTYPE)
    if dim == 0:
        step = out // parts
        return type(module)(module.weight[index * step:(index + 1) * step].clone(), n, module.bias)
    if n % (parts * block):
        raise ValueError(f"{G.type_name(module.QTYPE)} layer with {n} inputs cannot be split over {parts} ranks on "
                         f"its block boundaries ({block} values a block); use a dense file with quant=..., or "
                         "ulysses_degree / ring_degree instead of tensor parallel")
    per = n // parts // block * size
    return type(module)(module.weight[:, index * per:(index + 1) * per].contiguous(), n // parts, module.bias)


HELP = "GGUF block types, weight-only"
COMPUTE = "dequantized per forward, on the weight's device, to the input's dtype, then a dense GEMM (gguf/numerics.py)"


def _storage(qtype: int) -> str:
    block, size = G.block_size(qtype)
    return f"GGUF {G.type_name(qtype)}: blocks of {block} values in {size} bytes ({8 * size / block:.4g} bits a weight)"


GGUF_MODULES: Dict[str, type] = {}
for _name, _qtype in G.NAMES.items():
    if _name in DENSE_TYPES:
        continue
    _cls = type(f"GGUF{_name.upper()}Linear", (GGUFLinear,), {"QTYPE": _qtype, "__doc__": f"GGUF {_name.upper()} linear."})
    GGUF_MODULES[_name] = _cls
    register_format(WeightFormat(
        _name, _cls, parse=(lambda n: lambda text: 0 if text == n else None)(_name), choices=(_name,),
        quantize=_quantize(_cls), weight_bytes=_bytes(_qtype), from_stored=_from_stored(_cls),
        dequantize=_dequantize(_qtype), read_layers=_read_layers(_name, _qtype), concat=_concat, rows=_rows,
        packed=True, dense_why=f"have an input size that is not a whole number of {_name.upper()} blocks "
                               f"({G.block_size(_qtype)[0]} values)",
        split=split_rows, small_f32=True, help=HELP, storage=_storage(_qtype), compute=COMPUTE))
