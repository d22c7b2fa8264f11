"""The pack in a real ComfyUI (0.3.75, from scripts/comfyui.sh): nodes, workflows, runs, interrupt,
errors, model cache. One server for the whole module (see tests/comfy_server.py)."""
from __future__ import annotations

import glob
import json
import os
import time
import urllib.parse

import pytest
import torch

from engine import open_engine
from engine.features.quant import choices as quant_choices  # the format table's names (GGUF types too)

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
except ImportError:
    import comfy_server as cs

ROOT = cs.ROOT
WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json")))
MODEL_WORKFLOWS = [p for p in WORKFLOWS if "demo" not in os.path.basename(p)]  # a real model's files
# each family's ComfyUI graph: its text encoder's CLIPLoader type, its empty-latent nodes, (steps, cfg) by variant
GRAPHS = {"ERNIE-Image": {"clip_type": "flux2", "latents": ("EmptyFlux2LatentImage", "SGLDiffusionEmptyLatentERNIE"),
                          "turbo": (8, 1.0), "base": (50, 4.0)},
          "Z-Image": {"clip_type": "lumina2", "latents": ("EmptySD3LatentImage",), "turbo": (9, 1.0)}}
DEMO_WORKFLOW = os.path.join(ROOT, "workflows", "SGLDiffusion CPU demo.json")
ANY_SAMPLER_WORKFLOW = os.path.join(ROOT, "workflows", "ERNIE-Image any sampler.json")
TEMPLATE_NAMES = ["ERNIE-Image Base", "ERNIE-Image Turbo",
                  "ERNIE-Image any sampler", "SGLDiffusion CPU demo", "Z-Image Turbo"]
OUR_NODES = {"SGLDiffusionModelLoader": "SGLDiffusion Model Loader", "SGLDiffusionKSampler": "SGLDiffusion KSampler",
             "SGLDiffusionCacheDiT": "SGLDiffusion Cache-DiT", "SGLDiffusionEmptyLatentERNIE": "SGLDiffusion Empty Latent (ERNIE)"}
APPLY_CACHE = "SGLDiffusionApplyCacheDiT"  # the any-sampler workflow: ComfyUI's KSampler on the loader's MODEL
DEMO_NODES = {"SGLDiffusionDemoTextEncode": "SGLDiffusion Demo Text Encode",
              "SGLDiffusionDemoEmptyLatent": "SGLDiffusion Demo Empty Latent",
              "SGLDiffusionDemoDecode": "SGLDiffusion Demo Decode"}
# Core node types our workflows may use: present in ComfyUI >= 0.19 (and, checked below, in 0.3.75).
CORE_NODES = {"CLIPLoader", "CLIPTextEncode", "EmptyFlux2LatentImage", "EmptySD3LatentImage", "VAELoader", "VAEDecode", "SaveImage",
              "ConditioningZeroOut", "SaveLatent", "PreviewImage", "KSampler"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
TINY = "tiny-ernie.safetensors"
DIM = cs.text_dim()  # text features per token of the tiny model
Z_IMAGE = "z-image-small.safetensors"  # a small Z-Image (16 text features per token, 16 latent channels)


test_pack = cs.load_test_pack()


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture; this fills its base folder.
COMFY_ARGS = ("--preview-method", "auto")


def comfy_base(base):
    cs.make_base_dir(base)
    models = os.path.join(base, "models")
    cs.write_tiny_checkpoint(os.path.join(models, "diffusion_models", TINY))
    cs.write_tiny_checkpoint(os.path.join(models, "unet", "tiny-ernie-in-unet.safetensors"), seed=1)
    from safetensors.torch import save_file

    # another architecture's diffusion model (SD-style keys)
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(8, 4, 3, 3),
               "model.diffusion_model.out.2.weight": torch.zeros(4, 8, 3, 3)},
              os.path.join(models, "diffusion_models", "not-ernie.safetensors"))
    from engine.models.zimage import ZImageConfig, ZImageTransformer

    small = ZImageTransformer(ZImageConfig(hidden_size=32, num_layers=1, num_refiner_layers=1, num_attention_heads=2,
                                           ffn_hidden_size=64, text_in_dim=16, rope_axes_dim=(4, 6, 6)))
    save_file({k: v.contiguous() for k, v in small.state_dict().items()},
              os.path.join(models, "diffusion_models", Z_IMAGE))  # the second family
    for name in ("pickled.ckpt", "pickled.pt"):  # pickles must be refused without being unpickled
        torch.save({"x_embedder.proj.weight": torch.zeros(2)}, os.path.join(models, "diffusion_models", name))


@pytest.fixture(scope="module")
def object_info(comfy):
    r = comfy.get("/object_info", timeout=60)
    assert r.status_code == 200
    return r.json()


def graph(**kw):
    return cs.tiny_graph(TINY, **kw)


