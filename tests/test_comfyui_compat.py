"""Help for older ComfyUI (issue 20, item 7) in a real ComfyUI 0.3.75 (scripts/comfyui.sh): the start-up check
of nodes/compat.py (one log line naming what this ComfyUI lacks for the ERNIE-Image workflows, the same text on
our nodes and on the web panel), SGLDiffusion Empty Latent (ERNIE) against ComfyUI's own EmptyFlux2LatentImage,
and the workflows' ``properties.models`` download entries, checked as the frontend (1.32.9) reads them: in
its schema (zModelFile) and in its missing-models dialog in a real browser (skipped without chromium).
0.3.75 has EmptyFlux2LatentImage and CLIPLoader's flux2 type (since 0.3.72) but not the Ministral-3 text
encoder (since 0.19), so the line names that one only; a probe run before ComfyUI registers its extra nodes
shows the node check finding its absence."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile

import pytest

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
    from . import pack_modules
except ImportError:
    import comfy_server as cs
    import pack_modules

ROOT = cs.ROOT
TESTS = os.path.dirname(os.path.abspath(__file__))
ERNIE_WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, "workflows", "ERNIE-Image*.json")))
TURBO = os.path.join(ROOT, "workflows", "ERNIE-Image Turbo.json")
DEMO = os.path.join(ROOT, "workflows", "SGLDiffusion CPU demo.json")
NODE = "SGLDiffusionEmptyLatentERNIE"
# Comfy-Org's repackaged ERNIE-Image files (/work/shared/reference/ernie_image.md §4; the URLs as Comfy-Org's
# own template image_ernie_image_turbo.json gives them): folder -> file names
HF = "https://huggingface.co/Comfy-Org/ERNIE-Image/resolve/main"
COMFY_ORG_FILES = {"diffusion_models": {"ernie-image-turbo.safetensors", "ernie-image.safetensors"},
                   "text_encoders": {"ministral-3-3b.safetensors"}, "vae": {"flux2-vae.safetensors"}}
# each family's Comfy-Org repack: (where its files are, the files per folder)
REPACKS = {"ERNIE-Image": (HF, COMFY_ORG_FILES),
           "Z-Image": ("https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files",
                       {"diffusion_models": {"z_image_turbo_bf16.safetensors"}, "text_encoders": {"qwen_3_4b.safetensors"},
                        "vae": {"ae.safetensors"}})}
MODEL_WORKFLOWS = [p for p in sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json"))) if "demo" not in p]
LOADER_FOLDERS = {"SGLDiffusionModelLoader": "diffusion_models", "CLIPLoader": "text_encoders", "VAELoader": "vae"}
MODEL_FILE_KEYS = {"name", "url", "hash", "hash_type", "directory"}  # the frontend's zModelFile


def compat_module():
    """nodes/compat.py without ComfyUI."""
    return pack_modules.node_module("compat")


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture with the shared base folder.


@pytest.fixture(scope="module")
def object_info(comfy):
    r = comfy.get("/object_info", timeout=60)
    assert r.status_code == 200
    return r.json()


def found_in_this_comfyui(object_info) -> dict:
    """What compat's probes should find, read from ComfyUI itself: its node list and CLIPLoader's types
    (/object_info) and whether its tree defines the Ministral-3 text encoder."""
    with open(os.path.join(cs.COMFY_DIR, "comfy", "sd.py"), encoding="utf-8") as f:
        sd = f.read()
    ministral = "MINISTRAL_3_3B" in sd or os.path.exists(os.path.join(cs.COMFY_DIR, "comfy", "text_encoders", "ernie.py"))
    with open(os.path.join(cs.COMFY_DIR, "comfy", "latent_formats.py"), encoding="utf-8") as f:
        flux2 = "class Flux2(" in f.read()
    with open(os.path.join(cs.COMFY_DIR, "comfy", "ldm", "models", "autoencoder.py"), encoding="utf-8") as f:
        vae = "batch_norm_latent" in f.read()
    return {"empty_flux2_latent": "EmptyFlux2LatentImage" in object_info,
            "flux2_clip_type": "flux2" in object_info["CLIPLoader"]["input"]["required"]["type"][0],
            "ministral3_text_encoder": ministral, "flux2_latent_format": flux2, "flux2_vae": vae,
            "qwen3_4b_text_encoder": "QWEN3_4B =" in sd}


def expected_notice(object_info) -> str:
    return compat_module().notice(found_in_this_comfyui(object_info), "0.3.75")


# -- the notice ----------------------------------------------------------------------------------------------

def test_notice_names_each_missing_feature_and_nothing_else():
    c = compat_module()
    assert c.notice({name: True for name in c.FEATURES}, "0.19.0") == ""
    for name, what in c.FEATURES.items():
        line = c.notice({k: k != name for k in c.FEATURES}, "0.3.10")
        assert what in line and "this ComfyUI (0.3.10)" in line and "update to ComfyUI 0.19 or newer" in line, line
        assert "\n" not in line and not any(c.FEATURES[k] in line for k in c.FEATURES if k != name), line
    assert all(w in c.notice({}) for w in c.FEATURES.values()) and "this ComfyUI lacks" in c.notice({})


def api_node(kind, **inputs):
    return {"class_type": kind, "inputs": inputs}


def test_a_graph_needs_only_what_its_nodes_use():
    """The web panel's notice is for the graph shown: the demo's nodes need none of the features; a CLIPLoader of
    the Ministral-3 file needs the text encoder (and the flux2 type), a sampler on comfy_model the Flux2 latent."""
    c = compat_module()
    demo = {"1": api_node("SGLDiffusionModelLoader", unet_name="sgld-demo (embedded, 64x64)"),
            "2": api_node("SGLDiffusionDemoTextEncode", text="a red circle"),
            "6": api_node("SGLDiffusionKSampler", model=["1", 0], positive=["2", 0])}
    assert c.needed(demo) == set()
    lacking = {name: name != "ministral3_text_encoder" for name in c.FEATURES}  # ComfyUI 0.3.75
    assert c.notice(lacking, "0.3.75") and c.graph_notice(lacking, demo, "0.3.75") == ""
    ernie = dict(demo, **{"7": api_node("CLIPLoader", clip_name="ministral-3-3b.safetensors", type="flux2", device="default")})
    assert c.needed(ernie) == {"ministral3_text_encoder", "flux2_clip_type"}
    assert c.graph_notice(lacking, ernie, "0.3.75") == c.notice(lacking, "0.3.75")
    flux2 = {"7": api_node("CLIPLoader", clip_name="mistral_3_small_flux2_bf16.safetensors", type="flux2")}
    assert c.needed(flux2) == {"flux2_clip_type"}  # Flux.2's own encoder: not ERNIE-Image's
    z_image = {"7": api_node("CLIPLoader", clip_name="qwen_3_4b.safetensors", type="lumina2", device="default"),
               "8": api_node("EmptySD3LatentImage", width=1024, height=1024, batch_size=1)}
    assert c.needed(z_image) == {"qwen3_4b_text_encoder"}
    any_sampler = dict(demo, **{"8": api_node("KSampler", model=["1", 1]), "9": api_node("VAELoader", vae_name="flux2-vae.safetensors"),
                                "10": api_node("EmptyFlux2LatentImage", width=64, height=64, batch_size=1)})
    assert c.needed(any_sampler) == {"flux2_latent_format", "flux2_vae", "empty_flux2_latent"}
    assert c.needed("not a graph") == set() and c.needed({"1": None, "2": {"class_type": 3}}) == set()


PROBE = r"""
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
import pack_modules
compat = pack_modules.node_module("compat")
if sys.argv[2] == "comfyui":
    from comfy.cli_args import args
    args.cpu = True  # as the server runs
    import nodes
