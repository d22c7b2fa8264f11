"""Inpainting, img2img and latent batches through SGLDiffusion KSampler in a real ComfyUI (0.3.75): graphs of
ComfyUI's own nodes (SolidMask, MaskComposite, SetLatentNoiseMask, LatentFromBatch) give the same latent as
Engine.sample called with the same mask and batch_index, and keep the unmasked region. One server for the
module (tests/comfy_server.py); the tiny random ERNIE-shaped checkpoint and the test pack's text features."""
from __future__ import annotations

import os

import pytest
import torch

from engine import EngineConfig, open_engine
from engine.sampling import prepare_mask

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
except ImportError:
    import comfy_server as cs

TINY = "tiny-ernie.safetensors"
DIM = cs.text_dim()
SIZE = 128  # pixels; the latent is 8x8
EDGE = 72  # the mask is 0 left of this pixel column and REPAINT right of it (the latent column across it: half)
REPAINT = 0.6


test_pack = cs.load_test_pack()


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture with the shared base folder (TINY).


def pixel_mask() -> torch.Tensor:
    """The mask the graph's SolidMask + MaskComposite + SetLatentNoiseMask make, [1, 1, SIZE, SIZE]."""
    m = torch.zeros(1, 1, SIZE, SIZE)
    m[..., EDGE:] = REPAINT
    return m


def inpaint_graph(*, batch: int, cut=None, sampler: str, denoise: float, cfg: float) -> dict:
    """EmptyFlux2LatentImage -> SGLDiffusion KSampler (the input picture, saved by node 6) -> [LatentFromBatch
    ``cut`` = (index, length)] -> SetLatentNoiseMask -> SGLDiffusion KSampler -> SaveLatent (node 16)."""
    g = cs.tiny_graph(TINY, seed=3, steps=3, cfg=1.0, width=SIZE, height=SIZE, batch=batch, prefix="sgld/input")
    source = ["5", 0]
    if cut is not None:
        g["13"] = {"class_type": "LatentFromBatch", "inputs": {"samples": source, "batch_index": cut[0], "length": cut[1]}}
        source = ["13", 0]
    g.update({
        "10": {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": SIZE, "height": SIZE}},
        "11": {"class_type": "SolidMask", "inputs": {"value": REPAINT, "width": SIZE - EDGE, "height": SIZE}},
        "12": {"class_type": "MaskComposite", "inputs": {"destination": ["10", 0], "source": ["11", 0], "x": EDGE, "y": 0,
                                                         "operation": "add"}},
        "14": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": source, "mask": ["12", 0]}},
        "15": {"class_type": "SGLDiffusionKSampler", "inputs": {
            "model": ["1", 0], "seed": 4, "steps": 4, "cfg": cfg, "sampler_name": sampler, "scheduler": "simple",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["14", 0], "denoise": denoise}},
        "16": {"class_type": "SaveLatent", "inputs": {"samples": ["15", 0], "filename_prefix": "sgld/inpainted"}},
    })
    return g


def engine_result(comfy, *, batch, cut, sampler, denoise, cfg):
    """The same two runs through Engine.sample in this process."""
    engine = open_engine(os.path.join(comfy.base, "models", "diffusion_models", TINY), EngineConfig())
    cond, uncond = [test_pack.text_features(1, 7, DIM)[0]], [test_pack.text_features(2, 5, DIM)[0]]
    first = engine.sample(torch.zeros(batch, 128, SIZE // 16, SIZE // 16), cond, uncond, seed=3, steps=3, cfg=1.0)
    batch_index = None
    if cut is not None:
        first, batch_index = first[cut[0]:cut[0] + cut[1]], list(range(cut[0], cut[0] + cut[1]))
    out = engine.sample(first, cond, uncond, seed=4, steps=4, cfg=cfg, sampler=sampler, denoise=denoise,
                        noise_mask=pixel_mask(), batch_index=batch_index)
    return first, out


CASES = {
    "inpaint-img2img-euler": dict(batch=1, cut=None, sampler="euler", denoise=0.6, cfg=2.0),
    "batch-of-2-from-batch-heun": dict(batch=3, cut=(1, 2), sampler="heun", denoise=1.0, cfg=2.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_masked_graph_keeps_the_unmasked_region_and_equals_the_engine(comfy, case):
    kw = CASES[case]
    entry = comfy.run(inpaint_graph(**kw), timeout=180)
    assert entry["status"]["status_str"] == "success", entry["status"]
    first = cs.saved_latent(comfy, entry, "6")
    got = cs.saved_latent(comfy, entry, "16")
    want_input, want = engine_result(comfy, **kw)
    if kw["cut"] is not None:
        first = first[kw["cut"][0]:kw["cut"][0] + kw["cut"][1]]
    assert torch.equal(first, want_input)
    assert got.shape == first.shape == (2 if kw["cut"] else 1, 128, SIZE // 16, SIZE // 16)
    assert torch.equal(got, want), f"max abs diff {(got - want).abs().max().item()}"
    mask = prepare_mask(pixel_mask(), got.shape)
    keep = mask == 0
    assert keep[..., :4].all() and (mask[..., 4] == REPAINT / 2).all() and (mask[..., 5:] == REPAINT).all()
    torch.testing.assert_close(got[keep], first[keep], rtol=0, atol=1e-5)
    assert not torch.allclose(got[~keep], first[~keep], atol=1e-2)
    stats = entry["outputs"]["15"]["sgld_stats"][0]
    assert stats["steps"] == 4 and stats["state"] == "done"


BAD = {
    "out-of-range": (dict(value=1.5, channels=1), "noise_mask values must be from 0 (keep) to 1 (repaint) (got 1.5 to 1.5)"),
    "nan": (dict(value=float("nan"), channels=1), "noise_mask holds NaN or inf values"),
    "per-channel": (dict(value=1.0, channels=128), "noise_mask has shape (1, 128, 8, 8); expected [height, width], "
                                                   "[batch, height, width] or [batch, 1, height, width]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_mask_gives_a_clear_error(comfy, case):
    inputs, message = BAD[case]
    g = cs.tiny_graph(TINY, seed=5, steps=2, width=SIZE, height=SIZE)
    g["20"] = {"class_type": "SGLDTestNoiseMask", "inputs": {"samples": ["4", 0], **inputs}}
    g["5"]["inputs"]["latent_image"] = ["20", 0]
    entry = comfy.run(g, timeout=60)
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = cs.error_message(entry)
    assert err["node_type"] == "SGLDiffusionKSampler", err
    assert err["exception_message"].startswith(f"SGLDiffusion KSampler: {message}"), err["exception_message"]
    assert "Traceback" not in err["exception_message"]
    assert comfy.alive()