def direct_sample(ckpt: str, *, seed=0, steps=4, cfg=1.0, sampler="euler", scheduler="simple", denoise=1.0,
                  width=128, height=128, batch=1, pos=(1, 7, DIM), neg=(2, 5, DIM), dtype=None, cache=None, **options):
    from engine import EngineConfig

    engine = open_engine(ckpt, EngineConfig(dtype=dtype, **options))
    latent = torch.zeros(batch, 128, height // 16, width // 16)
    cond = [test_pack.text_features(*pos)[0]]
    uncond = [test_pack.text_features(*neg)[0]]
    kw = {"cache": cache} if cache is not None else {}
    out = engine.sample(latent, cond, uncond, seed=seed, steps=steps, cfg=cfg, sampler=sampler,
                        scheduler=scheduler, denoise=denoise, **kw)
    direct_sample.last_run = engine.last_run.to_dict()
    return out


def assert_error(entry: dict, node_type: str, *fragments: str) -> str:
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = cs.error_message(entry)
    assert err is not None and err["kind"] == "execution_error", entry["status"]
    assert err["node_type"] == node_type, err
    msg = err["exception_message"]
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    assert "Traceback" not in msg
    return msg


# -- registration --------------------------------------------------------------------------------

def test_pack_imported_without_errors(comfy):
    log = comfy.log()
    assert "IMPORT FAILED" not in log, log[-4000:]
    assert f"custom_nodes/{cs.PACK_NAME}" in log


def test_nodes_in_object_info(object_info):
    from engine.options import node_inputs
    from engine.sampling import SAMPLERS, SCHEDULERS
    from engine.sampling_options import SamplingOptions

    declared_widgets = node_inputs(SamplingOptions)["required"]

    for node_id, display in OUR_NODES.items():
        assert node_id in object_info, f"{node_id} missing from /object_info"
        assert object_info[node_id]["display_name"] == display
        assert object_info[node_id]["category"] == "SGLDiffusion"
    for node_id, display in DEMO_NODES.items():
        assert object_info[node_id]["display_name"] == display
        assert object_info[node_id]["category"] == "SGLDiffusion/demo"

    loader = object_info["SGLDiffusionModelLoader"]
    req = loader["input"]["required"]
    assert loader["input_order"]["required"] == ["unet_name", "weight_dtype"]
    assert TINY in req["unet_name"][0] and "tiny-ernie-in-unet.safetensors" in req["unet_name"][0]
    assert req["weight_dtype"][0] == ["default", "bf16", "fp16", "fp32"]
    opt = loader["input"]["optional"]
    assert loader["input_order"]["optional"] == ["attention", "compile", "quant", "offload", "resident_layers", "num_gpus",
                                                 "ulysses_degree", "ring_degree", "tp", "cfg_parallel"]
    assert opt["attention"][0][:2] == ["auto", "sdpa"] and "math" in opt["attention"][0]
    assert "sage" not in opt["attention"][0] and "flash" not in opt["attention"][0]  # CPU: only what runs here
    assert opt["compile"][0] == ["off", "static", "dynamic"]
    assert opt["quant"][0] == ["none", *quant_choices()] and opt["quant"][0][:4] == ["none", "fp8", "int4", "int4-g64"]
    assert opt["offload"][0] == ["auto", "none", "layerwise"] and opt["offload"][1]["default"] == "auto"
    assert opt["resident_layers"][0] == "INT" and opt["resident_layers"][1]["default"] == 2
    assert [opt[k][1]["default"] for k in ("num_gpus", "ulysses_degree", "ring_degree", "tp", "cfg_parallel")] == [1, 1, 1, 1, False]
    assert loader["output"] == ["SGLD_MODEL", "MODEL"]  # SGLD_MODEL first: saved graphs keep their links
    assert loader["output_name"] == ["model", "comfy_model"]
    apply = object_info["SGLDiffusionApplyCacheDiT"]
    assert apply["input"]["required"]["model"][0] == "MODEL" and apply["output"] == ["MODEL"]
    assert object_info["SGLDiffusionLoraLoader"]["input"]["required"]["model"][0] == "SGLD_MODEL,MODEL"

    ks = object_info["SGLDiffusionKSampler"]
    core = object_info["KSampler"]
    assert ks["input_order"]["required"] == core["input_order"]["required"]  # same widgets as KSampler
    req = ks["input"]["required"]
    assert req["model"][0] == "SGLD_MODEL"
    assert req["seed"][1]["control_after_generate"] is True
    for name in ("seed", "steps", "cfg", "denoise"):
        assert req[name][0] == core["input"]["required"][name][0]
        for k in ("min", "max"):
            assert req[name][1][k] == core["input"]["required"][name][1][k], (name, k)
        # ComfyUI's own definition (step, round, ...), with the declaration's default (engine/sampling_options.py)
        assert set(core["input"]["required"][name][1]) <= set(req[name][1]), name
        assert req[name][1]["default"] == declared_widgets[name][1]["default"], name
    assert req["sampler_name"][0] == list(SAMPLERS)
    assert req["scheduler"][0] == list(SCHEDULERS)
    assert set(req["sampler_name"][0]) <= set(core["input"]["required"]["sampler_name"][0])
    assert set(req["scheduler"][0]) <= set(core["input"]["required"]["scheduler"][0])
    for name in ("positive", "negative", "latent_image"):
        assert req[name][0] == core["input"]["required"][name][0]
    assert ks["input"]["optional"]["cache"][0] == "SGLD_CACHE"
    assert ks["output"] == ["LATENT"]

    cache = object_info["SGLDiffusionCacheDiT"]
    assert cache["output"] == ["SGLD_CACHE"]
    assert {"enabled", "preset", "advanced"} <= set(cache["input"]["required"])


# -- workflows -----------------------------------------------------------------------------------

def ui_to_api(wf: dict, object_info: dict) -> dict:
    """A UI-format workflow -> an API prompt (as the frontend's graphToPrompt does for simple graphs)."""
    links = {lk[0]: lk for lk in wf["links"]}
    api = {}
    for n in wf["nodes"]:
        info = object_info[n["type"]]
        spec = {**info["input"]["required"], **info["input"].get("optional", {})}
        order = info["input_order"]["required"] + info["input_order"].get("optional", [])
        linked = {i["name"]: links[i["link"]] for i in n.get("inputs", []) if i.get("link") is not None}
        inputs = {name: [str(lk[1]), lk[2]] for name, lk in linked.items()}
        values = list(n.get("widgets_values", []))
        for name in order:
            t = spec[name][0]
            if not (isinstance(t, list) or t in WIDGET_TYPES):
                continue
            assert values, f"{n['type']} #{n['id']}: no widget value for '{name}'"
            v = values.pop(0)
            if name not in linked:
                inputs[name] = v
            if len(spec[name]) > 1 and spec[name][1].get("control_after_generate"):
                assert values.pop(0) in ("fixed", "increment", "decrement", "randomize")
        assert not values, f"{n['type']} #{n['id']}: extra widget values {values}"
        api[str(n["id"])] = {"class_type": n["type"], "inputs": inputs}
    return api


def skip_without_apply_cache(wf: dict, object_info: dict) -> None:
    """The any-sampler workflow needs SGLDiffusion Apply Cache-DiT and the loader's MODEL output: skipped, saying
    so, on a pack that has not got them."""
    if any(n["type"] == APPLY_CACHE for n in wf["nodes"]) and APPLY_CACHE not in object_info:
        pytest.skip(f"{APPLY_CACHE} is not in /object_info: this workflow needs it and the loader's MODEL output")


def test_workflow_files_present():
    names = sorted(os.path.basename(p) for p in WORKFLOWS)
    assert names == [n + ".json" for n in TEMPLATE_NAMES]


@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_workflow_nodes_and_links(path, object_info):
    with open(path) as f:
        wf = json.load(f)
    skip_without_apply_cache(wf, object_info)
    types = {n["type"] for n in wf["nodes"]}
    unknown = types - CORE_NODES - set(OUR_NODES) - set(DEMO_NODES) - {APPLY_CACHE}
    assert not unknown, f"{os.path.basename(path)} uses node types outside ComfyUI core and this pack: {unknown}"
    missing = {t for t in types if t not in object_info}
    assert not missing, f"not in this ComfyUI's /object_info: {missing}"
    nodes = {n["id"]: n for n in wf["nodes"]}
    for lid, src, sslot, dst, dslot, typ in wf["links"]:
        out_type = object_info[nodes[src]["type"]]["output"][sslot]
        dst_input = nodes[dst]["inputs"][dslot]
        assert dst_input["link"] == lid
        spec = {**object_info[nodes[dst]["type"]]["input"]["required"], **object_info[nodes[dst]["type"]]["input"].get("optional", {})}
        assert out_type == typ == spec[dst_input["name"]][0], (lid, out_type, typ, dst_input)
    api = ui_to_api(wf, object_info)
    by_type = {v["class_type"]: v["inputs"] for v in api.values()}
    if path == DEMO_WORKFLOW:
        assert by_type["SGLDiffusionModelLoader"]["unet_name"] == object_info["SGLDiffusionModelLoader"]["input"]["required"]["unet_name"][0][0]
        assert by_type["SGLDiffusionCacheDiT"]["enabled"] is True
        return
    model = wf["extra"]["sgldiffusion"]
    turbo = "turbo" in model["model"].lower()  # the any-sampler workflow's name does not say
    graph = GRAPHS[model["model"].split()[0]]  # ComfyUI's own graph of the family: text encoder type, latent node
    ks = by_type.get("SGLDiffusionKSampler") or by_type["KSampler"]
    if "KSampler" in by_type:  # ComfyUI's KSampler <- Apply Cache-DiT <- the loader's MODEL (slot 1) and a Cache-DiT node
        apply = api[ks["model"][0]]
        assert apply["class_type"] == APPLY_CACHE and api[apply["inputs"]["model"][0]]["class_type"] == "SGLDiffusionModelLoader"
        assert apply["inputs"]["model"][1] == 1 and api[apply["inputs"]["cache"][0]]["class_type"] == "SGLDiffusionCacheDiT"
    assert (ks["steps"], ks["cfg"]) == (graph["turbo" if turbo else "base"]) == (model["steps"], model["cfg"])
    assert (ks["sampler_name"], ks["scheduler"], ks["denoise"]) == ("euler", "simple", 1.0)
    assert by_type["SGLDiffusionModelLoader"]["unet_name"] == model["files"]["diffusion_models"]
    assert by_type["CLIPLoader"]["clip_name"] == model["files"]["text_encoders"]
    assert by_type["CLIPLoader"]["type"] == graph["clip_type"]
    assert by_type["VAELoader"]["vae_name"] == model["files"]["vae"]
    latent = next(by_type[t] for t in graph["latents"] if t in by_type)
    assert (latent["width"], latent["height"]) == (1024, 1024)
    assert sum(v["class_type"] == "CLIPTextEncode" for v in api.values()) == 2
    assert "SaveImage" in by_type and "VAEDecode" in by_type


@pytest.mark.parametrize("path", MODEL_WORKFLOWS, ids=os.path.basename)
def test_workflow_validates_in_comfyui(path, comfy, object_info):
    """Queued as a prompt, the only complaints are the absent text-encoder and VAE files."""
    with open(path) as f:
        wf = json.load(f)
    skip_without_apply_cache(wf, object_info)
    api = ui_to_api(wf, object_info)
    r = comfy.post("/prompt", {"prompt": api, "client_id": comfy.client_id})
    assert r.status_code == 400, r.text[:2000]
    errors = r.json()["node_errors"]
    flagged = {api[k]["class_type"] for k in errors}
    assert flagged <= {"CLIPLoader", "VAELoader"}, errors
    for node_err in errors.values():
        for e in node_err["errors"]:
            assert e["type"] == "value_not_in_list", e


def test_workflow_templates_listed(comfy):
    r = comfy.get("/workflow_templates")
    assert r.status_code == 200
    assert sorted(r.json().get(cs.PACK_NAME, [])) == TEMPLATE_NAMES, r.json()


def template_url(name: str, ext: str) -> str:
    """Where the frontend (1.32.9, as 1.58) fetches a custom-node template's file: the workflow JSON, and
    the card's picture, always <name>.jpg (getTemplateThumbnailUrl with mediaSubtype "jpg")."""
    return f"/api/workflow_templates/{urllib.parse.quote(cs.PACK_NAME)}/{urllib.parse.quote(name)}.{ext}"


def card_description(name: str) -> str:
    """The card's description as the frontend makes it for a custom-node template (getTemplateDescription:
    the template's name, the only text /workflow_templates gives, with - and _ as spaces); the pack's web
    extension (web/sgldiffusion_templates.js) replaces it with the workflow's own (GET /sgldiffusion/templates)."""
    return name.replace("-", " ").replace("_", " ").strip()


def test_any_sampler_workflow_runs_and_equals_sgldiffusion_ksampler(comfy, object_info):
    """The any-sampler workflow as shipped, on the tiny model at 128x128 with the test pack's text features for its
    text encoder and a SaveLatent for its VAE (neither file is here): ComfyUI's KSampler on the loader's MODEL
    through Apply Cache-DiT gives SGLDiffusion KSampler's latent with the same Cache-DiT node and settings."""
    with open(ANY_SAMPLER_WORKFLOW) as f:
        wf = json.load(f)
    skip_without_apply_cache(wf, object_info)
    api = ui_to_api(wf, object_info)
    ids = {v["class_type"]: k for k, v in api.items()}
    for k in [k for k, v in api.items() if v["class_type"] in ("CLIPLoader", "VAELoader", "VAEDecode", "SaveImage")]:
        del api[k]
    for seed, k in enumerate(k for k, v in list(api.items()) if v["class_type"] == "CLIPTextEncode"):
        api[k] = {"class_type": "SGLDTestTextFeatures", "inputs": {"seed": seed + 1, "tokens": 7 - 2 * seed, "dim": DIM}}
    api[ids["SGLDiffusionModelLoader"]]["inputs"]["unet_name"] = TINY
    api[ids["SGLDiffusionEmptyLatentERNIE"]]["inputs"].update(width=128, height=128)
    ks = api[ids["KSampler"]]["inputs"]
    ours = {k: ks[k] for k in ("seed", "steps", "cfg", "sampler_name", "scheduler", "positive", "negative", "latent_image", "denoise")}
    api["90"] = {"class_type": "SGLDiffusionKSampler", "inputs": {**ours, "model": [ids["SGLDiffusionModelLoader"], 0],
                                                                  "cache": [ids["SGLDiffusionCacheDiT"], 0]}}
    api["91"] = {"class_type": "SaveLatent", "inputs": {"samples": [ids["KSampler"], 0], "filename_prefix": "sgld/any"}}
    api["92"] = {"class_type": "SaveLatent", "inputs": {"samples": ["90", 0], "filename_prefix": "sgld/ours"}}
    entry = comfy.run(api, timeout=300)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    any_sampler, reference = cs.saved_latent(comfy, entry, "91"), cs.saved_latent(comfy, entry, "92")
    assert entry["outputs"]["90"]["sgld_stats"][0]["step_mask"] == "x..x.x.x"  # balanced at 8 steps: 4 of 8 computed
    assert any_sampler.shape == reference.shape == (1, 128, 8, 8) and torch.isfinite(any_sampler).all()
    assert (any_sampler - reference).abs().max() <= 1e-4 * reference.abs().max()


@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_template_card_has_a_thumbnail_and_a_description(path, comfy):
    """Each template card: a title that names the model (the file name), a description of its own (the workflow's
    extra.sgldiffusion.description, served for the web extension) that is not the title again, and a picture next
    to the JSON that decodes as an image, served where the frontend looks for it."""
    from PIL import Image

    name = os.path.splitext(os.path.basename(path))[0]
    assert name.split()[0] in GRAPHS or "demo" in name, name  # a family's name, or the demo's
    description = comfy.get("/sgldiffusion/templates").json()["templates"][name]
    with open(path) as f:
        assert description == json.load(f)["extra"]["sgldiffusion"]["description"]
    assert len(description.split()) >= 4 and description != card_description(name), description
    thumb = os.path.splitext(path)[0] + ".jpg"
    with Image.open(thumb) as im:
        im.load()
        assert im.format == "JPEG" and min(im.size) >= 256, (im.format, im.size)
    r = comfy.get(template_url(name, "jpg"))
    assert r.status_code == 200 and r.headers["Content-Type"] == "image/jpeg", (r.status_code, r.headers)
    with open(thumb, "rb") as f:
        assert r.content == f.read()


def test_demo_workflow_runs_on_cpu_and_the_judge_accepts_it(comfy, object_info):
    """the demo workflow (workflows/SGLDiffusion CPU demo.json) as shipped: the embedded demo model, Cache-DiT on, a 64x64 picture
    that the demo judge accepts for the workflow's own prompt."""
    import numpy as np
    from PIL import Image

    from tools.demo.judge import judge

    with open(DEMO_WORKFLOW) as f:
        api = ui_to_api(json.load(f), object_info)
    entry = comfy.run(api, timeout=300)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    by_type = {v["class_type"]: k for k, v in api.items()}
    prompt = api[str(api[by_type["SGLDiffusionKSampler"]]["inputs"]["positive"][0])]["inputs"]["text"]
    item = entry["outputs"][by_type["SaveImage"]]["images"][0]
    image = np.asarray(Image.open(comfy.output_path(item)).convert("RGB"))
    assert image.shape == (64, 64, 3)
    verdict = judge(image, prompt)
    assert verdict["pass"], verdict
    # the template card's picture is this very output (8x, nearest; JPEG): one pixel per 8x8 block
    thumb = np.asarray(Image.open(os.path.splitext(DEMO_WORKFLOW)[0] + ".jpg").convert("RGB"), dtype=np.float32)
    blocks = thumb.reshape(64, 8, 64, 8, 3).mean(axis=(1, 3))
    assert np.abs(blocks - image.astype(np.float32)).mean() < 3.0
    stats = entry["outputs"][by_type["SGLDiffusionKSampler"]]["sgld_stats"][0]
    steps = api[by_type["SGLDiffusionKSampler"]]["inputs"]["steps"]
    assert stats["model_calls"] == steps and 0 < stats["calls_computed"] < steps  # the quality preset caches some
    assert stats["threads"] == 1  # the demo's CPU thread count (engine/threads.py), inside ComfyUI too
    for path in WORKFLOWS:
        r = comfy.get(template_url(os.path.splitext(os.path.basename(path))[0], "json"))
        assert r.status_code == 200
        with open(path) as f:
            assert r.json() == json.load(f)


# -- runs ----------------------------------------------------------------------------------------

RUNS = [
    dict(seed=11, steps=4, cfg=1.0, sampler="euler", scheduler="simple"),
    dict(seed=12, steps=3, cfg=3.5, sampler="dpmpp_2m", scheduler="beta", width=96, height=160),
    dict(seed=13, steps=3, cfg=2.0, sampler="euler_ancestral", scheduler="normal", denoise=0.75),
    dict(seed=14, steps=2, cfg=2.5, sampler="heun", scheduler="simple", batch=2),
]


@pytest.mark.parametrize("kw", RUNS, ids=lambda kw: f"{kw['sampler']}-{kw['scheduler']}-cfg{kw['cfg']}")
def test_tiny_graph_bit_equal_to_engine(comfy, kw):
    entry = comfy.run(graph(**kw), timeout=120)
    assert entry["status"]["status_str"] == "success", entry["status"]
    got = cs.saved_latent(comfy, entry)
    want = direct_sample(os.path.join(comfy.base, "models", "diffusion_models", TINY), **kw)
    assert got.shape == want.shape == (kw.get("batch", 1), 128, kw.get("height", 128) // 16, kw.get("width", 128) // 16)
    assert got.dtype == torch.float32
    assert torch.equal(got, want), f"max abs diff {(got - want).abs().max().item()}"
    stats = entry["outputs"]["5"]["sgld_stats"][0]
    assert stats["model_calls"] >= 1
    assert stats["threads"] == cs.server_threads()  # an ERNIE-Image model keeps ComfyUI's (torch's) CPU thread count


@pytest.mark.parametrize("options", [dict(quant="fp8", attention="math"), dict(quant="int4")],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_loader_options_reach_the_engine(comfy, options):
    entry = comfy.run(graph(seed=16, cfg=2.0, loader_options=options), timeout=120)
    assert entry["status"]["status_str"] == "success", entry["status"]
    want = direct_sample(os.path.join(comfy.base, "models", "diffusion_models", TINY), seed=16, cfg=2.0, **options)
    assert torch.equal(cs.saved_latent(comfy, entry), want)
    stats = entry["outputs"]["5"]["sgld_stats"][0]
    assert stats["attention"] == options.get("attention", "sdpa") and stats["warnings"] == []


def test_attention_backend_missing_here_falls_back(comfy):
    """A workflow saved on a GPU machine (attention 'sage') still runs here, with sdpa and a warning."""
    entry = comfy.run(graph(seed=17, loader_options={"attention": "sage"}), timeout=120)
    assert entry["status"]["status_str"] == "success", entry["status"]
    stats = entry["outputs"]["5"]["sgld_stats"][0]
    assert stats["attention"] == "sdpa" and any("sage" in w for w in stats["warnings"]), stats


def test_model_from_unet_folder(comfy):
    entry = comfy.run(cs.tiny_graph("tiny-ernie-in-unet.safetensors", seed=15), timeout=120)
    assert entry["status"]["status_str"] == "success", entry["status"]
    want = direct_sample(os.path.join(comfy.base, "models", "unet", "tiny-ernie-in-unet.safetensors"), seed=15)
    assert torch.equal(cs.saved_latent(comfy, entry), want)


def _ws_events(ws, prompt_id, until_type, timeout, on_event=None):
    """Read websocket events for ``prompt_id`` until one of type ``until_type``; returns (events, previews)."""
    events, previews = [], 0
    deadline = time.monotonic() + timeout
    ws.settimeout(1.0)
    import websocket

    while time.monotonic() < deadline:
        try:
            msg = ws.recv()
        except websocket.WebSocketTimeoutException:
            continue
        if isinstance(msg, bytes):
            previews += 1
            continue
        ev = json.loads(msg)
        data = ev.get("data", {})
        if data.get("prompt_id") not in (None, prompt_id):
            continue
        events.append(ev)
        if on_event is not None:
            on_event(ev)
        if ev["type"] in until_type and data.get("prompt_id") == prompt_id:
            return events, previews
    raise AssertionError(f"no {until_type} event within {timeout} s; got {[e['type'] for e in events][-20:]}")


def test_progress_bar_and_previews(comfy):
    ws = comfy.websocket()
    try:
        pid = comfy.queue(graph(seed=21, steps=5))
        events, previews = _ws_events(ws, pid, ("execution_success", "execution_error"), 120)
    finally:
        ws.close()
    assert events[-1]["type"] == "execution_success"
    progress = [e["data"] for e in events if e["type"] == "progress" and e["data"].get("node") == "5"]
    assert [p["value"] for p in progress] == [1, 2, 3, 4, 5]
    assert all(p["max"] == 5 for p in progress)
    assert previews >= 1  # --preview-method auto: Latent2RGB previews of the Flux2 latent


def test_interrupt_stops_run_and_next_run_works(comfy):
    """The engine's step callback checks ComfyUI's interrupt flag, so a run stops at the step after
    POST /interrupt (the bound below allows for events still in flight), and the flag is consumed."""
    steps = 10000
    ws = comfy.websocket()
    seen = {"value": 0, "at_interrupt": None}

    def on_event(ev):
        if ev["type"] == "progress" and ev["data"].get("node") == "5":
            seen["value"] = ev["data"]["value"]
            if seen["at_interrupt"] is None and ev["data"]["value"] >= 3:
                seen["at_interrupt"] = ev["data"]["value"]
                assert comfy.post("/interrupt").status_code == 200

    try:
        t0 = time.monotonic()
        # 1024x1024 -> 4096 image tokens: each step takes long enough to count steps after the interrupt
        pid = comfy.queue(graph(seed=31, steps=steps, width=1024, height=1024))
        events, _ = _ws_events(ws, pid, ("execution_interrupted", "execution_success", "execution_error"), 120, on_event)
    finally:
        ws.close()
    assert events[-1]["type"] == "execution_interrupted", events[-1]
    assert events[-1]["data"]["node_type"] == "SGLDiffusionKSampler"
    assert seen["at_interrupt"] is not None
    print("interrupt:", seen)
    assert seen["value"] - seen["at_interrupt"] <= 5, seen  # stopped at once, not after 10000 steps
    entry = comfy.wait(pid, 30)
    assert entry["status"]["status_str"] == "error"
    assert cs.error_message(entry)["kind"] == "execution_interrupted"
    assert time.monotonic() - t0 < 100
    # the next prompt is unaffected
    entry = comfy.run(graph(seed=32), timeout=120)
    assert entry["status"]["status_str"] == "success", entry["status"]
    want = direct_sample(os.path.join(comfy.base, "models", "diffusion_models", TINY), seed=32)
    assert torch.equal(cs.saved_latent(comfy, entry), want)


CACHE_RUNS = {
    "cache-off": dict(enabled=False, preset="fast", advanced=False),
    "cache-fast": dict(enabled=True, preset="fast", advanced=False),
}


@pytest.mark.parametrize("case", list(CACHE_RUNS))
def test_cache_node_passes_through(comfy, case):
    """SGLDiffusion Cache-DiT -> KSampler's cache input: same latent as Engine.sample(cache=...) directly."""
    from engine.features.cache import CacheConfig

    node_inputs = CACHE_RUNS[case]
    g = graph(seed=71, steps=8)
    g["7"] = {"class_type": "SGLDiffusionCacheDiT", "inputs": dict(node_inputs)}
    g["5"]["inputs"]["cache"] = ["7", 0]
    entry = comfy.run(g, timeout=120)
    assert entry["status"]["status_str"] == "success", entry["status"]
    cfg = CacheConfig(enabled=node_inputs["enabled"], preset=node_inputs["preset"])
    want = direct_sample(os.path.join(comfy.base, "models", "diffusion_models", TINY), seed=71, steps=8, cache=cfg)
    assert torch.equal(cs.saved_latent(comfy, entry), want)
    stats = entry["outputs"]["5"]["sgld_stats"][0]
    assert stats["step_mask"] == direct_sample.last_run["step_mask"]
    if node_inputs["enabled"]:
        assert stats["calls_computed"] < stats["model_calls"], stats
    else:
        assert stats["calls_computed"] == stats["model_calls"] == 8, stats
        assert torch.equal(want, direct_sample(os.path.join(comfy.base, "models", "diffusion_models", TINY), seed=71, steps=8))


def test_z_image_in_both_samplers(comfy):
    """Issue 47: a Z-Image file picked in SGLDiffusion Model Loader. SGLDiffusion KSampler, and ComfyUI's own
    KSampler on comfy_model with ComfyUI's own Z-Image settings (timestep = sigma, shift 3, the Flux latent's scale
    and shift), each give the engine's own sampling of the file on the same inputs, bit-equal."""
    from engine.models import get

    latent = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48, "batch_size": 1}}
    g = cs.tiny_graph(Z_IMAGE, seed=81, steps=4, cfg=2.0, pos=(1, 7, 16), neg=(2, 5, 16), latent_node=latent)
    g["12"] = {"class_type": "KSampler", "inputs": {**g["5"]["inputs"], "model": ["1", 1]}}
    g["13"] = {"class_type": "SaveLatent", "inputs": {"samples": ["12", 0], "filename_prefix": "sgld/z-image-comfy"}}
    entry = comfy.run(g, timeout=180)
    assert entry["status"]["status_str"] == "success", f"{cs.error_message(entry)}\n{comfy.log()[-3000:]}"
    engine = open_engine(os.path.join(comfy.base, "models", "diffusion_models", Z_IMAGE))
    flux = get("z-image").latent
    out = engine.sample(flux.process_in(torch.zeros(1, 16, 6, 8)), [test_pack.text_features(1, 7, 16)[0]],
                        [test_pack.text_features(2, 5, 16)[0]], seed=81, steps=4, cfg=2.0, sampler="euler",
                        scheduler="simple")
    want = flux.process_out(out)
    assert torch.equal(cs.saved_latent(comfy, entry), want)
    assert torch.equal(cs.saved_latent(comfy, entry, "13"), want)


# -- bad inputs ------------------------------------------------------------------------------------

BAD = {
    "missing-file": (dict(model="no-such-model.safetensors"), "SGLDiffusionModelLoader",
                     ["no-such-model.safetensors", "was not found", "diffusion_models"]),
    "other-architecture": (dict(model="not-ernie.safetensors"), "SGLDiffusionModelLoader",
                           ["not-ernie.safetensors", "not an ERNIE-Image diffusion model"]),
    "pickle-ckpt": (dict(model="pickled.ckpt"), "SGLDiffusionModelLoader", ["pickled.ckpt", "pickle"]),
    "pickle-pt": (dict(model="pickled.pt"), "SGLDiffusionModelLoader", ["pickled.pt", "pickle"]),
    "latent-4-channels": (dict(latent_node={"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}}),
                          "SGLDiffusionKSampler", ["latent has 4 channels", "takes 128", "EmptyFlux2LatentImage"]),
    "empty-conditioning": (dict(pos=(1, 0, DIM)), "SGLDiffusionKSampler", ["positive conditioning"]),
    "wrong-text-dim": (dict(pos=(1, 7, DIM + 16), cfg=2.0), "SGLDiffusionKSampler",
                       [f"{DIM + 16} features per token", f"takes {DIM}"]),
    "cache-too-many-fixed-blocks": (dict(cache={"enabled": True, "preset": "fast", "advanced": True, "Fn": 2, "Bn": 0}),
                                    "SGLDiffusionKSampler", ["SGLDiffusion KSampler:", "leaves no middle blocks to cache"]),
    # NaN passes ComfyUI's own min/max check of a FLOAT widget (every comparison with NaN is false)
    "cfg-nan": (dict(cfg=float("nan")), "SGLDiffusionKSampler", ["SGLDiffusion KSampler:", "cfg must be a finite number"]),
    "denoise-nan": (dict(denoise=float("nan")), "SGLDiffusionKSampler", ["SGLDiffusion KSampler:", "denoise must be a finite"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gives_clear_error(comfy, case):
    kw, node_type, fragments = BAD[case]
    kw = dict(kw)
    model = kw.pop("model", TINY)
    cache = kw.pop("cache", None)
    g = cs.tiny_graph(model, seed=41, **kw)
    if cache is not None:
        g["7"] = {"class_type": "SGLDiffusionCacheDiT", "inputs": cache}
        g["5"]["inputs"]["cache"] = ["7", 0]
    entry = comfy.run(g, timeout=60)
    assert_error(entry, node_type, *fragments)
    assert comfy.alive()


def test_server_serves_after_errors(comfy):
    entry = comfy.run(graph(seed=51), timeout=120)
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert comfy.alive()


# -- model cache -----------------------------------------------------------------------------------

def _loaded(comfy):
    r = comfy.get("/sgldiffusion/models")
    assert r.status_code == 200
    return r.json()["loaded"]


def test_model_cache_replaced_and_freed(comfy):
    assert comfy.post("/free", {"unload_models": True}).status_code == 200  # engines earlier tests' loaders hold
    deadline = time.monotonic() + 15
    while _loaded(comfy) and time.monotonic() < deadline:
        time.sleep(0.1)
    entry = comfy.run(graph(seed=61), timeout=120)
    assert entry["status"]["status_str"] == "success"
    loaded = _loaded(comfy)
    assert [(m["name"], m["options"]["dtype"]) for m in loaded] == [(TINY, None)]

    # the same loader inputs: no reload (the loader's output is reused; the engine stays)
    loads = comfy.log().count("SGLDiffusion: loading")
    entry = comfy.run(graph(seed=62), timeout=120)
    assert entry["status"]["status_str"] == "success"
    assert comfy.log().count("SGLDiffusion: loading") == loads
    assert [(m["name"], m["options"]["dtype"]) for m in _loaded(comfy)] == [(TINY, None)]

    # new loader inputs replace the old engine
    entry = comfy.run(graph(seed=63, weight_dtype="fp32"), timeout=120)
    assert entry["status"]["status_str"] == "success"
    assert [(m["name"], m["options"]["dtype"]) for m in _loaded(comfy)] == [(TINY, "fp32")]

    # POST /free unloads it; the next run loads it again
    assert comfy.post("/free", {"unload_models": True}).status_code == 200
    deadline = time.monotonic() + 15
    while _loaded(comfy) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _loaded(comfy) == []
    entry = comfy.run(graph(seed=64, weight_dtype="fp32"), timeout=120)
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert len(_loaded(comfy)) == 1
    want = direct_sample(os.path.join(comfy.base, "models", "diffusion_models", TINY), seed=64, dtype="fp32")
    assert torch.equal(cs.saved_latent(comfy, entry), want)


# -- error texts and run warnings --------------------------------------------------------------------

def demo_graph(object_info, *, prompt="a large red circle on the left, on a blue background", negative="",
               latent_node=None, seed=0, steps=4, cfg=3.0) -> dict:
    """The demo model (first loader entry) with Demo Text Encode x2 -> KSampler -> SaveLatent."""
    demo = object_info["SGLDiffusionModelLoader"]["input"]["required"]["unet_name"][0][0]
    return {
        "1": {"class_type": "SGLDiffusionModelLoader", "inputs": {"unet_name": demo, "weight_dtype": "default"}},
        "2": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": prompt}},
        "3": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": negative}},
        "4": latent_node or {"class_type": "SGLDiffusionDemoEmptyLatent", "inputs": {"batch_size": 1}},
        "5": {"class_type": "SGLDiffusionKSampler", "inputs": {
            "model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "sgld/demo"}},
    }


def test_wrong_latent_hint_fits_the_model(comfy, object_info):
    """The demo model (48 channels) is told about its own latent node, an ERNIE-Image model about the Flux2 one."""
    flux2 = {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    entry = comfy.run(demo_graph(object_info, latent_node=flux2), timeout=120)
    msg = assert_error(entry, "SGLDiffusionKSampler", "latent has 128 channels", "takes 48", "SGLDiffusion Demo Empty Latent")
    assert "EmptyFlux2LatentImage" not in msg and "Flux2" not in msg, msg
    demo_latent = {"class_type": "SGLDiffusionDemoEmptyLatent", "inputs": {"batch_size": 1}}
    entry = comfy.run(graph(seed=42, latent_node=demo_latent), timeout=120)
    msg = assert_error(entry, "SGLDiffusionKSampler", "latent has 48 channels", "takes 128", "EmptyFlux2LatentImage")
    assert "Demo Empty Latent" not in msg, msg


def test_unknown_attention_is_named_as_attention(comfy):
    """attention=bogus: the error names the attention input, not unet_name. (ComfyUI 0.3.75 lists a
    message from VALIDATE_INPUTS under every input of its signature, so the loader refuses it when it runs.)"""
    r = comfy.post("/prompt", {"prompt": graph(seed=43, loader_options={"attention": "bogus"}), "client_id": comfy.client_id})
    assert r.status_code == 200, r.text[:2000]
    entry = comfy.wait(r.json()["prompt_id"], 60)
    msg = assert_error(entry, "SGLDiffusionModelLoader", "attention 'bogus' is not one of", "auto", "sdpa")
    assert "unet_name" not in msg, msg


def test_unknown_demo_words_are_run_warnings(comfy, object_info):
    prompt = "a purple elephant at the top right, on a blue background"  # "top right": two positions, never trained
    entry = comfy.run(demo_graph(object_info, prompt=prompt, negative="blurry"), timeout=120)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    warnings = entry["outputs"]["5"]["sgld_stats"][0]["warnings"]
    assert any(w.startswith("positive prompt: the demo model does not know 'purple', 'elephant', 'top right'")
               for w in warnings), warnings
    assert any(w.startswith("negative prompt: the demo model does not know 'blurry'") for w in warnings), warnings


@pytest.mark.parametrize("mask, fragment", [("1101", "has 4 entries for a run of 8 model calls: padded with 4 computed calls"),
                                            ("110110110111", "has 12 entries for a run of 8 model calls: the last 4 were cut")],
                         ids=["padded", "cut"])
def test_steps_mask_fitted_to_the_run_is_a_run_warning(comfy, mask, fragment):
    g = graph(seed=44, steps=8)
    g["7"] = {"class_type": "SGLDiffusionCacheDiT", "inputs": {"enabled": True, "preset": "none", "advanced": True,
                                                               "steps_mask": mask}}
    g["5"]["inputs"]["cache"] = ["7", 0]
    entry = comfy.run(g, timeout=120)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    stats = entry["outputs"]["5"]["sgld_stats"][0]
    assert len(stats["step_mask"]) == 8
    assert any(f"Cache-DiT steps_mask {fragment}" in w for w in stats["warnings"]), stats["warnings"]
    assert "warnings" not in stats["cache"]


def test_denoise_zero_reports_no_steps_and_a_warning(comfy):
    """denoise 0 (the latent comes back unchanged, as from ComfyUI's KSampler): 0 steps, not -1, and a warning."""
    entry = comfy.run(graph(seed=45, denoise=0.0), timeout=120)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    stats = entry["outputs"]["5"]["sgld_stats"][0]
    assert stats["model_calls"] == stats["calls_computed"] == stats["calls_cached"] == 0, stats
    assert stats["step_mask"] == "" and any("denoise is 0" in w for w in stats["warnings"]), stats
    assert torch.equal(cs.saved_latent(comfy, entry), torch.zeros(1, 128, 8, 8))


# -- the last run of each KSampler (for the web panel) -------------------------------------------------

def _run_from_workflow(comfy, prompt: dict, workflow: str):
    """Queue ``prompt`` as the frontend does, with the workflow (and its id) in extra_pnginfo."""
    r = comfy.post("/prompt", {"prompt": prompt, "client_id": comfy.client_id,
                               "extra_data": {"extra_pnginfo": {"workflow": {"id": workflow, "nodes": []}}}})
    assert r.status_code == 200, r.text[:2000]
    pid = r.json()["prompt_id"]
    return comfy.wait(pid, 120), pid


def _last_runs(comfy, workflow: str) -> dict:
    r = comfy.get(f"/sgldiffusion/last_runs?workflow={urllib.parse.quote(workflow)}")
    assert r.status_code == 200
    return r.json()["runs"]


def test_last_run_is_kept_for_a_cached_rerun_and_a_reload(comfy):
    """ComfyUI neither runs nor reports a KSampler whose output it reuses, and a reloaded page has no
    outputs: GET /sgldiffusion/last_runs keeps each KSampler's last run, per workflow id."""
    import uuid

    wf = str(uuid.uuid4())
    g = graph(seed=46)
    entry, pid = _run_from_workflow(comfy, g, wf)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    stats = entry["outputs"]["5"]["sgld_stats"][0]
    runs = _last_runs(comfy, wf)
    assert set(runs) == {"5"} and runs["5"]["state"] == "done" and runs["5"]["prompt_id"] == pid
    assert runs["5"]["step_mask"] == stats["step_mask"] and runs["5"]["timeline"] == stats["timeline"]

    entry, _ = _run_from_workflow(comfy, g, wf)  # unchanged: the KSampler's output is reused
    assert entry["status"]["status_str"] == "success" and "5" not in entry["outputs"], entry["outputs"]
    assert _last_runs(comfy, wf)["5"]["prompt_id"] == pid  # still the run that made the output
    assert _last_runs(comfy, "another-workflow") == {}

    g["4"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}}
    entry, pid = _run_from_workflow(comfy, g, wf)
    assert entry["status"]["status_str"] == "error"
    rec = _last_runs(comfy, wf)["5"]
    assert rec["state"] == "failed" and rec["prompt_id"] == pid and "latent has 4 channels" in rec["error"], rec