out = {"before": compat.probe()}
if sys.argv[2] == "comfyui":
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    out["after"] = compat.probe()
print(json.dumps(out))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("where", ["comfyui", "no-comfyui"])
def test_probe_on_real_modules(where, tmp_path):
    """In ComfyUI 0.3.75's own modules: EmptyFlux2LatentImage is not found until ComfyUI registers its extra
    nodes (as before 0.3.72), then found; flux2 found; the Ministral-3 encoder not. Without ComfyUI at all the
    probes find nothing and raise nothing."""
    cwd = cs.ensure_comfyui() if where == "comfyui" else str(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([cs.python(), "-c", PROBE, TESTS, where], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if where == "no-comfyui":
        assert out == {"before": {name: False for name in compat_module().FEATURES}}
        return
    assert out["before"] == {"empty_flux2_latent": False, "flux2_clip_type": True, "ministral3_text_encoder": False,
                             "flux2_latent_format": True, "flux2_vae": True, "qwen3_4b_text_encoder": True}
    assert out["after"] == {"empty_flux2_latent": True, "flux2_clip_type": True, "ministral3_text_encoder": False,
                            "flux2_latent_format": True, "flux2_vae": True, "qwen3_4b_text_encoder": True}


def test_startup_line_logged_once_naming_what_is_missing(comfy, object_info):
    notice = expected_notice(object_info)
    assert "the Ministral-3 text encoder" in notice and "EmptyFlux2LatentImage" not in notice and "'flux2'" not in notice
    lines = [line for line in comfy.log().splitlines() if "SGLDiffusion: this ComfyUI" in line]
    assert len(lines) == 1 and lines[0].endswith(notice), lines
    assert "IMPORT FAILED" not in comfy.log()


def test_our_nodes_show_it(comfy, object_info):
    """In the description of every node of the pack but the demo's and the remote server's (which need no
    ERNIE-Image file here), and in GET /sgldiffusion/last_runs, which the web panel reads."""
    notice = expected_notice(object_info)
    ours = {k: v for k, v in object_info.items() if v["python_module"] == f"custom_nodes.{cs.PACK_NAME}"}
    ernie = {k for k, v in ours.items() if v["category"] not in ("SGLDiffusion/demo", "SGLDiffusion/remote")}
    assert {"SGLDiffusionModelLoader", "SGLDiffusionKSampler", "SGLDiffusionLoraLoader", "SGLDiffusionCacheDiT", NODE} <= ernie
    for name, info in ours.items():
        assert info["description"].endswith(notice) == (name in ernie), (name, info["description"])
    assert object_info[NODE]["description"].startswith("An empty ERNIE-Image latent")
    r = comfy.get("/sgldiffusion/last_runs", params={"workflow": "x"})
    assert r.status_code == 200 and r.json()["compat"] == notice


# -- SGLDiffusion Empty Latent (ERNIE) --------------------------------------------------------------------------

def test_empty_latent_in_object_info(object_info):
    from engine.sampling import MAX_IMAGE_SIDE

    info = object_info[NODE]
    assert info["display_name"] == "SGLDiffusion Empty Latent (ERNIE)" and info["category"] == "SGLDiffusion"
    assert info["output"] == ["LATENT"] and info["input_order"]["required"] == ["width", "height", "batch_size"]
    core = object_info["EmptyFlux2LatentImage"]["input"]["required"]
    for side in ("width", "height"):
        spec = info["input"]["required"][side]
        assert spec[0] == "INT" and (spec[1]["default"], spec[1]["min"], spec[1]["step"], spec[1]["max"]) == (1024, 16, 16, MAX_IMAGE_SIDE)
        assert (spec[1]["default"], spec[1]["min"], spec[1]["step"]) == tuple(core[side][1][k] for k in ("default", "min", "step"))
    assert (info["input"]["required"]["batch_size"][1]["min"], info["input"]["required"]["batch_size"][1]["max"]) == (1, 4096)


def latent_graph(node: str, width: int, height: int, batch: int, prefix: str) -> dict:
    return {"1": {"class_type": node, "inputs": {"width": width, "height": height, "batch_size": batch}},
            "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": prefix}}}


