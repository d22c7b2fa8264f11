"""The remote nodes against real servers: a real `sgld serve` process (the demo model, an API key) and a real
ComfyUI with this pack. SGLDiffusion Server -> SGLDiffusion KSampler gives the local Model Loader's latent
bit for bit (both run the same CPU arithmetic: the batcher's job is ``Engine.sample``, tests/test_batcher.py);
Server Generate makes a picture the demo judge passes; a wrong key / no server is a one-line node error;
ComfyUI's interrupt cancels the server's job; POST /v1/sample refuses anything but its safetensors body. Inpainting,
denoise < 1 on an input latent, LatentFromBatch batches, custom sigmas and shift give the local latents too (one
sampling driver, issue 26)."""
from __future__ import annotations

import base64
import json
import os
import pickle
import time

import numpy as np
import pytest
import requests
import torch
from comfy_server import error_message, free_port, saved_latent
from PIL import Image
from safetensors.torch import load, save
from test_serve import Server
from test_serve_loras import write_lora

from engine import EngineConfig, open_engine
from engine.models.demo import EXAMPLE_PROMPT, load_demo
from tools.demo import judge

KEY = "remote-key"
DEMO_CHOICE = "sgld-demo (embedded, 64x64)"
LONG = 10000  # steps: minutes of work, always interrupted


REMOTE_LORA = "sgld_remote_style.safetensors"  # in ComfyUI's models/loras and in the server's --lora-dir alike


def comfy_files(base):
    write_lora(os.path.join(base, "models", "loras", REMOTE_LORA), seed=5)


@pytest.fixture(scope="module")
def sgld(tmp_path_factory):
    """The demo's server: its runs take the demo's CPU thread count (engine/threads.py), as ComfyUI's local Model
    Loader's do, so a batch's larger GEMMs (which MKL splits by thread) round alike on both sides."""
    folder = tmp_path_factory.mktemp("sgld")
    os.mkdir(folder / "loras")
    write_lora(folder / "loras" / REMOTE_LORA, seed=5)
    server = Server(folder / "serve.log", "--api-key", KEY, "--lora-dir", str(folder / "loras")).wait_ready()
    yield server
    server.stop()


# The ComfyUI server is tests/conftest.py's `comfy` fixture (the folders alone: the models are on the sgld server).


def sample_graph(model_node: dict, *, seed: int = 7, steps: int = 6, cfg: float = 3.0, prefix: str = "remote") -> dict:
    return {
        "1": model_node,
        "2": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": EXAMPLE_PROMPT}},
        "3": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": ""}},
        "4": {"class_type": "SGLDiffusionDemoEmptyLatent", "inputs": {"batch_size": 1}},
        "5": {"class_type": "SGLDiffusionKSampler", "inputs": {
            "model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": prefix}},
    }


def remote(url: str, key: str = KEY) -> dict:
    return {"class_type": "SGLDiffusionServer", "inputs": {"base_url": url, "api_key": key}}


def succeeded(entry: dict) -> None:
    err = error_message(entry) or {}
    assert entry["status"]["status_str"] == "success", f"{err.get('node_type')}: {err.get('exception_message')}"


def failure(entry: dict) -> str:
    err = error_message(entry)
    assert err is not None and err["kind"] == "execution_error", entry["status"]
    message = err["exception_message"].strip()
    assert "\n" not in message and "Traceback" not in message, message
    return message


def test_remote_ksampler_equals_local(comfy, sgld):
    """The same graph with the server and with the local demo loader: equal latents (bit for bit, CPU)."""
    remote_entry = comfy.run(sample_graph(remote(sgld.url), prefix="remote"))
    succeeded(remote_entry)
    local = {"class_type": "SGLDiffusionModelLoader", "inputs": {"unet_name": DEMO_CHOICE, "weight_dtype": "default"}}
    local_entry = comfy.run(sample_graph(local, prefix="local"))
    succeeded(local_entry)
    got, want = saved_latent(comfy, remote_entry), saved_latent(comfy, local_entry)
    assert got.shape == want.shape == (1, 48, 16, 16)
    assert torch.equal(got, want), (got - want).abs().max()
    assert sgld.metric("sgld_requests_total", endpoint="/v1/sample", status="200") >= 1


def local() -> dict:
    return {"class_type": "SGLDiffusionModelLoader", "inputs": {"unet_name": DEMO_CHOICE, "weight_dtype": "default"}}


