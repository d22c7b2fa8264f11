"""SGLDiffusion KSampler: ComfyUI's KSampler widgets, sampling done by ``engine.Engine.sample``.

Only type adaptation happens here: CONDITIONING -> lists of text features, LATENT dict <-> tensor,
the engine's step callback -> ComfyUI's progress bar, preview and interrupt check, and the run's
statistics -> the web extension (web/sgldiffusion.js): the ``sgld_stats`` UI output of a finished run,
and the run events of nodes/run_events.py (which also keeps each node's last run).
"""
from __future__ import annotations

import dataclasses
import logging

import comfy.latent_formats
import comfy.model_management
import comfy.utils
import torch

from ..engine import CheckpointError, InputError
from ..engine.features.cache import CacheConfigError, resolve_config
from ..engine.inputs import latent_hint
from ..engine.models import families, family_of
from ..engine.options import node_inputs
from ..engine.parallel import ParallelConfigError, ParallelWorkerError
from ..engine.sampling_options import SampleRequest, SamplingOptions
from .demo import WARNINGS_KEY
from .run_events import ERROR_CHARS, GRAPH_KEY, graph_fingerprint, run_stats, send_run_event, workflow_id
from .server_nodes import RemoteModel, sample_remote

log = logging.getLogger("sgldiffusion")
NODE = "SGLDiffusion KSampler"
KSAMPLER_WIDGETS = ("seed", "steps", "cfg", "sampler_name", "scheduler", "denoise")  # ComfyUI's KSampler's, its order


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
                **{name: w[name] for name in KSAMPLER_WIDGETS[:-1]},
                "positive": ("CONDITIONING", {"tooltip": "What the image should show."}),
                "negative": ("CONDITIONING", {"tooltip": "What the image should not show (unused at cfg 1)."}),
                "latent_image": ("LATENT", {"tooltip": ("The latent to denoise (text-to-image: EmptyFlux2LatentImage for "
                                                        "ERNIE-Image, SGLDiffusion Demo Empty Latent for the demo model); "
                                                        "a noise mask (SetLatentNoiseMask) repaints only where it is 1.")}),
                "denoise": w["denoise"],
                **{name: spec for name, spec in w.items() if name not in KSAMPLER_WIDGETS},  # options it lacks
            },
            "optional": {
                "cache": ("SGLD_CACHE", {"tooltip": "Cache-DiT step caching options (SGLDiffusion Cache-DiT node)."}),
                **node_inputs(SamplingOptions)["optional"],
            },
            # the workflow's id and the graph key the node's last run for the web panel (/sgldiffusion/last_runs)
            "hidden": {"unique_id": "UNIQUE_ID", "extra_pnginfo": "EXTRA_PNGINFO", "prompt": "PROMPT"},
        }

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
               denoise=1.0, cache=None, unique_id=None, extra_pnginfo=None, prompt=None, **widgets):
        """``widgets``: the values of the sampling options' widgets KSampler has not (SamplingOptions')."""
        node = None if unique_id is None else str(unique_id)
        workflow = workflow_id(extra_pnginfo)
        graph = {GRAPH_KEY: graph_fingerprint(prompt, node)}
        # the browser clears this node's previous timeline now; a failure below never leaves it showing
        send_run_event({"node": node, "state": "running", "steps": int(steps)}, workflow)
        try:
            options = SamplingOptions.of_widgets({"seed": seed, "steps": steps, "cfg": cfg, "sampler_name": sampler_name,
                                                  "scheduler": scheduler, "denoise": denoise, **widgets})
            result, stats = self._sample(model, options, positive, negative, latent_image, cache, node)
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

    def _sample(self, model, options: SamplingOptions, positive, negative, latent_image, cache, node):
        remote = isinstance(model, RemoteModel)  # SGLDiffusion Server: the run happens on that sgld server
        if not remote and not hasattr(model, "engine"):
            raise ValueError(f"{NODE}: 'model' must come from SGLDiffusion Model Loader (got {type(model).__name__})")
        try:
            engine = None if remote else model.engine()
        except (CheckpointError, ParallelConfigError, ParallelWorkerError) as e:
            raise ValueError(f"{NODE}: {e}") from None
        samples = latent_samples(latent_image, model.latent_channels if remote else engine.model_config.in_channels)
        request = SampleRequest.from_options(samples, conditioning_features("positive", positive),
                                             conditioning_features("negative", negative), options,
                                             noise_mask=latent_image.get("noise_mask"),
                                             batch_index=latent_image.get("batch_index"))
        warnings = conditioning_warnings("positive", positive) + conditioning_warnings("negative", negative)
        if remote:
            out, stats = sample_remote(NODE, model, dataclasses.replace(request, cache=cache))
            stats.update(node=node, state="done")
            stats["warnings"] += warnings
            return dict(latent_image, samples=out.to(comfy.model_management.intermediate_device())), stats
        channels = samples.shape[1] if getattr(samples, "dim", lambda: 0)() >= 2 else 0
        reporter = StepReporter(int(options.steps), channels, engine.device)
        latent = family_of(engine.model_config).latent  # ComfyUI's LATENT is the VAE's; the DiT has its own space
        if isinstance(samples, torch.Tensor):
            request = dataclasses.replace(request, latent=latent.process_in(request.latent))
        try:  # the Cache-DiT node's, else SGLANG_CACHE_DIT_*
            out = engine.sample_request(dataclasses.replace(request, cache=resolve_config(cache)), callback=reporter)
        except (InputError, CacheConfigError, ParallelWorkerError) as e:  # ComfyUI shows the class: keep it plain
            raise ValueError(f"{NODE}: {e}") from None
        result = dict(latent_image)
        result["samples"] = latent.process_out(out).to(comfy.model_management.intermediate_device())
        return result, run_stats(engine, node, warnings)
