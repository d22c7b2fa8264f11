"""Layer-wise offload in a real ComfyUI (0.3.75, from scripts/comfyui.sh), which runs every node under
torch.inference_mode: graphs through the SGLDiffusion Model Loader with ``offload: layerwise`` give
the resident graph's latent bit for bit (plain weights, fp8, and with a LoRA merged while offloaded).
On this CPU-only machine ComfyUI's device is the CPU, so the "device" buffers are CPU tensors, but the
offloader is the real one (the run's stats say layerwise, with the number of resident blocks), and
the same code path runs: only the stream / event calls are no-ops. One server for the whole module."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
except ImportError:
    import comfy_server as cs

MODEL = "tiny-ernie-4-blocks.safetensors"
LORA = "tiny-lora.safetensors"
BLOCKS = 4  # more blocks than the 2 default layer buffers: blocks really stream


def write_checkpoint(path: str) -> str:
    from engine.models.random_weights import save_random_checkpoint

    save_random_checkpoint(path, dataclasses.replace(cs.tiny_config(), num_layers=BLOCKS), seed=3)
    return path


def write_lora(path: str, rank: int = 2) -> str:
    """A diffusers-format LoRA on a block linear and a non-block linear of the tiny model."""
    from safetensors.torch import save_file

    cfg = cs.tiny_config()
    g = torch.Generator().manual_seed(5)
    shapes = {"layers.1.mlp.up_proj": (cfg.ffn_hidden_size, cfg.hidden_size),
              "layers.3.self_attention.to_q": (cfg.hidden_size, cfg.hidden_size),
              "text_proj": (cfg.hidden_size, cfg.text_in_dim)}
    sd = {}
    for name, (out_f, in_f) in shapes.items():
        sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
        sd[f"transformer.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
    save_file(sd, path, metadata={"format": "pt"})
    return path


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture with the shared base folder; this adds
# the module's own files to it (for this module's tests only).
def comfy_files(base):
    models = os.path.join(base, "models")
    write_checkpoint(os.path.join(models, "diffusion_models", MODEL))
    os.makedirs(os.path.join(models, "loras"), exist_ok=True)
    write_lora(os.path.join(models, "loras", LORA))


def graph(seed: int, options: dict, lora: bool = False) -> dict:
    g = cs.tiny_graph(MODEL, seed=seed, steps=3, cfg=2.5, width=96, height=64, loader_options=options,
                      prefix=f"sgld/offload-{seed}-{'-'.join(f'{k}{v}' for k, v in options.items())}-{lora}")
    if lora:
        g["7"] = {"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": ["1", 0], "lora_name": LORA, "strength": 0.8}}
        g["5"]["inputs"]["model"] = ["7", 0]
    return g


def run(comfy, seed: int, options: dict, lora: bool = False):
    entry = comfy.run(graph(seed, options, lora), timeout=180)
    err = cs.error_message(entry) or {}
    assert entry["status"]["status_str"] == "success", f"{err.get('node_type')}: {err.get('exception_message')}"
    return cs.saved_latent(comfy, entry), entry["outputs"]["5"]["sgld_stats"][0]


CASES = {"plain": (31, {}, False), "fp8": (32, {"quant": "fp8"}, False), "lora": (33, {}, True)}


@pytest.mark.parametrize("case", list(CASES))
def test_layerwise_offload_equals_resident(comfy, case):
    seed, options, lora = CASES[case]
    resident, stats = run(comfy, seed, dict(options, offload="none"), lora)
    assert stats["offload"] == "none" and stats["quant"] == options.get("quant", "none")
    for resident_layers in (2, 1):
        got, stats = run(comfy, seed, dict(options, offload="layerwise", resident_layers=resident_layers), lora)
        # the loader built a LayerwiseOffload (ComfyUI's device here: the CPU), with that many buffers
        assert stats["offload"] == "layerwise", stats
        assert stats["offload_detail"] == f"{resident_layers}/{BLOCKS} blocks resident", stats
        assert stats["quant"] == options.get("quant", "none") and stats["warnings"] == []
        assert got.shape == resident.shape == (1, 128, 4, 6)
        # the same kernels on the same weights: bit-equal, not merely close
        assert torch.equal(got, resident), f"max abs diff {(got - resident).abs().max().item()}"
    if lora:  # the LoRA changed the result: it was merged into the offloaded masters, not ignored
        base, _ = run(comfy, seed, dict(options, offload="layerwise"), False)
        assert not torch.equal(base, resident)
