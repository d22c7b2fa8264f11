"""What a real ComfyUI 0.3.75 shows of the pack's nodes and the web panel's records: every input of every node
has a tooltip (GET /object_info), and POST /sgldiffusion/last_runs gives a KSampler's last run only to the graph
content that ran it (a template loaded again under the same workflow id, then changed, gets none)."""
from __future__ import annotations

import json
import uuid

import comfy_server as cs
import pytest

# The module's ComfyUI server is tests/conftest.py's `comfy` fixture with the shared base folder (TINY).


@pytest.fixture(scope="module")
def object_info(comfy):
    info = comfy.get("/object_info", timeout=60).json()
    module = info["SGLDiffusionKSampler"]["python_module"]  # the pack's folder, as ComfyUI names it
    ours = {k: v for k, v in info.items() if v["python_module"] == module}
    assert {"SGLDiffusionModelLoader", "SGLDiffusionCacheDiT", "SGLDiffusionServerGenerate"} <= set(ours), sorted(ours)
    return ours


def test_every_input_of_every_node_has_a_tooltip(object_info):
    missing = [f"{name}.{inp}" for name, node in sorted(object_info.items())
               for group in ("required", "optional") for inp, spec in node["input"].get(group, {}).items()
               if len(spec) < 2 or not str((spec[1] or {}).get("tooltip", "")).strip()]
    assert missing == [], missing


def _last_runs(comfy, workflow, prompt):
    r = comfy.post("/sgldiffusion/last_runs", {"workflow": workflow, "prompt": prompt})
    assert r.status_code == 200, r.text[:500]
    return r.json()["runs"]


def test_last_runs_are_keyed_by_graph_content(comfy):
    wf = str(uuid.uuid4())
    g = cs.tiny_graph(cs.TINY, seed=5, steps=2, width=64, height=64, prefix="polish")
    r = comfy.post("/prompt", {"prompt": g, "client_id": comfy.client_id,
                               "extra_data": {"extra_pnginfo": {"workflow": {"id": wf, "nodes": []}}}})
    assert r.status_code == 200, r.text[:500]
    pid = r.json()["prompt_id"]
    entry = comfy.wait(pid)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    assert entry["outputs"]["5"]["sgld_stats"][0]["workflow"] == wf  # the browser ignores runs of other workflows

    # the graph as the browser sends it back: JSON numbers as it writes them (cfg 1, not 1.0)
    as_sent = json.loads(json.dumps(g).replace('"cfg": 1.0', '"cfg": 1'))
    assert _last_runs(comfy, wf, as_sent)["5"]["prompt_id"] == pid
    reseeded = json.loads(json.dumps(g))
    reseeded["5"]["inputs"]["seed"] = 6  # the frontend's control_after_generate: still this graph
    assert _last_runs(comfy, wf, reseeded)["5"]["prompt_id"] == pid
    moved = json.loads(json.dumps(g))
    moved["2"]["inputs"]["seed"] = 9  # another prompt upstream: another graph
    assert _last_runs(comfy, wf, moved) == {}
    other = json.loads(json.dumps(g))
    other["5"]["inputs"]["steps"] = 3
    assert _last_runs(comfy, wf, other) == {}
    assert _last_runs(comfy, "another-workflow", g) == {}
    # GET, by id alone (older pages), still answers
    assert comfy.get(f"/sgldiffusion/last_runs?workflow={wf}").json()["runs"]["5"]["prompt_id"] == pid
    bad = comfy.post("/sgldiffusion/last_runs", {"workflow": wf, "prompt": "not a graph"})
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]
