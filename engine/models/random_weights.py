"""Random ERNIE-Image models of named sizes, for tests and benchmarks (no weights to download)."""
from __future__ import annotations

import json
import os
from typing import Dict

import torch
from safetensors.torch import save_file

from ..io.atomic import private_dir
from .ernie_image import ErnieImageConfig, ErnieImageTransformer

SIZES: Dict[str, ErnieImageConfig] = {
    # 2 layers, 4 heads of 16: the unit-test size.
    "tiny": ErnieImageConfig(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=192,
                             in_channels=16, out_channels=16, text_in_dim=48, rope_axes_dim=(4, 6, 6)),
    # ~30M parameters.
    "small": ErnieImageConfig(hidden_size=512, num_layers=8, num_attention_heads=8, ffn_hidden_size=1536,
                              in_channels=128, out_channels=128, text_in_dim=256, rope_axes_dim=(16, 24, 24)),
    # ~120M parameters.
    "medium": ErnieImageConfig(hidden_size=768, num_layers=16, num_attention_heads=12, ffn_hidden_size=2304,
                               in_channels=128, out_channels=128, text_in_dim=512, rope_axes_dim=(16, 24, 24)),
    # The released shape (8.03B parameters): for GPU machines.
    "8b": ErnieImageConfig(),
}


def random_state_dict(cfg: ErnieImageConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Deterministic weights scaled so activations stay O(1) through every layer."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in ErnieImageTransformer(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in shapes.items():
        if k.endswith("norm_q.weight") or k.endswith("norm_k.weight") or k.endswith("_ln.weight"):
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif k.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        else:
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            t = torch.randn(shape, generator=g) / fan_in ** 0.5
            if k.startswith("adaLN_modulation") or k.startswith("final_norm"):
                t = t * 0.3
        out[k] = t.to(dtype)
    return out


def random_model(cfg: ErnieImageConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> ErnieImageTransformer:
    with torch.device("meta"):
        model = ErnieImageTransformer(cfg)
    model.load_state_dict(random_state_dict(cfg, seed, dtype), assign=True)
    return model.eval().requires_grad_(False)


def save_random_checkpoint(path: str, cfg: ErnieImageConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                           prefix: str = "") -> None:
    sd = {prefix + k: v.contiguous() for k, v in random_state_dict(cfg, seed, dtype).items()}
    save_file(sd, path, metadata={"ernie_image_config": json.dumps({"rope_axes_dim": list(cfg.rope_axes_dim)})})


def random_model_on_device(cfg: ErnieImageConfig, device="cpu", dtype: torch.dtype = torch.float32,
                           seed: int = 0) -> ErnieImageTransformer:
    """A random model built on the meta device and materialized once, in ``dtype``, on ``device``:
    no float32 copy and no CPU copy (the 8B shape in bf16 is 16 GB on the GPU, never 32 GB). The
    weights have ``random_state_dict``'s scales but come from ``device``'s generator, so they are
    deterministic per device and seed, not equal to ``random_model``'s."""
    device = torch.device(device)
    with torch.device("meta"):
        model = ErnieImageTransformer(cfg)
    model = model.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "_ln.weight")):
                p.normal_(1.0, 0.1, generator=g)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02, generator=g)
            else:
                fan_in = 1
                for d in p.shape[1:]:
                    fan_in *= d
                scale = 0.3 if name.startswith(("adaLN_modulation", "final_norm")) else 1.0
                p.normal_(0.0, scale / fan_in ** 0.5, generator=g)
    return model.eval().requires_grad_(False)


def random_checkpoint(size: str, dtype=None) -> str:
    """A random model of a named size written once to this user's private temporary folder (parallel workers
    load files; ranks on one machine share it)."""
    if size not in SIZES:
        raise ValueError(f"size {size!r} is unknown; choose one of {', '.join(SIZES)}")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: torch.float32}.get(dtype, torch.float32)
    path = os.path.join(private_dir("sgld-random"), f"{size}-{str(dt).replace('torch.', '')}.safetensors")
    if not os.path.exists(path):
        tmp = path + f".{os.getpid()}.tmp"
        save_random_checkpoint(tmp, SIZES[size], seed=0, dtype=dt)
        os.replace(tmp, path)
    return path
