"""Tensor parallel at load: which tensors are split along which dim, and a rank's shard of a checkpoint."""
from __future__ import annotations

from typing import Optional

import torch

COLUMN_SHARDED = ("self_attention.to_q.weight", "self_attention.to_k.weight", "self_attention.to_v.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight")
ROW_SHARDED = ("self_attention.to_out.0.weight", "mlp.linear_fc2.weight")


# -- tensor parallel ---------------------------------------------------------------------------------
def shard_spec(key: str) -> Optional[int]:
    """The dim a block tensor is split along under TP (0 = column / output features, 1 = row), or None."""
    if not key.startswith("layers."):
        return None
    rest = key.split(".", 2)[2]
    if rest in COLUMN_SHARDED:
        return 0
    if rest in ROW_SHARDED:
        return 1
    return None


def shard_tensor(key: str, t: torch.Tensor, tp: int, index: int) -> torch.Tensor:
    dim = shard_spec(key)
    if dim is None or tp == 1:
        return t
    return t.chunk(tp, dim=dim)[index].contiguous()


def make_tp_skeleton(cfg, tp: int):
    """An ERNIE-Image model on the meta device whose block linears have their TP-shard shapes."""
    from torch import nn

    from ..io.checkpoint import build_model

    model = build_model(cfg, "meta")
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    with torch.device("meta"):
        for block in model.layers:
            a = block.self_attention
            a.heads = cfg.num_attention_heads // tp
            a.to_q, a.to_k, a.to_v = (nn.Linear(h, h // tp, bias=False) for _ in range(3))
            a.to_out[0] = nn.Linear(h // tp, h, bias=False)
            m = block.mlp
            m.gate_proj = nn.Linear(h, f // tp, bias=False)
            m.up_proj = nn.Linear(h, f // tp, bias=False)
            m.linear_fc2 = nn.Linear(f // tp, h, bias=False)
    return model


def load_tp_shard(path: str, tp: int, index: int, dtype=None, device="cpu"):
    """Read a checkpoint and keep only this TP rank's slices (one tensor in memory at a time)."""
    from ..io.checkpoint import Checkpoint, check_architecture, parse_dtype
    from ..io.safetensors import CheckpointError
    from ..features import quant as quantization

    ckpt = Checkpoint(str(path))
    cfg = check_architecture(ckpt)
    if quantization.is_quantized_checkpoint(ckpt):
        raise CheckpointError(f"{ckpt.describe()}: tensor parallel needs a dense (bf16/fp16/fp32) checkpoint; this one is "
                              "pre-quantized. Use ulysses_degree / ring_degree / cfg_parallel, or the dense file with quant=...")
    target = parse_dtype(dtype) or ckpt.stored_dtype()
    model = make_tp_skeleton(cfg, tp)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = {}
    for k, t in ckpt.tensors(dtype=target):
        if k not in expected:
            raise CheckpointError(f"{ckpt.describe()}: unexpected tensor '{k}' for the ERNIE-Image architecture")
        t = shard_tensor(k, t, tp, index)
        if tuple(t.shape) != expected[k]:
            raise CheckpointError(f"{ckpt.describe()}: tensor '{k}' has shard shape {tuple(t.shape)}, expected {expected[k]}")
        state[k] = t.to(device)
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{ckpt.describe()}: {len(missing)} tensors missing (first: {missing[0]})")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
