"""SGLDiffusion KSampler: ComfyUI's KSampler widgets, sampling done by ``engine.Engine.sample``.

Only type adaptation happens here: CONDITIONING -> lists of text features, LATENT dict <-> tensor,
the engine's step callback -> ComfyUI's progress bar, preview and interrupt check, and the run's
statistics -> the web extension (web/sgldiffusion.js): the ``sgld_stats`` UI output of a finished run,
and ``sgldiffusion.run`` PromptServer messages (state running / done / failed / interrupted). The last
finished run of each KSampler is also kept here (``last_runs``, served as /sgldiffusion/last_runs), by
workflow id, node and graph content (``graph_fingerprint``): ComfyUI does not re-send a cached KSampler's
output, and a reloaded page has none.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict

import comfy.latent_formats
import comfy.model_management
import comfy.utils

from ..engine import CheckpointError, InputError
from ..engine.features.cache import CacheConfigError, resolve_config
from ..engine.inputs import latent_hint
from ..engine.models import families
from ..engine.options import node_inputs
from ..engine.parallel import ParallelConfigError, ParallelWorkerError
from ..engine.sampling_options import SamplingOptions
from .demo import WARNINGS_KEY
from .server_nodes import RemoteModel, sample_remote

log = logging.getLogger("sgldiffusion")
RUN_EVENT = "sgldiffusion.run"  # PromptServer message the web extension listens to
NODE = "SGLDiffusion KSampler"
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


def conditioning_features(name: str, conditioning) -> list:
    """ComfyUI CONDITIONING ([[tensor [1, T, C], {...}], ...]) -> one text-feature tensor per entry."""
    if conditioning is None:
        return None
    if not isinstance(conditioning, (list, tuple)):
        raise ValueError(f"{NODE}: {name} is a {type(conditioning).__name__}, not a CONDITIONING list; connect a CLIPTextEncode output")
    feats = []
    for i, entry in enumerate(conditioning):
        if isinstance(entry, (list, tuple)) and len(entry) >= 1:
            feats.append(entry[0])
        else:
            raise ValueError(f"{NODE}: {name} conditioning #{i} is not a [tensor, options] pair")
    return feats


def conditioning_warnings(name: str, conditioning) -> list:
    """Warnings a text encoder attached to its CONDITIONING (Demo Text Encode: words the demo does not know)."""
    out = []
    for entry in conditioning or []:
        opts = entry[1] if isinstance(entry, (list, tuple)) and len(entry) > 1 and isinstance(entry[1], dict) else {}
        out += [f"{name} prompt: {w}" for w in opts.get(WARNINGS_KEY, [])]
    return out


def latent_samples(latent, channels: int):
    if not isinstance(latent, dict) or "samples" not in latent:
        raise ValueError(f"{NODE}: latent_image is not a LATENT (a dict with 'samples'); this model takes "
                         f"{channels} latent channels{latent_hint(channels)}")
    return latent["samples"]


class StepReporter:
    """Engine step callback -> interrupt check, ComfyUI progress bar and (if enabled) a preview."""

    def __init__(self, steps: int, channels: int, device):
        self.pbar = comfy.utils.ProgressBar(steps)
        self.previewer = None
        formats = [f.latent.comfy_format for f in families() if f.latent.channels == channels and f.latent.comfy_format]
        if formats:  # a family's latent (ERNIE-Image: ComfyUI's Flux2 format); the demo's has no previewer
            try:
                import latent_preview

                self.previewer = latent_preview.get_previewer(device, getattr(comfy.latent_formats, formats[0])())
            except Exception as e:  # no preview is better than no image
                log.warning("SGLDiffusion: step previews disabled (%s)", e)

    def __call__(self, step, total, x, denoised):
        comfy.model_management.throw_exception_if_processing_interrupted()
        preview = None
        if self.previewer is not None:
            try:
                preview = self.previewer.decode_latent_to_preview_image("JPEG", denoised)
            except Exception as e:
                log.warning("SGLDiffusion: step previews disabled (%s)", e)
                self.previewer = None
        self.pbar.update_absolute(step + 1, total, preview)


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
    the web extension. ``warnings``: the engine's (load), the inputs' (``warnings``) and the run's, each once."""
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
    if described["parallel"] is not None:
        stats["parallel"] = described["parallel"]["world_size"]
    return stats


def comfy_ksampler_inputs() -> dict:
    """ComfyUI's own KSampler's required inputs ({} outside a running ComfyUI)."""
    try:
        import nodes

        return dict(nodes.KSampler.INPUT_TYPES()["required"])
    except Exception:
        return {}


def sampling_widgets() -> dict:
    """{widget: spec} of the sampling options (SamplingOptions' widgets): ComfyUI's KSampler's own definitions
    where it has the widget (its type, range, step, round, control_after_generate, whatever this ComfyUI adds),
    with the declaration's default, tooltip and, for a list, the choices this engine runs; the declaration's
    alone outside ComfyUI."""
    ours, theirs = node_inputs(SamplingOptions)["required"], comfy_ksampler_inputs()
    out = {}
    for widget, (kind, spec) in ours.items():
        their = theirs.get(widget)
        if not isinstance(their, (list, tuple)) or not their or isinstance(kind, list) != isinstance(their[0], list):
            out[widget] = (kind, spec)
            continue
        extra = {**(their[1] if len(their) > 1 and isinstance(their[1], dict) else {}), **spec}
        out[widget] = (kind if isinstance(kind, list) else their[0], extra)
    return out


