"""Z-Image's files as users download them, read in our names (engine/io/layouts.py over the family's ``Layout``):
ComfyUI's repack (q, k and v fused; ComfyUI's own NextDiT gives the velocity), a GGUF made from it (Q8_0 blocks kept),
and ComfyUI's fp8 files in those names (one scale for the fused tensor)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from engine import EngineConfig, open_engine
from engine.models import get
from engine.models.zimage import ZImageConfig, ZImageTransformer

COMFY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "ComfyUI")


COMFY_NEXTDIT = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from comfy.cli_args import args
args.cpu = True
import comfy.ops
from comfy.ldm.lumina.model import NextDiT
from safetensors.torch import save_file
torch.manual_seed(0)
model = NextDiT(patch_size=2, in_channels=16, dim=256, n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=4,
                multiple_of=256, ffn_dim_multiplier=8.0 / 3.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=24,
                axes_dims=[16, 24, 24], axes_lens=[1536, 512, 512], rope_theta=256.0, z_image_modulation=True,
                time_scale=1000.0, pad_tokens_multiple=32, operations=comfy.ops.disable_weight_init).eval()
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.2)
g = torch.Generator().manual_seed(1)
x, ctx, sigma = torch.randn(2, 16, 12, 10, generator=g), torch.randn(2, 9, 24, generator=g), torch.tensor([0.8, 0.35])
with torch.no_grad():
    out = model(x, sigma, ctx, num_tokens=9)  # ComfyUI's Z-Image timestep is sigma (multiplier 1)
save_file({"model.diffusion_model." + k: v.contiguous() for k, v in model.state_dict().items()}, sys.argv[2])
save_file({"x": x, "ctx": ctx, "sigma": sigma, "out": out}, sys.argv[3])
"""


@pytest.mark.subprocess
def test_comfyuis_repack_layout_loads_and_matches_comfyuis_own_z_image(tmp_path):
    """A file in Z-Image's original names (q, k, v fused; ComfyUI's z_image_turbo_bf16.safetensors keeps them) is
    read in ours, its fused q/k/v split, and our forward gives ComfyUI's own NextDiT's velocity."""
    from safetensors.torch import load_file

    if not os.path.isfile(os.path.join(COMFY, "comfy", "ldm", "lumina", "model.py")):
        pytest.skip("the installed ComfyUI (.cache/ComfyUI, scripts/comfyui.sh) is needed for its Z-Image")
    weights, io = tmp_path / "z_image_turbo_small.safetensors", tmp_path / "io.safetensors"
    subprocess.run([sys.executable, "-c", COMFY_NEXTDIT, COMFY, str(weights), str(io)], check=True, timeout=300,
                   capture_output=True)
    t = load_file(str(io))
    eng = open_engine(str(weights), EngineConfig(dtype="fp32"))
    cfg = eng.model_config  # ComfyUI's time MLP is min(dim, 1024) wide (the smallest width its Z-Image builds: 256)
    assert (cfg.hidden_size, cfg.time_mid_dim, cfg.ffn_hidden_size, cfg.rope_axes_dim) == (256, 256, 768, (16, 24, 24))
    with torch.inference_mode():
        got = eng.dit_forward(t["x"], t["sigma"] * 1000, t["ctx"], torch.tensor([9, 9]))
    torch.testing.assert_close(got, t["out"], rtol=1e-4, atol=1e-4 * t["out"].abs().max().item())


def _to_original(sd: dict) -> dict:
    """Our names -> Z-Image's original ones (ComfyUI's repack, the GGUF files made from it): q, k, v fused."""
    from engine.models.zimage.config import ORIGINAL_LAYOUT

    out = {}
    for k, v in sd.items():
        if ".attention.to_k." in k or ".attention.to_v." in k:
            continue
        if k.endswith(".attention.to_q.weight"):
            stem = k[: -len(".attention.to_q.weight")]
            out[stem + ".attention.qkv.weight"] = torch.cat([sd[f"{stem}.attention.to_{c}.weight"] for c in "qkv"])
            continue
        for theirs, ours in ORIGINAL_LAYOUT.renames:
            k = k.replace(ours, theirs)
        out[k] = v
    return out