def test_empty_latent_equals_comfyuis_empty_flux2_latent(comfy):
    import torch

    ours = cs.saved_latent(comfy, comfy.run(latent_graph(NODE, 1264, 848, 2, "compat/ours")), "2")
    core = cs.saved_latent(comfy, comfy.run(latent_graph("EmptyFlux2LatentImage", 1264, 848, 2, "compat/core")), "2")
    assert ours.shape == (2, 128, 53, 79) and ours.dtype == torch.float32 and not ours.any()
    assert ours.shape == core.shape and ours.dtype == core.dtype and torch.equal(ours, core)


def test_empty_latent_refuses_a_size_not_a_multiple_of_16(comfy):
    entry = comfy.run(latent_graph(NODE, 1000, 1024, 1, "compat/bad"))  # ComfyUI checks min and max, not the step
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = cs.error_message(entry)
    assert err["node_type"] == NODE and "Traceback" not in err["exception_message"]
    assert err["exception_message"].strip() == ("SGLDiffusion Empty Latent (ERNIE): width must be a multiple of 16 pixels (got 1000; "
                                        "ERNIE-Image's latent has one cell per 16x16 pixels)"), err


@pytest.mark.parametrize("inputs, field", [({"width": 8192}, "width"), ({"height": 0}, "height"), ({"batch_size": 0}, "batch_size")])
def test_empty_latent_refuses_sizes_beyond_the_limits(comfy, inputs, field):
    graph = latent_graph(NODE, 1024, 1024, 1, "compat/limit")
    graph["1"]["inputs"].update(inputs)
    r = comfy.post("/prompt", {"prompt": graph, "client_id": comfy.client_id})
    assert r.status_code == 400, r.text[:2000]
    errors = r.json()["node_errors"]["1"]["errors"]
    assert [e["extra_info"]["input_name"] for e in errors] == [field], errors
    assert errors[0]["type"] in ("value_bigger_than_max", "value_smaller_than_min"), errors


