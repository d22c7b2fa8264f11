"""ComfyUI's own samplers on the Model Loader's MODEL output (comfy_model), in a real ComfyUI 0.3.75 server:
KSampler, KSamplerAdvanced and SamplerCustomAdvanced equal SGLDiffusion KSampler on the same engine (cache off
and on, through SGLDiffusion Apply Cache-DiT), ComfyUI's LoraLoaderModelOnly equals the engine's LoRA, /free
unloads the engine, and the demo model makes a picture the judge passes. One server for the module."""
from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import save_file

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
except ImportError:
    import comfy_server as cs

MODEL = cs.TINY  # the shared base folder's tiny checkpoint
LORA = "tiny-comfy-lora.safetensors"
LYCORIS = {"lokr": "tiny-comfy-lokr.safetensors", "loha": "tiny-comfy-loha.safetensors"}
DEMO = "sgld-demo (embedded, 64x64)"


def write_lora(path: str, rank: int = 2) -> str:
    """A LoRA in ComfyUI's own key format (diffusion_model.<name>.lora_up/lora_down, alpha) on block and
    non-block linears of the tiny model, fused ones included (to_q, gate_proj)."""
    cfg = cs.tiny_config()
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    g = torch.Generator().manual_seed(7)
    sd = {}
    for name, (out_f, in_f) in {"layers.0.self_attention.to_q": (h, h), "layers.1.mlp.gate_proj": (f, h),
                                "layers.0.self_attention.to_out.0": (h, h), "text_proj": (h, cfg.text_in_dim)}.items():
        sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
        sd[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(float(rank) * 0.5)
    save_file(sd, path)
    return path


def write_lycoris(path: str, kind: str) -> str:
    """A LyCORIS LoKr (w1 full, w2 decomposed, alpha) or LoHa file in ComfyUI's key format
    (diffusion_model.<name>.lokr_* / hada_*) on block and non-block linears, fused ones included."""
    cfg = cs.tiny_config()
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    g = torch.Generator().manual_seed(8)
    sd = {}
    for name, (out_f, in_f) in {"layers.0.self_attention.to_q": (h, h), "layers.1.mlp.gate_proj": (f, h),
                                "text_proj": (h, cfg.text_in_dim)}.items():
        key = f"diffusion_model.{name}"
        if kind == "lokr":
            sd.update({f"{key}.lokr_w1": torch.randn(4, 4, generator=g), f"{key}.lokr_w2_a": torch.randn(out_f // 4, 2, generator=g),
                       f"{key}.lokr_w2_b": torch.randn(2, in_f // 4, generator=g) * 0.2})
        else:
            sd.update({f"{key}.hada_w{i}_{ab}": torch.randn(*shape, generator=g) * 0.5
                       for i in (1, 2) for ab, shape in (("a", (out_f, 2)), ("b", (2, in_f)))})
        sd[f"{key}.alpha"] = torch.tensor(1.0)
    save_file(sd, path)
    return path


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture, a profile of its own (the shared base folder,
# MODEL its tiny checkpoint, plus LORA): on the shared server, test_free_unloads_our_model_and_the_next_run_reloads_it
# once found the model still loaded 30 s after /free (a whole `-m server` run; not seen again in the shared sequence).
def comfy_base(base):
    cs.shared_base(base)
    write_lora(os.path.join(base, "models", "loras", LORA))
    for kind, name in LYCORIS.items():
        write_lycoris(os.path.join(base, "models", "loras", name), kind)


def run_ok(server, prompt, timeout=240) -> dict:
    entry = server.run(prompt, timeout=timeout)
    assert entry["status"]["status_str"] == "success", f"{cs.error_message(entry)}\n{server.log()[-3000:]}"
    return entry


def ours_and_comfys(model=MODEL, *, seed=3, steps=4, cfg=3.0, sampler="euler", scheduler="simple", denoise=1.0,
                    cache=None, lora=None, comfy_lora=None, weight_dtype="fp32", loader_options=None):
    """One graph: SGLDiffusion KSampler (-> SaveLatent 6) and ComfyUI's KSampler on comfy_model (-> SaveLatent 8)
    with the same inputs. ``cache``: a Cache-DiT preset for both; ``lora``: SGLDiffusion LoRA Loader on both
    outputs; ``comfy_lora``: LoraLoaderModelOnly on comfy_model and SGLDiffusion LoRA Loader on the other."""
    g = cs.tiny_graph(model, seed=seed, steps=steps, cfg=cfg, sampler=sampler, scheduler=scheduler, denoise=denoise,
                      weight_dtype=weight_dtype, loader_options=loader_options)
    ours, theirs = ["1", 0], ["1", 1]
    if lora or comfy_lora:
        g["20"] = {"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": ours, "lora_name": lora or comfy_lora,
                                                                       "strength": 0.7}}
        ours = ["20", 0]
        g["21"] = ({"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": theirs, "lora_name": lora, "strength": 0.7}}
                   if lora else {"class_type": "LoraLoaderModelOnly",
                                 "inputs": {"model": theirs, "lora_name": comfy_lora, "strength_model": 0.7}})
        theirs = ["21", 1 if lora else 0]  # the LoRA Loader's comfy_model output
    if cache:
        g["10"] = {"class_type": "SGLDiffusionCacheDiT", "inputs": {"enabled": True, "preset": cache, "advanced": False}}
        g["5"]["inputs"]["cache"] = ["10", 0]
        g["11"] = {"class_type": "SGLDiffusionApplyCacheDiT", "inputs": {"model": theirs, "cache": ["10", 0]}}
        theirs = ["11", 0]
    g["5"]["inputs"]["model"] = ours
    g["7"] = {"class_type": "KSampler", "inputs": {
        "model": theirs, "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler,
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": denoise}}
    g["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "sgld/comfy"}}
    return g


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= tol * float(b.abs().max())


def both(server, graph):
    entry = run_ok(server, graph)
    return cs.saved_latent(server, entry, "6"), cs.saved_latent(server, entry, "8"), entry


@pytest.mark.parametrize("sampler, scheduler, denoise", [("euler", "simple", 1.0), ("heun", "beta", 1.0),
                                                         ("dpmpp_2m", "normal", 0.6)])
def test_comfyuis_ksampler_on_our_model_equals_sgldiffusion_ksampler(comfy, sampler, scheduler, denoise):
    ours, theirs, _ = both(comfy, ours_and_comfys(sampler=sampler, scheduler=scheduler, denoise=denoise))
    assert close(theirs, ours), float((theirs - ours).abs().max())
    assert float(theirs.std()) > 0.1  # a real sample, not the empty latent


@pytest.mark.parametrize("denoise", [1.0, 0.6])
def test_inpainting_with_comfyuis_ksampler_on_our_model_equals_sgldiffusion_ksampler(comfy, denoise):
    """SetLatentNoiseMask on a sampled latent (left quarter kept): both samplers blend the mask the same way."""
    g = ours_and_comfys(seed=12, denoise=denoise)
    g["40"] = {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": 128, "height": 128}}
    g["41"] = {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": 96, "height": 128}}
    g["42"] = {"class_type": "MaskComposite", "inputs": {"destination": ["40", 0], "source": ["41", 0], "x": 32, "y": 0,
                                                         "operation": "add"}}
    g["43"] = {"class_type": "KSampler", "inputs": {**g["7"]["inputs"], "seed": 1, "denoise": 1.0}}  # a picture to repaint
    g["44"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["43", 0], "mask": ["42", 0]}}
    g["5"]["inputs"]["latent_image"] = ["44", 0]
    g["7"]["inputs"]["latent_image"] = ["44", 0]
    g["45"] = {"class_type": "SaveLatent", "inputs": {"samples": ["43", 0], "filename_prefix": "sgld/source"}}
    entry = run_ok(comfy, g)
    ours, theirs, source = (cs.saved_latent(comfy, entry, n) for n in ("6", "8", "45"))
    assert close(theirs, ours), float((theirs - ours).abs().max())
    kept = (slice(None), slice(None), slice(None), slice(0, 2))  # latent columns under the mask's 0 (32 px / 16)
    assert torch.allclose(ours[kept], source[kept], atol=1e-5) and not torch.allclose(ours, source, atol=1e-3)


@pytest.mark.parametrize("options", [{"offload": "layerwise", "resident_layers": 1}, {"quant": "fp8"}, {"num_gpus": 2},
                                     {"compile": "static"}], ids=["offload", "fp8", "two-ranks", "compile"])
def test_the_loaders_engine_options_apply_to_comfy_model(comfy, options):
    """Offload, quantization, several ranks and compile: ComfyUI's KSampler runs the same engine as ours."""
    ours, theirs, _ = both(comfy, ours_and_comfys(seed=9, loader_options=options))
    assert close(theirs, ours), float((theirs - ours).abs().max())
    described = comfy.get("/sgldiffusion/models").json()["loaded"]
    assert any(d["options"].get(k) == v for d in described for k, v in options.items() if k != "resident_layers"), described


def test_ksampler_advanced_on_our_model_equals_sgldiffusion_ksampler(comfy):
    g = ours_and_comfys(seed=11, steps=5)
    inputs = g["7"]["inputs"]
    g["7"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "model": inputs["model"], "add_noise": "enable", "noise_seed": 11, "steps": 5, "cfg": 3.0, "sampler_name": "euler",
        "scheduler": "simple", "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "start_at_step": 0,
        "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    ours, theirs, _ = both(comfy, g)
    assert close(theirs, ours), float((theirs - ours).abs().max())


def test_apply_cache_dit_gives_sgldiffusion_ksamplers_step_mask_and_latent(comfy):
    ours, theirs, _ = both(comfy, ours_and_comfys(steps=12, cache="fast", sampler="heun", seed=5))
    assert close(theirs, ours), float((theirs - ours).abs().max())
    logged = [m for m in comfy.log().splitlines() if "model calls computed, Cache-DiT" in m]
    assert logged, comfy.log()[-3000:]
    comfys_mask = logged[-1].rsplit("Cache-DiT ", 1)[1].strip()
    timeline = comfy.get("/sgldiffusion/last_runs", params={"workflow": ""}).json()["runs"]["5"]["timeline"]
    assert comfys_mask == "".join("x" if c else "." for c in timeline) and "." in comfys_mask
    assert len(comfys_mask) == 2 * 12 - 1  # heun: two calls a step but the last
    uncached, _, _ = both(comfy, ours_and_comfys(steps=12, sampler="heun", seed=5))
    assert not close(ours, uncached, 1e-6)  # the cache really skipped calls


def test_sampler_custom_advanced_with_custom_sigmas_equals_the_engine_with_those_sigmas(comfy):
    """BasicScheduler -> SetFirstSigma (a schedule no scheduler makes) -> SamplerCustomAdvanced with BasicGuider,
    against Engine.sample with the same sigmas, noise seed and text features, in this process."""
    from engine import EngineConfig, open_engine
    from engine.sampling import DEFAULT_SHIFT, sigma_schedule

    g = cs.tiny_graph(MODEL, seed=4, steps=3, cfg=1.0, weight_dtype="fp32")
    for node in ("5", "6"):
        del g[node]
    g.update({
        "30": {"class_type": "BasicScheduler", "inputs": {"model": ["1", 1], "scheduler": "simple", "steps": 3, "denoise": 1.0}},
        "35": {"class_type": "SetFirstSigma", "inputs": {"sigmas": ["30", 0], "sigma": 0.93}},
        "31": {"class_type": "RandomNoise", "inputs": {"noise_seed": 4}},
        "32": {"class_type": "BasicGuider", "inputs": {"model": ["1", 1], "conditioning": ["2", 0]}},
        "33": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "34": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["31", 0], "guider": ["32", 0], "sampler": ["33", 0],
                                                                 "sigmas": ["35", 0], "latent_image": ["4", 0]}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["34", 0], "filename_prefix": "sgld/custom"}},
    })
    theirs = cs.saved_latent(comfy, run_ok(comfy, g), "8")
    sigmas = sigma_schedule(3, "simple", 1.0, DEFAULT_SHIFT)
    sigmas[0] = 0.93
    engine = open_engine(os.path.join(comfy.base, "models", "diffusion_models", MODEL), EngineConfig(dtype="fp32"))
    with torch.inference_mode():
        ours = engine.sample(torch.zeros(1, 128, 8, 8), [cs.load_test_pack().text_features(1, 7, cs.text_dim())[0]], None, seed=4, steps=3,
                             cfg=1.0, sigmas=sigmas)
    assert close(theirs, ours), float((theirs - ours).abs().max())


def test_lora_loader_model_only_equals_the_engines_lora(comfy):
    ours, theirs, _ = both(comfy, ours_and_comfys(comfy_lora=LORA, seed=6))
    assert close(theirs, ours), float((theirs - ours).abs().max())
    plain, _, _ = both(comfy, ours_and_comfys(seed=6))
    assert not close(ours, plain, 1e-3)  # the LoRA changed the picture
    ours2, theirs2, _ = both(comfy, ours_and_comfys(lora=LORA, seed=6))  # SGLDiffusion LoRA Loader on MODEL
    assert close(theirs2, ours2) and close(ours2, ours)


@pytest.mark.parametrize("kind", list(LYCORIS))
def test_lora_loader_model_only_with_lokr_and_loha_equals_the_engines(comfy, kind):
    """ComfyUI reads the LyCORIS file into its LoKr / LoHa adapters; the engine takes them in memory and applies
    them its own way: the same as SGLDiffusion LoRA Loader reading the file (tests/lora/test_lycoris.py checks
    that against a hand merge)."""
    ours, theirs, _ = both(comfy, ours_and_comfys(comfy_lora=LYCORIS[kind], seed=6))
    assert close(theirs, ours), float((theirs - ours).abs().max())
    plain, _, _ = both(comfy, ours_and_comfys(seed=6))
    assert not close(ours, plain, 1e-3)  # the adapter changed the picture


def test_free_unloads_our_model_and_the_next_run_reloads_it(comfy):
    both(comfy, ours_and_comfys(seed=8))
    assert comfy.get("/sgldiffusion/models").json()["loaded"]
    assert comfy.post("/free", {"unload_models": True, "free_memory": True}).status_code == 200
    deadline = time.monotonic() + 30
    while comfy.get("/sgldiffusion/models").json()["loaded"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert comfy.get("/sgldiffusion/models").json()["loaded"] == []
    ours, theirs, _ = both(comfy, ours_and_comfys(seed=8))
    assert close(theirs, ours)


def test_demo_with_comfyuis_ksampler_makes_a_picture_the_judge_passes(comfy):
    from engine.models.demo import codec
    from tools.demo import judge

    prompt = "a large red circle on the left, on a blue background"
    g = {
        "1": {"class_type": "SGLDiffusionModelLoader", "inputs": {"unet_name": DEMO, "weight_dtype": "default"}},
        "2": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": prompt}},
        "3": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": ""}},
        "4": {"class_type": "SGLDiffusionDemoEmptyLatent", "inputs": {"batch_size": 1}},
        "7": {"class_type": "KSampler", "inputs": {"model": ["1", 1], "seed": 0, "steps": 8, "cfg": 3.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "positive": ["2", 0],
                                                   "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "sgld/demo"}},
    }
    image = codec.decode(cs.saved_latent(comfy, run_ok(comfy, g), "8"))[0]
    assert judge.passes(image, prompt), judge.judge(image, prompt)
    last = comfy.get("/sgldiffusion/last_runs", params={"workflow": ""}).json()["runs"]["7"]
    assert last["threads"] == 1  # the demo's CPU thread count (engine/threads.py) under ComfyUI's own sampler too


@pytest.mark.server
def test_the_sglang_cache_dit_environment_applies_to_comfyuis_ksampler(tmp_path, monkeypatch):
    """SGLANG_CACHE_DIT_ENABLED + SCM preset in ComfyUI's environment: ComfyUI's KSampler on our MODEL caches
    without any Apply Cache-DiT node (its own server: the environment is read in the server process)."""
    base = str(tmp_path / "comfy-env")
    cs.make_base_dir(base)
    cs.write_tiny_checkpoint(os.path.join(base, "models", "diffusion_models", MODEL))
    monkeypatch.setenv("SGLANG_CACHE_DIT_ENABLED", "true")
    monkeypatch.setenv("SGLANG_CACHE_DIT_SCM_PRESET", "fast")
    server = cs.start_server(base)
    try:
        g = ours_and_comfys(steps=12, seed=5)
        del g["5"], g["6"]
        run_ok(server, g)
        logged = [m for m in server.log().splitlines() if "model calls computed, Cache-DiT" in m]
        assert logged and "." in logged[-1].rsplit("Cache-DiT ", 1)[1], server.log()[-3000:]
    finally:
        server.stop()
