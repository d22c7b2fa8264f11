"""Per-request LoRAs through a real `sgld serve` process (issue 37 item 2; the demo model, fp32 on this CPU):
requests with different ``loras`` sent together share forwards (their ``samples_per_forward``) and each answer
equals the same request alone; a picture served with a LoRA is `sgld generate --lora FILE:STRENGTH`'s (side path
against merge: a few 1/255 in the PNG), the /v1/sample latent the merged engine's within 1e-5 relative; every bad
name, shape, strength or count is a 400 naming the field before any work; the per-LoRA metrics count."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch
from lora_files import write_comfy_lora_shapes
from PIL import Image
from safetensors.torch import load, save
from test_serve import PROMPTS, ROOT, Server, client, pixels

pytestmark = [pytest.mark.server]

MAX_PER_FORWARD = 3
STEPS = 6
LAYERS = {"layers.0.self_attention.to_q": (384, 384), "layers.1.self_attention.to_out.0": (384, 384),
          "layers.0.mlp.gate_proj": (768, 384), "text_proj": (384, 128)}


def write_lora(path, seed: int, layers=LAYERS, scale: float = 0.4) -> str:
    """A LoRA in ComfyUI's key format on some of the demo DiT's linears."""
    return write_comfy_lora_shapes(path, layers, seed=seed, scale=scale)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve_loras")
    folder = base / "loras"
    folder.mkdir()
    for i, name in enumerate("abcd"):
        write_lora(folder / f"{name}.safetensors", seed=i)
    write_lora(folder / "wrong.safetensors", seed=9, layers={"layers.0.self_attention.to_q": (384, 100)})
    s = Server(base / "serve.log", "--lora-dir", str(folder), "--max-loras-per-forward", str(MAX_PER_FORWARD),
               "--dtype", "fp32")
    s.folder = folder
    # `sgld generate --lora` of the picture test_a_served_picture_with_a_lora_is_sgld_generates serves, made while
    # the server starts
    s.reference = base / "reference.png"
    generate_cli = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "generate", "--prompt", PROMPTS[1], "--seed", "5", "--steps", str(STEPS),
         "--cfg", "1", "--dtype", "fp32", "--lora", f"{folder / 'b.safetensors'}:0.8", "--out", str(s.reference)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    s.generate_cli = generate_cli
    try:
        yield s.wait_ready()
    finally:
        generate_cli.wait(120)
        assert s.stop() == 0, s.log()


def generate(server, seed: int, loras=None, prompt=PROMPTS[0], steps: int = STEPS):
    extra = {"seed": seed, "num_inference_steps": steps, "guidance_scale": 1.0}
    if loras is not None:
        extra["loras"] = loras
    r = client(server).images.generate(model="sgld-demo", prompt=prompt, size="64x64", response_format="b64_json",
                                       extra_body=extra)
    return r, pixels(r.data[0].b64_json)


def test_different_loras_share_forwards_and_each_equals_its_request_alone(server):
    cases = [(1, [{"name": "a.safetensors"}]), (2, [{"name": "b.safetensors", "strength": 0.7}]),
             (3, [{"name": "c.safetensors", "strength": 1.5}, {"name": "a.safetensors", "strength": -0.5}]), (1, None)]
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda c: generate(server, *c), cases))
    for (seed, loras), (r, image) in zip(cases, together):
        assert r.model_extra["samples_per_forward"] > 1, (loras, r.model_extra)  # it shared its forwards
        alone, image_alone = generate(server, seed, loras)
        assert alone.model_extra["samples_per_forward"] == 1
        assert np.array_equal(image, image_alone), (loras, np.abs(image.astype(int) - image_alone).max())
    assert not np.array_equal(together[0][1], together[3][1])  # the LoRA changed the picture (same seed, no loras)
    assert server.metric("sgld_lora_forwards_total", lora="a.safetensors") >= 3 * STEPS
    assert server.metric("sgld_lora_samples_total", lora="b.safetensors") >= 2 * STEPS
    assert server.metric("sgld_lora_resident", lora="a.safetensors") == 1
    assert server.metric("sgld_lora_cache_bytes") > 0


def test_a_served_picture_with_a_lora_is_sgld_generates(server):
    _, image = generate(server, 5, [{"name": "b.safetensors", "strength": 0.8}], prompt=PROMPTS[1])
    server.generate_cli.wait(120)
    assert server.generate_cli.returncode == 0, server.generate_cli.stderr.read()[-2000:]
    ref = np.asarray(Image.open(server.reference).convert("RGB")).astype(int)
    assert np.abs(image.astype(int) - ref).max() <= 3  # side path against merge: a few 1/255
    assert not np.array_equal(image, generate(server, 5, prompt=PROMPTS[1])[1])


def sample_body(loras: str, cond: torch.Tensor) -> bytes:
    """A /v1/sample body whose settings hold ``loras`` (JSON text, as given)."""
    return save({"latent": torch.zeros(48, 16, 16), "cond": cond},
                metadata={"sgld": '{"seed": 3, "steps": 6, "cfg": 1.0, "loras": ' + loras + "}"})


def test_sample_latent_with_a_lora_equals_the_merged_engine(server, eng):
    cond = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    r = requests.post(server.base + "/sample", data=sample_body('[{"name": "d.safetensors", "strength": 0.9}]', cond),
                      timeout=60)
    last = json.loads([line for line in r.text.splitlines() if line.strip()][-1])
    got = load(base64.b64decode(last["latent"]))["latent"]
    with torch.inference_mode():
        eng.set_loras([(str(server.folder / "d.safetensors"), 0.9)])
        try:
            want = eng.sample(torch.zeros(1, 48, 16, 16), [cond], None, seed=3, steps=6, cfg=1.0)[0]
        finally:
            eng.set_loras([])
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


BAD = [('"a.safetensors"', "loras"), ('[{"strength": 1}]', "loras[0]"),
       ('[{"name": "a.safetensors", "weight": 1}]', "loras[0]"),
       ('[{"name": "a.safetensors", "strength": 1e999}]', "loras[0].strength"),
       ('[{"name": "a.safetensors", "strength": 101}]', "loras[0].strength"),
       ('[{"name": "a.safetensors", "strength": true}]', "loras[0].strength"),
       ('[{"name": ""}]', "loras[0].name"), ('[{"name": "a.safetensors"}, {"name": "nope.safetensors"}]', "loras[1].name"),
       ('[{"name": "../serve.log"}]', "loras[0].name"), ('[{"name": "a.safetensors"}, {"name": "a.safetensors"}]', "loras"),
       ('[{"name": "a.safetensors", "strength": 100}, {"name": "./a.safetensors", "strength": 100}]', "loras"),
       ('[{"name": "a.safetensors"}, {"name": ".//a.safetensors"}]', "loras"),
       (json.dumps([{"name": f"{i}.safetensors"} for i in range(9)]), "loras"),
       ('[{"name": "wrong.safetensors"}]', "loras"),
       (json.dumps([{"name": f"{n}.safetensors"} for n in "abcd"]), "loras")]


@pytest.mark.parametrize("loras,param", BAD, ids=[b[:40] for b, _ in BAD])
def test_bad_loras_are_400_naming_the_field(server, loras, param):
    forwards = server.metric("sgld_forwards_total")
    r = requests.post(server.base + "/images/generations", data=f'{{"prompt": "x", "loras": {loras}}}',
                      headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
    if param == "loras" and "abcd" in loras:
        assert f"more than the {MAX_PER_FORWARD}" in error["message"]  # --max-loras-per-forward, named
    assert server.metric("sgld_forwards_total") == forwards  # refused before any forward
    r = requests.post(server.base + "/sample", data=sample_body(loras, torch.zeros(4, 128)),
                      timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert server.healthy()


def test_a_nickname_is_never_the_name_of_a_file_in_the_lora_dir(server):
    """Issue 44 item 10: a nickname ``b.safetensors`` for another file would shadow b.safetensors for every later
    request: refused, naming lora_nickname; the file's name keeps meaning the file."""
    r = server.post("/v1/set_lora", {"lora_nickname": "b.safetensors", "lora_path": "c.safetensors"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_nickname", r.text
    assert "b.safetensors" not in [a["nickname"] for a in requests.get(server.base + "/list_loras", timeout=10)
                                   .json()["loaded_adapters"]]