@pytest.mark.parametrize("size, fragment", [((1024, 1000, 1), "height must be a multiple of 16"),
                                            ((4112, 16, 1), "width must be an integer from 16 to 4096"),
                                            ((16, 16, 4097), "batch_size must be an integer from 1 to 4096"),
                                            ((16.0, 16, 1), "width must be an integer")])
def test_empty_latent_shape_refusals(size, fragment):
    from engine.errors import InputError
    from engine.inputs import empty_latent_shape
    from engine.models import get

    ernie = get("ernie-image")
    assert empty_latent_shape(ernie, 4096, 16, 3) == (3, 128, 1, 256)
    with pytest.raises(InputError, match=fragment):
        empty_latent_shape(ernie, *size)


# -- properties.models in the workflows -------------------------------------------------------------------------

def test_workflows_carry_well_formed_model_entries(comfy):
    """Each model workflow's loaders name their file's download: the entry's name is the widget's value (the
    frontend keeps only those), a URL of the family's Comfy-Org repack on huggingface.co (the frontend's download
    allow-list), a .safetensors name, and a folder ComfyUI knows (GET /models)."""
    folders = set(comfy.get("/models").json())
    assert len(ERNIE_WORKFLOWS) >= 3 and len(MODEL_WORKFLOWS) == len(ERNIE_WORKFLOWS) + 1
    for path in MODEL_WORKFLOWS:
        with open(path) as f:
            wf = json.load(f)
        hf, files = REPACKS[wf["extra"]["sgldiffusion"]["model"].split()[0]]
        seen = set()
        for node in wf["nodes"]:
            entries = node.get("properties", {}).get("models")
            if node["type"] not in LOADER_FOLDERS:
                assert entries is None, (path, node["type"])
                continue
            folder = LOADER_FOLDERS[node["type"]]
            assert isinstance(entries, list) and len(entries) == 1, (path, node["type"], entries)
            e = entries[0]
            assert set(e) <= MODEL_FILE_KEYS and all(isinstance(e[k], str) for k in ("name", "url", "directory")), e
            assert e["directory"] == folder and folder in folders, e
            assert e["name"] == node["widgets_values"][0] and e["name"] in files[folder], e
            assert e["url"] == f"{hf}/{folder}/{e['name']}" and e["name"].endswith(".safetensors"), e
            seen.add(folder)
        assert seen == set(files), (path, seen)
    with open(os.path.join(ROOT, "workflows", "SGLDiffusion CPU demo.json")) as f:
        assert not any("models" in n.get("properties", {}) for n in json.load(f)["nodes"])  # its model is embedded


