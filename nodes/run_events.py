"""The run events of the sampler nodes (SGLDiffusion KSampler, and a MODEL's run through any sampler): the
``sgldiffusion.run`` PromptServer messages the web extension (web/sgldiffusion.js) listens to (state running /
done / failed / interrupted), the statistics of a finished run (``run_stats``), and the last finished run of each
sampler node (``last_runs``, served as /sgldiffusion/last_runs), kept by workflow id, node and graph content
(``graph_fingerprint``): ComfyUI does not re-send a cached node's output, and a reloaded page has none.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict

log = logging.getLogger("sgldiffusion")
RUN_EVENT = "sgldiffusion.run"  # PromptServer message the web extension listens to
ERROR_CHARS = 4000  # an error message longer than this is cut in the run event (the panel shows all of it)
MAX_LAST_RUNS = 256  # (workflow, node, graph) runs remembered; the oldest are forgotten first
GRAPH_KEY = "graph"  # in a run record: graph_fingerprint() of the prompt that ran it

_last_runs: "OrderedDict[tuple, dict]" = OrderedDict()
_last_runs_lock = threading.Lock()


def workflow_id(extra_pnginfo) -> str:
    """The id of the frontend workflow a prompt was queued from ("" for prompts sent without one)."""
    wf = extra_pnginfo.get("workflow") if isinstance(extra_pnginfo, dict) else None
    wid = wf.get("id") if isinstance(wf, dict) else None
    return str(wid) if wid else ""


def _control_after_generate(class_type) -> set:
    """The inputs of a node class that the frontend changes by itself after each queue (a seed on
    'randomize'): not part of what a graph is."""
    try:
        import nodes

        spec = nodes.NODE_CLASS_MAPPINGS[class_type].INPUT_TYPES()
    except Exception:  # not in a running ComfyUI, an unknown class: every input counts
        return set()
    return {name for group in ("required", "optional") for name, entry in (spec.get(group) or {}).items()
            if isinstance(entry, (list, tuple)) and len(entry) > 1 and isinstance(entry[1], dict)
            and entry[1].get("control_after_generate")}


def _plain(value):
    """An input value as the browser sends it: ComfyUI's validation turns a FLOAT's 3 into 3.0 in the prompt."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def graph_fingerprint(prompt, node) -> str:
    """What makes ``node``'s result in an API prompt: its class and inputs and those of every node it
    depends on (links by the ids they point to), as a hash. The frontend's position, size and title of nodes
    do not count, nor a seed the frontend changes after each queue. "" when ``node`` is not in ``prompt``."""
    if not isinstance(prompt, dict) or str(node) not in prompt:
        return ""
    seen, todo, parts = set(), [str(node)], {}
    while todo:
        nid = todo.pop()
        entry = prompt.get(nid)
        if nid in seen or not isinstance(entry, dict):
            continue
        seen.add(nid)
        inputs = entry.get("inputs") if isinstance(entry.get("inputs"), dict) else {}
        skip = _control_after_generate(entry.get("class_type"))
        for value in inputs.values():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int)):
                todo.append(str(value[0]))
        parts[nid] = [entry.get("class_type"), {k: (None if k in skip else _plain(v)) for k, v in inputs.items()}]
    text = json.dumps(parts, sort_keys=True, default=str, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def remember_run(workflow: str, record: dict) -> None:
    """Keep the outcome of a KSampler run (done / failed / interrupted) for /sgldiffusion/last_runs, under
    its workflow id, node and graph (the record's ``graph``; "" when its caller had no prompt)."""
    if record.get("node") is None:
        return
    with _last_runs_lock:
        key = (workflow, str(record["node"]), str(record.get(GRAPH_KEY) or ""))
        _last_runs.pop(key, None)
        _last_runs[key] = dict(record)
        while len(_last_runs) > MAX_LAST_RUNS:
            _last_runs.popitem(last=False)


def last_runs(workflow: str, prompt=None) -> dict:
    """{node id: last run record} for the KSamplers of one workflow. With ``prompt`` (the API form of the graph
    the browser shows), only the runs of that very graph: a record of the node's graph as it is now, or one
    recorded without a graph; another graph under the same workflow id (a template loaded twice and changed)
    shows nothing of it."""
    with _last_runs_lock:
        records = [(node, graph, dict(rec)) for (wf, node, graph), rec in _last_runs.items() if wf == workflow]
    out = {}
    for node, graph, rec in records:  # oldest first: the newest of a node wins
        if prompt is None or not graph or graph == graph_fingerprint(prompt, node):
            out[node] = rec
    return out


def send_run_event(data: dict, workflow: str = "") -> None:
    """Tell the browser that queued the prompt (ComfyUI's current client) what this node is doing, and
    remember a finished run for ``workflow``. Best effort: never lets a UI message break a run."""
    try:
        from comfy_execution.utils import get_executing_context

        ctx = get_executing_context()
        if ctx is not None:
            data.setdefault("prompt_id", ctx.prompt_id)
    except Exception:
        pass
    data.setdefault("workflow", workflow)  # the browser ignores the runs of a workflow it does not show
    if data.get("state") in ("done", "failed", "interrupted"):
        remember_run(workflow, data)
    try:
        from server import PromptServer

        server = PromptServer.instance
        server.send_sync(RUN_EVENT, data, server.client_id)
    except Exception as e:  # outside a server (direct calls, tests)
        log.debug("SGLDiffusion: no run event sent (%s)", e)


def run_stats(engine, node_id, warnings=()) -> dict:
    """What the engine says about itself and its last run (``Engine.describe``), for the node's UI output and
    the web extension (its run panel says what ran: the weights, the CPU threads, the LoRAs). ``warnings``: the engine's (load), the inputs' (``warnings``) and the run's, each once."""
    described = engine.describe()
    stats = dict(described["last_run"])
    stats["attention"] = described["attention"]
    stats["warnings"] = list(dict.fromkeys([*described["warnings"], *warnings, *stats.get("warnings", [])]))
    stats["node"] = None if node_id is None else str(node_id)
    stats["state"] = "done"
    # one cell per model call: True = computed, False = cached (Cache-DiT reused the residual)
    stats["timeline"] = list(engine.last_run.step_mask)
    stats["calls_cached"] = stats["model_calls"] - stats["calls_computed"]
    stats.setdefault("speedup", 1.0)
    offload = described["offload"]
    if offload is not None:
        stats["offload"] = "layerwise"
        stats["offload_detail"] = f"{offload['resident_layers']}/{offload['blocks']} blocks resident"
    else:
        mode = engine.config.offload
        stats["offload"] = "none" if mode == "none" else f"none ({mode})"
    stats["quant"] = described["quant"] or "none"  # what the blocks really hold (pre-quantized files too)
    # the panel says what ran: the weights' format by name ("gguf q4_k + q6_k"; the dtype when none is quantized), the
    # device (its CPU threads are the run's ``threads``), the active LoRAs by file name with their strengths
    stats["weights"] = described.get("weights") or described["dtype"]
    stats["dtype"], stats["dtype_reason"] = described["dtype"], described.get("dtype_reason", "")  # what computed, why
    stats["device"] = described["device"]
    stats["loras"] = [[os.path.basename(str(path)), strength] for path, strength in described["loras"]]
    if described["parallel"] is not None:
        stats["parallel"] = described["parallel"]["world_size"]
    return stats
