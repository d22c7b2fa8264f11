"""The shipped demo weights: load through the engine, sample, and the judge accepts the images."""
import os

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, load_model
from engine.features import quant as Q
from engine.models.demo import DEFAULT_CFG, DEFAULT_SAMPLER, DEFAULT_STEPS, DEMO_WEIGHTS, is_demo_file, load_demo
from tools.demo import judge

# (prompt, seed) pairs checked at FEW_STEPS; all passed when the weights were trained.
FEW_STEPS = 12
CASES = [
    ("a large red circle on the left, on a blue background", 0),
    ("a large green circle at the bottom, on a white background", 1),
]


def test_weights_are_shipped_small_fp16():
    assert os.path.isfile(DEMO_WEIGHTS)
    assert os.path.getsize(DEMO_WEIGHTS) <= 20 * 1024 * 1024
    assert is_demo_file(DEMO_WEIGHTS)
    model = load_model(DEMO_WEIGHTS)  # the engine's own loader, as stored
    assert model.dtype == torch.float16
    cfg = model.config
    assert (cfg.in_channels, cfg.out_channels) == (48, 48)
    assert sum(cfg.rope_axes_dim) == cfg.head_dim


def test_encode_decode_api():
    demo = load_demo()
    feats = demo.encode(["a large red circle on the left, on a blue background", ""])
    assert len(feats) == 2 and feats[1].shape[0] == 1
    assert feats[0].shape[1] == demo.dit.config.text_in_dim
    assert demo.empty_latent(2).shape == (2, 48, 16, 16)
    img = np.random.default_rng(0).integers(0, 256, size=(1, 64, 64, 3), dtype=np.uint8)
    assert np.array_equal(demo.decode(demo.encode_image(img)), img)
    assert demo.decode_float(demo.encode_image(img)).shape == (1, 64, 64, 3)
    assert DEFAULT_STEPS == 30 and DEFAULT_SAMPLER == "euler" and DEFAULT_CFG > 1.0


@pytest.mark.parametrize("prompt,seed", CASES)
def test_engine_samples_the_demo_model(prompt, seed):
    demo = load_demo()
    engine = Engine(demo.dit)  # the plain engine, unchanged
    latent = engine.sample(demo.empty_latent(1), demo.encode([prompt]), demo.encode([""]), seed=seed,
                           steps=FEW_STEPS, cfg=DEFAULT_CFG, sampler="euler")
    img = demo.decode(latent)[0]
    res = judge.judge(img, prompt)
    assert res["pass"], res
    # the same seed gives the same image; a different prompt gives a different one
    demo.engine = engine
    again = demo.generate(prompt, seed=seed, steps=FEW_STEPS)[0]
    assert np.array_equal(again, img)


def assert_the_judge_passes_close_to_fp16(make_engine) -> float:
    """The picture of CASES[0] from ``make_engine()`` (a quantized engine of the demo DiT), sampled under
    inference_mode as ComfyUI runs it: the judge accepts it, and its PSNR against the fp16 model's picture is
    above 25 dB (returned)."""
    prompt, seed = CASES[0]
    demo = load_demo(cached=False)
    cond, uncond = demo.encode([prompt]), demo.encode([""])
    images = []
    with torch.inference_mode():
        for engine in (Engine(demo.dit), make_engine()):
            images.append(demo.decode(engine.sample(demo.empty_latent(1), cond, uncond, seed=seed, steps=FEW_STEPS,
                                                    cfg=DEFAULT_CFG, sampler="euler"))[0])
    ref, img = images
    res = judge.judge(img, prompt)
    assert res["pass"], res
    mse = np.mean((img.astype(np.float64) - ref.astype(np.float64)) ** 2)
    psnr = 10 * np.log10(255.0 ** 2 / max(mse, 1e-12))
    assert psnr > 25, psnr
    return psnr


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["int8", "int8-weight"])
def test_the_demo_picture_through_int8_passes_the_judge(quant):
    """The demo DiT's block linears in int8 (W8A8: the int8 matmul; or weight-only): the judge still accepts
    the picture, which is close to the fp16 model's."""
    def make_engine():
        engine = Engine(load_demo(cached=False).dit, EngineConfig(quant=quant))
        assert engine.describe()["quant"] == quant and Q.model_quant_format(engine.model) == quant
        return engine

    assert_the_judge_passes_close_to_fp16(make_engine)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_the_demo_picture_through_a_gguf_file_passes_the_judge(tmp_path, fmt):
    """The demo DiT written as a GGUF file by `sgld quantize --format q8_0|q4_k` (Q4_K's 384-input rows take
    llama.cpp's fallback, Q5_0, as any converter would), loaded from that file with its block linears kept in
    their GGUF types and dequantized per layer: the judge accepts the picture, close to the fp16 model's."""
    from engine.features.quant.gguf.convert import quantize_gguf_file
    from engine.features.quant.gguf.linear import GGUFLinear

    path = str(tmp_path / f"demo-{fmt}.gguf")
    assert quantize_gguf_file(DEMO_WEIGHTS, path, fmt)["types"].get(fmt.upper(), 0) > 0  # the asked type is in it

    def make_engine():
        model = load_model(path, dtype="fp32")
        assert sum(isinstance(m, GGUFLinear) for m in model.modules()) == 7 * model.config.num_layers
        return Engine(model)

    assert_the_judge_passes_close_to_fp16(make_engine)