class SGLDiffusionKSampler:
    DESCRIPTION = ("Denoises a latent with an SGLDiffusion model: the same inputs and results as ComfyUI's KSampler "
                   "for ERNIE-Image (batches, img2img with denoise < 1, inpainting with a latent's noise mask), run by "
                   "the SGLDiffusion engine (optional Cache-DiT step caching).")
    CATEGORY = "SGLDiffusion"
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The denoised latent.",)
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        """KSampler's inputs in KSampler's order; the sampling widgets from ``sampling_widgets``."""
        w = sampling_widgets()
        return {
            "required": {
                "model": ("SGLD_MODEL", {"tooltip": "From SGLDiffusion Model Loader (or SGLDiffusion Server: sampled there)."}),
                **{name: w[name] for name in ("seed", "steps", "cfg", "sampler_name", "scheduler")},
                "positive": ("CONDITIONING", {"tooltip": "What the image should show."}),
                "negative": ("CONDITIONING", {"tooltip": "What the image should not show (unused at cfg 1)."}),
                "latent_image": ("LATENT", {"tooltip": ("The latent to denoise (text-to-image: EmptyFlux2LatentImage for "
                                                        "ERNIE-Image, SGLDiffusion Demo Empty Latent for the demo model); "
                                                        "a noise mask (SetLatentNoiseMask) repaints only where it is 1.")}),
                "denoise": w["denoise"],
            },
            "optional": {
                "cache": ("SGLD_CACHE", {"tooltip": "Cache-DiT step caching options (SGLDiffusion Cache-DiT node)."}),
            },
            # the workflow's id and the graph key the node's last run for the web panel (/sgldiffusion/last_runs)
            "hidden": {"unique_id": "UNIQUE_ID", "extra_pnginfo": "EXTRA_PNGINFO", "prompt": "PROMPT"},
        }

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
               denoise=1.0, cache=None, unique_id=None, extra_pnginfo=None, prompt=None):
        node = None if unique_id is None else str(unique_id)
        workflow = workflow_id(extra_pnginfo)
        graph = {GRAPH_KEY: graph_fingerprint(prompt, node)}
        # the browser clears this node's previous timeline now; a failure below never leaves it showing
        send_run_event({"node": node, "state": "running", "steps": int(steps)}, workflow)
        try:
            result, stats = self._sample(model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                         latent_image, denoise, cache, node)
        except comfy.model_management.InterruptProcessingException:
            send_run_event({"node": node, "state": "interrupted", **graph}, workflow)
            raise
        except BaseException as e:
            send_run_event({"node": node, "state": "failed", "error": f"{type(e).__name__}: {e}"[:ERROR_CHARS], **graph},
                           workflow)
            raise
        stats["workflow"] = workflow
        send_run_event({**stats, **graph}, workflow)
        return {"ui": {"sgld_stats": [stats]}, "result": (result,)}

    def _sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                denoise, cache, node):
        if isinstance(model, RemoteModel):  # SGLDiffusion Server: the run happens on that sgld server
            samples = latent_samples(latent_image, model.latent_channels)
            out, stats = sample_remote(NODE, model, latent_image, samples, conditioning_features("positive", positive),
                                       conditioning_features("negative", negative), seed=seed, steps=steps, cfg=cfg,
                                       sampler=sampler_name, scheduler=scheduler, denoise=denoise, cache=cache)
            stats.update(node=node, state="done")
            stats["warnings"] += conditioning_warnings("positive", positive) + conditioning_warnings("negative", negative)
            return dict(latent_image, samples=out.to(comfy.model_management.intermediate_device())), stats
        if not hasattr(model, "engine"):
            raise ValueError(f"{NODE}: 'model' must come from SGLDiffusion Model Loader (got {type(model).__name__})")
        try:
            engine = model.engine()
        except (CheckpointError, ParallelConfigError, ParallelWorkerError) as e:
            raise ValueError(f"{NODE}: {e}") from None
        samples = latent_samples(latent_image, engine.model_config.in_channels)
        cond = conditioning_features("positive", positive)
        uncond = conditioning_features("negative", negative)
        warnings = conditioning_warnings("positive", positive) + conditioning_warnings("negative", negative)
        channels = samples.shape[1] if getattr(samples, "dim", lambda: 0)() >= 2 else 0
        reporter = StepReporter(int(steps), channels, engine.device)
        try:
            out = engine.sample(samples, cond, uncond, seed=seed, steps=steps, cfg=cfg, sampler=sampler_name,
                                scheduler=scheduler, denoise=denoise, callback=reporter,
                                cache=resolve_config(cache),  # the Cache-DiT node's, else SGLANG_CACHE_DIT_*
                                noise_mask=latent_image.get("noise_mask"), batch_index=latent_image.get("batch_index"))
        except (InputError, CacheConfigError, ParallelWorkerError) as e:  # ComfyUI shows the class: keep it plain
            raise ValueError(f"{NODE}: {e}") from None
        result = dict(latent_image)
        result["samples"] = out.to(comfy.model_management.intermediate_device())
        return result, run_stats(engine, node, warnings)