def test_a_gguf_file_in_the_original_layout(tmp_path):
    """A Z-Image GGUF in the original names with ComfyUI-GGUF's prefix, its 2-D weights in Q8_0 (q, k and v fused
    in one block-quantized tensor): the fused rows split when read, and the engine's forward equals our model on
    gguf's own dequantization of the same bytes."""
    from gguf_files import Q, reference_state, write_gguf

    from engine.models.zimage.config import ORIGINAL_LAYOUT

    cfg = ZImageConfig(hidden_size=256, num_layers=2, num_refiner_layers=1, num_attention_heads=4,
                       ffn_hidden_size=512, text_in_dim=256, rope_axes_dim=(16, 24, 24), time_mid_dim=256)
    torch.manual_seed(0)
    original = _to_original(ZImageTransformer(cfg).state_dict())
    types = {k: Q.Q8_0 if k.endswith(".weight") and v.dim() == 2 and v.shape[-1] % 32 == 0 else Q.F32
             for k, v in original.items()}
    path = write_gguf(tmp_path / "z_image_turbo-Q8_0.gguf", original, types, "comfy")
    ours = {}
    for k, v in reference_state(path).items():  # gguf's dequantization, in our names
        for name, part in ORIGINAL_LAYOUT.translate(k):
            ours[name] = v if part is None else v.chunk(part[1])[part[0]]
    eng = open_engine(path, EngineConfig(dtype="fp32"))
    assert eng.describe()["quant"] == "q8_0"  # the block linears stay Q8_0 blocks (the fused rows split)
    _forward_equals_dense(eng, cfg, ours, seed=5)


def _forward_equals_dense(eng, cfg, dense: dict, seed: int):
    """The engine's forward equals our model holding ``dense`` (our names), within float noise."""
    ref = ZImageTransformer(cfg).eval()
    ref.load_state_dict(dense)
    g = torch.Generator().manual_seed(seed)
    x, text = torch.randn(1, 16, 8, 6, generator=g), torch.randn(1, 7, cfg.text_in_dim, generator=g)
    with torch.inference_mode():
        got = eng.dit_forward(x, torch.tensor([400.0]), text, torch.tensor([7]))
        want = ref(x, torch.tensor([400.0]), text, torch.tensor([7]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("style", ["scaled_fp8", "comfy_quant"])
def test_an_fp8_file_in_the_original_layout(tmp_path, style):
    """ComfyUI's fp8 files of Z-Image keep the original names: the fused qkv is one e4m3 tensor with one scale (legacy
    ``scale_weight`` + the ``scaled_fp8`` marker, or ``weight_scale`` + a ``comfy_quant`` tag). Each part takes its
    rows and the whole scale and tag: the layers load as fp8 and the forward equals our model on the dequantized
    weights (weight x scale, ComfyUI's own reading)."""
    import json

    from engine.features import quant as Q

    cfg = ZImageConfig(hidden_size=64, num_layers=2, num_refiner_layers=1, num_attention_heads=4, ffn_hidden_size=128,
                       text_in_dim=32, rope_axes_dim=(4, 6, 6), time_mid_dim=64)
    torch.manual_seed(0)
    ours = ZImageTransformer(cfg).state_dict()
    stored, dense = {}, {}
    for k, v in _to_original(ours).items():
        if k.startswith("layers.") and k.endswith(".weight") and v.dim() == 2:
            scale = v.abs().amax() / 448.0
            stored[k] = (v / scale).to(torch.float8_e4m3fn)
            stem = k[: -len(".weight")]
            if style == "scaled_fp8":
                stored[stem + ".scale_weight"] = scale.reshape(())
            else:
                stored[stem + ".weight_scale"] = scale.reshape(())
                stored[stem + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                             dtype=torch.uint8)
            dense[k] = stored[k].float() * scale
        else:
            stored[k] = dense[k] = v
    if style == "scaled_fp8":
        stored["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    path = tmp_path / f"z_image_turbo_fp8_{style}.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in stored.items()}, str(path))
    eng = open_engine(str(path), EngineConfig(dtype="fp32"))
    assert eng.describe()["quant"] == "fp8" and Q.model_quant_format(eng.model) == "fp8"
    _forward_equals_dense(eng, cfg, {n: dense[k] if p is None else dense[k].chunk(p[1])[p[0]]
                                     for k in dense for n, p in get("z-image").layouts[0].translate(k)}, seed=9)