def with_lora_chain(graph: dict) -> dict:
    """The graph's model through two SGLDiffusion LoRA Loaders (the same file twice: the strengths add)."""
    graph["20"] = {"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": ["1", 0], "lora_name": REMOTE_LORA,
                                                                       "strength": 0.5}}
    graph["21"] = {"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": ["20", 0], "lora_name": REMOTE_LORA,
                                                                       "strength": 0.3}}
    graph["5"]["inputs"]["model"] = ["21", 0]
    return graph


def test_the_remote_lora_chain_goes_with_each_run(comfy, sgld):
    """SGLDiffusion Server -> LoRA Loader x2 -> KSampler: the server applies the chain to that run only (its side
    path), giving the local Model Loader -> LoRA Loader x2 latent (merged) within 1e-5 relative; the server's own
    set stays the default (a run without the chain is unchanged)."""
    remote_entry = comfy.run(with_lora_chain(sample_graph(remote(sgld.url), prefix="remote_lora")))
    succeeded(remote_entry)
    local_entry = comfy.run(with_lora_chain(sample_graph(local(), prefix="local_lora")))
    succeeded(local_entry)
    plain_entry = comfy.run(sample_graph(remote(sgld.url), prefix="remote_plain"))
    succeeded(plain_entry)
    got, want, plain = (saved_latent(comfy, e) for e in (remote_entry, local_entry, plain_entry))
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    assert float((got - plain).abs().max() / plain.abs().max()) > 1e-3
    assert sgld.metric("sgld_lora_forwards_total", lora=REMOTE_LORA) >= 6


def second_pass_graph(model_node: dict, *, batch: int, cut=None, mask: bool, denoise: float, sampler: str = "euler",
                      prefix: str) -> dict:
    """sample_graph's text-to-image latent (batch ``batch``), then [LatentFromBatch ``cut`` = (index, length)] ->
    [SetLatentNoiseMask: repaint the right part, at 0.7] -> a second SGLDiffusion KSampler at ``denoise`` -> node 8."""
    g = sample_graph(model_node, seed=17, steps=3, prefix=prefix + "_first")
    g["4"]["inputs"]["batch_size"] = batch
    source = ["5", 0]
    if cut is not None:
        g["9"] = {"class_type": "LatentFromBatch", "inputs": {"samples": source, "batch_index": cut[0], "length": cut[1]}}
        source = ["9", 0]
    if mask:
        g.update({
            "10": {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": 64, "height": 64}},
            "11": {"class_type": "SolidMask", "inputs": {"value": 0.7, "width": 28, "height": 64}},
            "12": {"class_type": "MaskComposite", "inputs": {"destination": ["10", 0], "source": ["11", 0], "x": 36,
                                                             "y": 0, "operation": "add"}},
            "13": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": source, "mask": ["12", 0]}}})
        source = ["13", 0]
    g["7"] = {"class_type": "SGLDiffusionKSampler", "inputs": {
        "model": ["1", 0], "seed": 23, "steps": 4, "cfg": 2.5, "sampler_name": sampler, "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": source, "denoise": denoise}}
    g["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": prefix}}
    return g


@pytest.mark.parametrize("name, kw", [
    ("inpaint", dict(batch=1, mask=True, denoise=1.0)),
    ("img2img", dict(batch=1, mask=False, denoise=0.55, sampler="dpmpp_2m")),
    ("batch_cut_inpaint", dict(batch=3, cut=(1, 2), mask=True, denoise=0.8, sampler="heun")),
    ("denoise_0", dict(batch=2, mask=False, denoise=0.0)),
])
def test_remote_second_pass_equals_local(comfy, sgld, name, kw):
    """Inpainting (a latent noise mask), denoise < 1 on an input latent, a batch cut by LatentFromBatch (its
    batch_index) and denoise 0 through SGLDiffusion Server give the local Model Loader's latents bit for bit."""
    remote_entry = comfy.run(second_pass_graph(remote(sgld.url), prefix=f"r_{name}", **kw))
    succeeded(remote_entry)
    local_entry = comfy.run(second_pass_graph(local(), prefix=f"l_{name}", **kw))
    succeeded(local_entry)
    for node in ("6", "8"):
        got, want = saved_latent(comfy, remote_entry, node), saved_latent(comfy, local_entry, node)
        assert got.shape == want.shape and got.shape[1:] == (48, 16, 16), (node, got.shape)
        assert torch.equal(got, want), (node, (got - want).abs().max())
    first, second = saved_latent(comfy, remote_entry, "6"), saved_latent(comfy, remote_entry, "8")
    if kw.get("cut"):
        first = first[kw["cut"][0]:kw["cut"][0] + kw["cut"][1]]
    assert second.shape == first.shape
    if kw["mask"]:  # the kept region (mask 0, left of pixel 32) is the input's
        assert torch.allclose(second[..., :8], first[..., :8], atol=1e-5) and not torch.allclose(second, first, atol=1e-3)
    if kw["denoise"] == 0.0:
        assert torch.equal(second, first)


def test_server_generate_passes_the_judge(comfy, sgld, tmp_path):
    graph = {
        "1": {"class_type": "SGLDiffusionServerGenerate", "inputs": {
            "base_url": sgld.url, "api_key": KEY, "prompt": EXAMPLE_PROMPT, "width": 64, "height": 64, "seed": 3,
            "steps": 30, "cfg": 3.0}},  # seed 3: one the demo passes (tests/test_serve.py)
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "remote_gen"}},
    }
    entry = comfy.run(graph)
    succeeded(entry)
    image = np.asarray(Image.open(comfy.output_path(entry["outputs"]["2"]["images"][0])).convert("RGB"))
    assert image.shape == (64, 64, 3)
    assert judge.passes(image, EXAMPLE_PROMPT), judge.judge(image, EXAMPLE_PROMPT)