# -- in the browser ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(comfy):
    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        pytest.skip(f"{chromium} missing (bash scripts/browser.sh installs Debian's chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the Python playwright package (requirements-dev.txt)")
    profile = tempfile.mkdtemp(prefix="sgld-chromium-")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True,
                                                   args=["--headless=new", "--no-sandbox", "--disable-gpu"],
                                                   viewport={"width": 1400, "height": 860})
        try:
            pg = ctx.pages[0] if ctx.pages else ctx.new_page()
            pg.goto(comfy.url)
            pg.wait_for_function("() => window.app?.graph && document.getElementById('sgld-run-style')", timeout=60_000)
            yield pg
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


LOAD = "async ([wf, name]) => { await window.app.loadGraphData(wf, true, true, name); }"


@pytest.mark.browser
def test_frontend_offers_the_downloads_and_the_panel_shows_the_notice(page, object_info):
    """The Turbo workflow in frontend 1.32.9 (it validates workflows against its schema on load): the missing-
    models dialog lists the three files in their folders, each with a download whose target is its URL; the
    SGLDiffusion KSampler's panel, not run yet, shows what this ComfyUI lacks."""
    with open(TURBO) as f:
        wf = json.load(f)
    page.evaluate(LOAD, [wf, os.path.basename(TURBO)])
    dialog = page.locator(".p-dialog").filter(has_text="flux2-vae.safetensors")
    dialog.first.wait_for(state="visible", timeout=30_000)
    text = dialog.first.inner_text()
    for folder, name in (("diffusion_models", "ernie-image-turbo.safetensors"), ("text_encoders", "ministral-3-3b.safetensors"),
                         ("vae", "flux2-vae.safetensors")):
        assert f"{folder} / {name}" in text, text
        assert dialog.first.locator(f"button[title='{HF}/{folder}/{name}']").count() == 1, text
    assert "Invalid directory" not in text
    page.keyboard.press("Escape")
    ks = next(str(n["id"]) for n in wf["nodes"] if n["type"] == "SGLDiffusionKSampler")
    page.wait_for_function(f"() => document.querySelector('.sgld-run[data-node-id=\"{ks}\"] .sgld-compat')", timeout=30_000)
    panel = page.locator(f".sgld-run[data-node-id='{ks}']")
    assert panel.get_attribute("data-state") == "idle"
    assert panel.locator(".sgld-compat").inner_text() == f"⚠ {expected_notice(object_info)}"


@pytest.mark.browser
def test_demo_workflow_shows_no_notice(page, object_info, comfy):
    """Issue 33 item 10a: the demo workflow uses none of what 0.3.75 lacks (its text encoder is the demo's own):
    its KSampler's panel, not run yet, shows no update notice, though the Turbo workflow's did on the same page;
    the pack answers the demo's graph (as the frontend sends it) with no notice, the Turbo graph with it."""
    prompts = {}
    for path in (TURBO, DEMO):
        with open(path) as f:
            wf = json.load(f)
        page.evaluate(LOAD, [wf, os.path.basename(path)])
        page.keyboard.press("Escape")  # the Turbo workflow's missing-models dialog
        prompts[path] = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    ks = next(str(n["id"]) for n in wf["nodes"] if n["type"] == "SGLDiffusionKSampler")
    page.wait_for_function(f"() => document.querySelector('.sgld-run[data-node-id=\"{ks}\"]')?.dataset.state === 'idle'"
                           f" && !document.querySelector('.sgld-run[data-node-id=\"{ks}\"] .sgld-compat')", timeout=30_000)
    answers = {path: comfy.post("/sgldiffusion/last_runs", {"workflow": "w", "prompt": p}).json()["compat"]
               for path, p in prompts.items()}
    assert answers == {TURBO: expected_notice(object_info), DEMO: ""}, answers