def generate_graph(url: str, prefix: str, **widgets) -> dict:
    inputs = {"base_url": url, "api_key": KEY, "prompt": EXAMPLE_PROMPT, "seed": 3, **widgets}
    return {"1": {"class_type": "SGLDiffusionServerGenerate", "inputs": inputs},
            "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}}}


def saved_image(comfy, entry) -> np.ndarray:
    return np.asarray(Image.open(comfy.output_path(entry["outputs"]["2"]["images"][0])).convert("RGB"))


def test_base_url_may_end_in_v1(comfy, sgld):
    """http://HOST:PORT/v1 (the openai SDK's base_url, as the README writes it) works as http://HOST:PORT."""
    assert sgld.base.endswith("/v1")
    succeeded(comfy.run(sample_graph(remote(sgld.base + "/"), seed=31, steps=2)))
    succeeded(comfy.run(generate_graph(sgld.base, "v1_gen", width=64, height=64, steps=2, cfg=3.0)))


def test_server_generate_defaults_are_the_servers(comfy, sgld):
    """Widgets left at 0 take the served model's defaults from GET /v1/models (the demo: 64x64, 30 steps, cfg 3):
    the picture equals the one asked for with those values; the node's defaults work against the default server."""
    defaults = {name: spec[1]["default"] for name, spec in
                comfy.get("/object_info/SGLDiffusionServerGenerate").json()["SGLDiffusionServerGenerate"]["input"]["required"].items()
                if name in ("width", "height", "steps", "cfg")}
    assert defaults == {"width": 0, "height": 0, "steps": 0, "cfg": 0}
    by_default = comfy.run(generate_graph(sgld.url, "default_gen", **defaults))
    succeeded(by_default)
    explicit = comfy.run(generate_graph(sgld.url, "explicit_gen", width=64, height=64, steps=30, cfg=3.0))
    succeeded(explicit)
    assert np.array_equal(saved_image(comfy, by_default), saved_image(comfy, explicit))


def test_wrong_key_or_no_server_is_a_one_line_node_error(comfy, sgld):
    message = failure(comfy.run(sample_graph(remote(sgld.url, key="wrong"), seed=11)))
    assert message.startswith("SGLDiffusion Server: the sgld server at") and "401" in message, message
    nowhere = f"http://127.0.0.1:{free_port()}"
    message = failure(comfy.run(sample_graph(remote(nowhere), seed=12)))
    assert message.startswith(f"SGLDiffusion Server: cannot reach the sgld server at {nowhere}"), message
    generate = {"1": {"class_type": "SGLDiffusionServerGenerate", "inputs": {
        "base_url": sgld.url, "api_key": KEY, "prompt": EXAMPLE_PROMPT, "width": 100, "height": 64, "seed": 1,
        "steps": 2, "cfg": 3.0}}, "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "bad"}}}
    message = failure(comfy.run(generate))
    assert message.startswith("SGLDiffusion Server Generate: the sgld server at") and "400" in message, message
    succeeded(comfy.run(sample_graph(remote(sgld.url), seed=13, steps=2)))  # ComfyUI keeps working


def test_a_sample_only_server_runs_the_graph_and_refuses_generate_in_one_line(comfy, tmp_path):
    """`sgld serve --sample-only` (the DiT alone, issue 48) behind the Server node: the graph's latent is the local
    loader's, bit for bit; Server Generate, which needs the server's text encoder and codec, is a one-line node error
    saying why, and ComfyUI keeps working."""
    server = Server(tmp_path / "serve.log", "--sample-only", "--api-key", KEY).wait_ready()
    try:
        remote_entry = comfy.run(sample_graph(remote(server.url), seed=21, steps=3, prefix="sample-only"))
        succeeded(remote_entry)
        local_entry = comfy.run(sample_graph(local(), seed=21, steps=3, prefix="sample-only-local"))
        succeeded(local_entry)
        assert torch.equal(saved_latent(comfy, remote_entry), saved_latent(comfy, local_entry))
        generate = {"1": {"class_type": "SGLDiffusionServerGenerate", "inputs": {
            "base_url": server.url, "api_key": KEY, "prompt": EXAMPLE_PROMPT, "width": 64, "height": 64, "seed": 1,
            "steps": 2, "cfg": 3.0}}, "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0],
                                                                             "filename_prefix": "sample-only"}}}
        message = failure(comfy.run(generate))
        assert "400" in message and "--sample-only" in message, message
        succeeded(comfy.run(sample_graph(remote(server.url), seed=22, steps=2, prefix="sample-only-after")))
    finally:
        assert server.stop() == 0, server.log()


def test_interrupt_cancels_the_remote_job(comfy, sgld):
    prompt_id = comfy.queue(sample_graph(remote(sgld.url), seed=21, steps=LONG))
    sgld.wait_metric("sgld_running_batch_size", 1)
    steps_before = sgld.metric("sgld_denoising_steps_total")
    assert comfy.post("/interrupt").status_code == 200
    entry = comfy.wait(prompt_id)
    assert error_message(entry)["kind"] == "execution_interrupted", entry["status"]
    sgld.wait_metric("sgld_running_batch_size", 0, timeout=30)
    sgld.wait_metric("sgld_images_in_flight", 0, timeout=30)
    done = sgld.metric("sgld_denoising_steps_total")
    assert steps_before < done < steps_before + LONG
    time.sleep(0.5)
    assert sgld.metric("sgld_denoising_steps_total") == done  # nothing runs on any more
    succeeded(comfy.run(sample_graph(remote(sgld.url), seed=22, steps=2)))


def body(metadata=None, **tensors) -> bytes:
    return save(tensors, metadata=metadata)


@pytest.mark.server
def test_sample_endpoint_refuses_bad_bodies(sgld):
    def post(data, key=KEY):
        return requests.post(sgld.base + "/sample", data=data, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    latent, cond = torch.zeros(48, 16, 16), torch.zeros(4, 128)
    settings = {"sgld": json.dumps({"seed": 0, "steps": 2, "cfg": 1.0})}
    cases = {
        "pickle": (pickle.dumps({"latent": latent}), "no safetensors header"),
        "empty": (b"", "too short"),
        "fp16": (body(settings, latent=latent.half(), cond=cond), "must be float32"),
        "no settings": (body(None, latent=latent, cond=cond), "metadata key 'sgld'"),
        "no cond": (body(settings, latent=latent), "'cond' is missing"),
        "bad field": (body({"sgld": json.dumps({"seed": 0, "steps": 2, "cfg": 1.0, "guidance": 2})}, latent=latent,
                           cond=cond), "'guidance' is not a field"),
        "bad shape": (body(settings, latent=torch.zeros(8, 16, 16), cond=cond), "latent"),
        "bad sampler": (body({"sgld": json.dumps({"seed": 0, "steps": 2, "cfg": 1.0, "sampler": "nope"})},
                             latent=latent, cond=cond), "nope"),
    }
    for name, (data, words) in cases.items():
        r = post(data)
        assert r.status_code == 400, (name, r.status_code, r.text)
        assert words in r.json()["error"]["message"], (name, r.json())
    assert post(body(settings, latent=latent, cond=cond), key="wrong").status_code == 401
    r = post(body(settings, latent=latent, cond=cond))
    assert r.status_code == 200 and json.loads(r.text.strip().splitlines()[-1])["latent"]
    assert sgld.healthy()


@pytest.mark.server
def test_sample_endpoint_denoise_equals_engine_sample(sgld):
    """img2img through /v1/sample (denoise 0.5 from a non-zero latent) is Engine.sample's run; denoise 0 answers the
    latent unchanged with Engine.sample's warning (it was refused before)."""
    demo = load_demo()
    latent, cond = torch.linspace(-1, 1, 48 * 16 * 16).reshape(48, 16, 16), demo.encode([EXAMPLE_PROMPT])[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    settings = {"seed": 5, "steps": 4, "cfg": 1.0, "denoise": 0.5}
    r = requests.post(sgld.base + "/sample", data=body({"sgld": json.dumps(settings)}, latent=latent, cond=cond),
                      headers=headers, timeout=60)
    events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert [e["step"] for e in events[:-1]] == [1, 2, 3, 4]
    got = load(base64.b64decode(events[-1]["latent"]))["latent"]
    want = open_engine("demo", EngineConfig(dtype="fp32")).sample(latent[None], [cond], seed=5, steps=4, cfg=1.0,
                                                                  denoise=0.5)[0]
    assert torch.equal(got, want)
    r = requests.post(sgld.base + "/sample", data=body({"sgld": json.dumps({**settings, "denoise": 0.0})},
                                                       latent=latent, cond=cond), headers=headers, timeout=60)
    last = json.loads(r.text.strip().splitlines()[-1])
    assert r.status_code == 200 and torch.equal(load(base64.b64decode(last["latent"]))["latent"], latent)
    assert last["model_calls"] == 0 and "denoise is 0" in last["warnings"][0]


def sample_events(sgld, settings: dict, **tensors) -> list:
    r = requests.post(sgld.base + "/sample", data=body({"sgld": json.dumps(settings)}, **tensors),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


@pytest.mark.server
def test_sample_endpoint_takes_everything_engine_sample_takes(sgld):
    """Custom sigmas, shift, a batch latent [B, C, h, w] with per-sample batch_index and a noise mask, over the wire:
    Engine.sample's latent bit for bit (a batch answers [B, C, h, w])."""
    demo = load_demo()
    cond, uncond = demo.encode([EXAMPLE_PROMPT])[0], demo.encode([""])[0]
    eng = open_engine("demo", EngineConfig(dtype="fp32"))
    start = torch.linspace(-1, 1, 2 * 48 * 16 * 16).reshape(2, 48, 16, 16)
    mask = torch.zeros(1, 64, 64)
    mask[:, 10:40, 20:60] = 1.0
    sigmas = torch.tensor([0.9, 0.6, 0.35, 0.1, 0.0])
    runs = {
        "sigmas": ({"seed": 8, "steps": 4, "cfg": 3.0, "sampler": "euler_ancestral"},
                   dict(latent=torch.zeros(48, 16, 16), cond=cond, uncond=uncond, sigmas=sigmas),
                   dict(sigmas=sigmas, sampler="euler_ancestral")),
        "shift": ({"seed": 9, "steps": 5, "cfg": 1.0, "shift": 1.25, "scheduler": "normal"},
                  dict(latent=torch.zeros(48, 16, 16), cond=cond), dict(shift=1.25, scheduler="normal")),
        "batch_mask": ({"seed": 10, "steps": 4, "cfg": 2.0, "denoise": 0.7, "batch_index": [4, 2]},
                       dict(latent=start, cond=cond, uncond=uncond, noise_mask=mask),
                       dict(denoise=0.7, batch_index=[4, 2], noise_mask=mask)),
    }
    for name, (settings, tensors, kw) in runs.items():  # both sides on the demo's thread count (engine/threads.py)
        events = sample_events(sgld, settings, **tensors)
        assert [e["step"] for e in events[:-1]] == list(range(1, settings["steps"] + 1)), name
        got = load(base64.b64decode(events[-1]["latent"]))["latent"]
        latent = tensors["latent"]
        batched = latent.dim() == 4
        want = eng.sample(latent if batched else latent[None], [cond], [uncond] if "uncond" in tensors else None,
                          seed=settings["seed"], steps=settings["steps"], cfg=settings["cfg"], **kw)
        assert torch.equal(got, want if batched else want[0]), name
    bad = {"seed": 1, "steps": 3, "cfg": 1.0, "batch_index": [0]}
    r = requests.post(sgld.base + "/sample", data=body({"sgld": json.dumps(bad)}, latent=start, cond=cond),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and "batch_index must be a list of 2 integers" in r.json()["error"]["message"]
    r = requests.post(sgld.base + "/sample", data=body({"sgld": json.dumps({"seed": 1, "steps": 3, "cfg": 1.0})},
                                                       latent=start[0], cond=cond, sigmas=sigmas),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and "steps is 3 but the sigmas make 4 steps" in r.json()["error"]["message"]
