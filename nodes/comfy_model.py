"""ComfyUI's MODEL on an SGLDiffusion engine, so every ComfyUI sampler runs on it.

The Model Loader's ``comfy_model`` output is a ``ModelPatcher`` around a ComfyUI model object (ComfyUI's own
class of the model's family, ``Family.comfy_model``, where this ComfyUI has one, else the same settings on
``BaseModel``) whose diffusion model
calls the engine. ComfyUI's sampler loop does the sampling; the engine does each DiT call (Cache-DiT, offload,
LoRA, several GPUs included). Why each piece is so: docs/comfyui_model.md.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from typing import Dict

import comfy.conds
import comfy.hooks
import comfy.latent_formats
import comfy.lora
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import comfy.supported_models
import comfy.supported_models_base
import torch

from ..engine import InputError
from ..engine.features.cache import CacheConfigError, resolve_config
from ..engine.inputs import check_latent, check_model_call, check_run_sigmas, check_values
from ..engine.loading import checkpoint_shapes, estimate_bytes
from ..engine.models import family_of
from ..engine.models.bundle import bundle_of_config
from ..engine.sampling import MULTIPLIER
from ..engine.threads import torch_threads
from . import compat
from .comfy_lora import SOURCES_ATTACHMENT, check_native_keys, comfy_loras, executing_node, source_label
from .comfy_settings import PaddedText, TextLengths, settings_class
from .model_cache import SGLDModel, drop_engine, find_engine
from .run_events import ERROR_CHARS, GRAPH_KEY, graph_fingerprint, run_stats, send_run_event, workflow_id

log = logging.getLogger("sgldiffusion")

CACHE_OPTION = "sgld_cache"  # transformer_options key: the SGLD_CACHE of Apply Cache-DiT
RUN_OPTION = "sgld_run"  # transformer_options key: the id of the sampling run in progress (see _runs)
LORAS_ATTACHMENT = "sgld_loras"  # patcher attachment: ((path, strength), ...) of SGLDiffusion LoRA Loader
WRAPPER_KEY = "sgldiffusion"
# ComfyUI with a host-memory pin budget (dynamic VRAM, 2026): it counts a non-dynamic patcher's whole size as host
# memory to pin, evicting other models' pins; the engine pins nothing of ComfyUI's (docs/comfyui_model.md, "Memory")
PIN_BUDGET = hasattr(comfy.model_management, "ensure_pin_budget")
UNSUPPORTED = ("SGLDiffusion comfy_model: {what} is not supported: the weights live in the SGLDiffusion engine, not in "
               "ComfyUI's model object; {instead}")

BRANCHES = {0: "positive", 1: "negative"}  # ComfyUI's cond_or_uncond values
_runs: Dict[int, "ComfyRun"] = {}  # the runs in progress (transformer_options are copied; ids are not)
_run_ids = itertools.count(1)
_runs_lock = threading.Lock()


def _model_class(base):
    class SGLDiffusionModel(base):
        """ComfyUI's model object; its diffusion model is the engine (``EngineCall``)."""

        def state_dict_for_saving(self, *args, **kwargs):
            raise ValueError(UNSUPPORTED.format(what="saving the model (ModelSave, CheckpointSave)",
                                                instead=f"its weights are the file {self.diffusion_model.handle.path}"))

        def extra_conds(self, **kwargs):
            out = super().extra_conds(**kwargs)
            text = kwargs.get("cross_attn")
            if text is not None:
                out["c_crossattn"] = PaddedText(text)
                out["text_lens"] = TextLengths(torch.full((text.shape[0],), text.shape[1], dtype=torch.long))
            return out

    return SGLDiffusionModel


def checked(check, *args):
    """An engine input check on the MODEL path: its InputError / CacheConfigError as a plain ValueError (ComfyUI
    shows the class); else what the check returns."""
    try:
        return check(*args)
    except (InputError, CacheConfigError) as e:
        raise ValueError(f"SGLDiffusion comfy_model: {e}") from None


class EngineCall(torch.nn.Module):
    """The diffusion model ComfyUI calls: one engine DiT forward per call. It holds the engine's handle, not
    its weights (ComfyUI may free the engine; the next call reopens it)."""

    def __init__(self, handle: SGLDModel, engine):
        super().__init__()
        self.handle = handle
        self.dtype = engine.runner.dtype  # ComfyUI casts x and the text to it
        self.model_config = engine.model_config  # what the input checks check against
        self.shapes = checkpoint_shapes(engine.model_config)
        self.multiplier = MULTIPLIER  # ComfyUI's timestep per sigma for the family (its sampling_settings)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The checkpoint's names and shapes (on the meta device): what ComfyUI's LoRA loader matches keys to."""
        out = {} if destination is None else destination
        for name, shape in self.shapes.items():
            out[prefix + name] = torch.empty(shape, device="meta")
        return out

    def forward(self, x, timesteps, context=None, control=None, transformer_options=None, text_lens=None, **kwargs):
        options = transformer_options or {}
        sigma = options.get("sigmas")  # ComfyUI's sigma of this call (timesteps = to_timestep(sigma))
        if sigma is None or x.shape[0] % sigma.shape[0]:
            sigma = timesteps.float() / self.multiplier
        else:
            sigma = sigma.float().repeat(x.shape[0] // sigma.shape[0])
        # the lengths on the host (TextLengths; the text's own length without them): the engine decides "is
        # anything padded" from them without a device sync
        if text_lens is None:
            text_lens = torch.full((x.shape[0],), context.shape[1], dtype=torch.long)
        else:
            text_lens = torch.as_tensor(text_lens, dtype=torch.long)
        order = options.get("cond_or_uncond") or [0]
        with _runs_lock:
            run = _runs.get(options.get(RUN_OPTION))
        # shapes at every call; values at a run's first call of each branch order (the sampler's later latents
        # come from the model, whose output the engine checks), or at every call outside a registered run
        first = run is None or tuple(order) not in run.values_checked
        checked(check_model_call, self.model_config, x, context, [BRANCHES.get(o, "conditioning") for o in order], first)
        if run is not None:
            run.values_checked.add(tuple(order))
        # ComfyUI batches [uncond, cond] (cond_or_uncond [1, 0]); the engine and its cache take cond first
        chunk = x.shape[0] // len(order)
        perm = torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in sorted(range(len(order)), key=lambda i: order[i])])
        inverse = torch.argsort(perm)
        args = (x[perm], sigma[perm], context[perm], text_lens[perm])
        v = run.call(len(set(order)), *args) if run is not None else self.handle.engine().velocity(*args)
        return v[inverse]  # float32: ComfyUI takes x - v * sigma in float32


class ComfyRun:
    """One ComfyUI sampling run on our MODEL: the engine's model calls (the cache counts them from the sigmas
    and the sampler), opened at the first call, when the number of CFG branches per call is known. ``engine``:
    the running clone's (its LoRAs active)."""

    def __init__(self, engine, sigmas, sampler: str, cache):
        self.engine = engine
        self.sigmas, self.sampler, self.cache = sigmas.detach().float().cpu(), sampler, cache
        self.calls = None
        self.branches = 0
        self.split_calls = 0
        self.values_checked = set()  # the branch orders (cond_or_uncond) whose inputs' values were checked

    def call(self, branches: int, x, sigma, text, lens):
        engine = self.engine
        if self.calls is None:
            self.branches = branches
            moved = engine.make_room(x.shape, text.shape[1])
            self.calls = engine.begin_run(self.sigmas, self.sampler, cfg_batched=branches == 2, cache=self.cache)
            engine.last_run.threads = torch.get_num_threads()
            if moved:
                engine.last_run.warnings.append(moved)
        if branches != self.branches:  # ComfyUI split the CFG batch (low memory): this call bypasses the cache
            self.split_calls += 1
            return engine.velocity(x, sigma, text, lens)
        return self.calls(x, sigma, text, lens)

    def finish(self) -> bool:
        """Close the engine's run and log it (its warnings too); False when no model call was made."""
        if self.calls is None:
            return False
        engine, stats = self.engine, self.engine.last_run
        self.calls.finish()
        if not stats.model_calls:  # a sampler the engine does not count: the calls it made
            stats.model_calls = len(stats.step_mask)
        if self.split_calls:
            stats.warnings.append(f"ComfyUI split the CFG batch for {self.split_calls} model calls; "
                                  "Cache-DiT could not see those calls and computed them")
        summary = stats.to_dict()
        for warning in summary["warnings"]:
            log.warning("SGLDiffusion: %s", warning)
        log.info("SGLDiffusion: %s, %d/%d model calls computed%s", os.path.basename(engine.source), summary["calls_computed"],
                 summary["model_calls"], f", Cache-DiT {summary['step_mask']}" if stats.cache else "")
        return True


def outer_sample(executor, noise, latent_image, sampler, sigmas, *args, **kwargs):
    """ComfyUI's OUTER_SAMPLE wrapper: check the inputs, register the run (sigmas, sampler, the Apply Cache-DiT
    settings) for the diffusion model's calls, close it afterwards whatever happens, and report it as SGLDiffusion
    KSampler does (run events for the web panel, the node's last run, the log), under the sampler node's id."""
    node, _, _, extra, prompt = executing_node()
    workflow = workflow_id(extra.get("extra_pnginfo"))
    graph = {GRAPH_KEY: graph_fingerprint(prompt, node)}
    send_run_event({"node": node, "state": "running", "steps": max(len(sigmas) - 1, 0)}, workflow)
    try:
        result = _sample(executor, noise, latent_image, sampler, sigmas, args, kwargs)
    except comfy.model_management.InterruptProcessingException:
        send_run_event({"node": node, "state": "interrupted", **graph}, workflow)
        raise
    except BaseException as e:
        send_run_event({"node": node, "state": "failed", "error": f"{type(e).__name__}: {e}"[:ERROR_CHARS], **graph}, workflow)
        raise
    out, engine, ran = result
    if ran:
        send_run_event({**run_stats(engine, node), **graph}, workflow)
    return out


def _sample(executor, noise, latent_image, sampler, sigmas, args, kwargs):
    """The run of outer_sample: (its output, the engine, whether a model call was made)."""
    guider = executor.class_obj
    call = guider.model_patcher.model.diffusion_model
    checked(check_latent, call.model_config, latent_image)  # before ComfyUI's own code meets a wrong latent
    checked(check_latent, call.model_config, noise, "noise")
    checked(check_run_sigmas, sigmas)
    mask = args[0] if args else kwargs.get("denoise_mask")  # the LATENT's noise_mask, any shape ComfyUI takes
    if isinstance(mask, torch.Tensor):
        checked(check_values, "noise_mask", mask, "; it takes values from 0 (keep) to 1 (repaint)")
    options = guider.model_options.setdefault("transformer_options", {})
    name = getattr(getattr(sampler, "sampler_function", None), "__name__", "")
    run = ComfyRun(guider.model_patcher.sgld_engine(), sigmas, name[len("sample_"):] if name.startswith("sample_") else name,
                   checked(resolve_config, options.get(CACHE_OPTION)))  # Apply Cache-DiT's, else SGLANG_CACHE_DIT_*
    with _runs_lock:
        run_id = next(_run_ids)
        _runs[run_id] = run
    options[RUN_OPTION] = run_id
    try:
        with torch_threads(run.engine.threads):  # the demo's 1 CPU thread, as in SGLDiffusion KSampler
            out = executor(noise, latent_image, sampler, sigmas, *args, **kwargs)
    finally:
        options.pop(RUN_OPTION, None)
        with _runs_lock:
            _runs.pop(run_id, None)
        ran = run.finish()
    return out, run.engine, ran


class SGLDModelPatcher(comfy.model_patcher.ModelPatcher):
    """ComfyUI's handle on the engine: the model's real size, the engine opened (with this clone's LoRAs) when
    ComfyUI loads it, and released when ComfyUI unloads it (``/free``, other models needing room)."""

    def sgld_handle(self) -> SGLDModel:
        handle = self.model.diffusion_model.handle
        if getattr(self, "comfy_loras_of", None) != self.patches_uuid:  # ComfyUI's patches converted once per set
            sources = self.get_attachment(SOURCES_ATTACHMENT) or ()
            key_map = comfy.lora.model_lora_keys_unet(self.model, {}) if self.patches else {}
            self.comfy_loras, self.comfy_loras_of = tuple(comfy_loras(self.patches, sources, key_map)), self.patches_uuid
        loras = tuple(self.get_attachment(LORAS_ATTACHMENT) or ()) + self.comfy_loras
        return SGLDModel(handle.path, handle.config, handle.name, handle.owner, handle.loras + loras)

    def sgld_engine(self):
        return self.sgld_handle().engine()

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        """ComfyUI's LoRA loaders add their patches here: remember which node and file they came from (messages
        name them), and refuse a file whose keys this ComfyUI cannot map (it would only log "lora key not loaded")."""
        node_id, class_type, inputs, _, _ = executing_node()
        check_native_keys(inputs.get("lora_name"), patches, self.model.sgld_native)
        added = super().add_patches(patches, strength_patch, strength_model)
        ids = frozenset(id(patches[k]) for k in added)
        self.set_attachments(SOURCES_ATTACHMENT, tuple(self.get_attachment(SOURCES_ATTACHMENT) or ())
                             + ((source_label(node_id, class_type, inputs), ids),))
        return added

    def with_loras(self, loras) -> "SGLDModelPatcher":
        """A clone with more LoRAs ((path, strength), ...), applied by the engine (one base in memory)."""
        patched = self.clone()
        patched.set_attachments(LORAS_ATTACHMENT, tuple(self.get_attachment(LORAS_ATTACHMENT) or ()) + tuple(loras))
        patched.patches_uuid = uuid.uuid4()  # ComfyUI reloads it (our load: the engine takes this clone's LoRAs)
        return patched

    def held_bytes(self):
        """Bytes the engine holds on ComfyUI's device now (None: not loaded). Read live, so an engine that
        SGLDiffusion KSampler or the loader opened is not counted as still to load."""
        engine = find_engine(self.model.diffusion_model.handle)
        return None if engine is None else resident_bytes(engine, self.model.sgld_rest_bytes)

    def model_size(self):
        """What ComfyUI would move or pin for this model: what the engine holds (the checkpoint's size at rest
        when it is not loaded); 0 under a pin budget, where ComfyUI would pin that much host memory."""
        if PIN_BUDGET:
            return 0
        held = self.held_bytes()
        return self.model.sgld_rest_bytes if held is None else held

    def loaded_size(self):
        held = None if PIN_BUDGET else self.held_bytes()
        return held or 0

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        self.sgld_engine()
        self.model.device = device_to if device_to is not None else self.load_device
        self.model.model_loaded_weight_memory = self.loaded_size()
        self.model.model_lowvram = False
        self.model.current_weight_patches_uuid = self.patches_uuid

    # ComfyUI paths that need weights in ComfyUI's model object: refused by name instead of a deep AttributeError
    def get_key_patches(self, filter_prefix=None):
        raise ValueError(UNSUPPORTED.format(what="reading its weights (model merging: ModelMergeSimple, ...)",
                                            instead="merge into the checkpoint file, or add LoRAs (LoraLoaderModelOnly)"))

    def patch_weight_to_device(self, key, *args, **kwargs):
        raise ValueError(UNSUPPORTED.format(what=f"patching or reading the weight '{key}' in ComfyUI (model saving, ...)",
                                            instead="LoRAs go to the engine (LoraLoaderModelOnly, SGLDiffusion LoRA Loader)"))

    def register_all_hook_patches(self, hooks, *args, **kwargs):
        if hooks is not None and hooks.get_type(comfy.hooks.EnumHookType.Weight):
            raise ValueError(UNSUPPORTED.format(what="a weight hook (Create Hook LoRA, SetClipHooks, ...)",
                                                instead="use LoraLoaderModelOnly or SGLDiffusion LoRA Loader"))
        return super().register_all_hook_patches(hooks, *args, **kwargs)

    def deepclone_multigpu(self, *args, **kwargs):
        raise ValueError(UNSUPPORTED.format(what="ComfyUI's multi-GPU cloning", instead="the engine runs on several GPUs "
                                            "itself: set num_gpus on SGLDiffusion Model Loader"))

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        return 0  # the engine is loaded whole or not at all: ComfyUI then unloads it (detach)

    def detach(self, unpatch_all=True):
        model = super().detach(unpatch_all)
        if unpatch_all:
            drop_engine(self.model.diffusion_model.handle, "ComfyUI unloaded the model")
        return model


def resident_bytes(engine, total: int) -> int:
    """Bytes the engine holds on its device: the resident blocks under offload, nothing when ranks hold it."""
    described = engine.describe()
    if described["parallel"] is not None:
        return 0
    offload = described["offload"]
    return int(offload["resident_mib"] * 2 ** 20) if offload else total


class ComfyModelUnavailableError(AttributeError):
    """What using a ComfyModelUnavailable raises (an AttributeError: ``hasattr`` checks stay False)."""


class ComfyModelUnavailable:
    """The comfy_model output where this ComfyUI cannot make it (no latent format of the family): any use raises
    ``message``, so only a graph that uses the output fails, on the node that uses it."""

    def __init__(self, message: str):
        object.__setattr__(self, "_message", message)

    def __getattr__(self, name):
        raise ComfyModelUnavailableError(object.__getattribute__(self, "_message"))


def comfy_model(handle: SGLDModel, engine):
    """The MODEL for ``handle`` (``engine``: its engine, already open); a ``ComfyModelUnavailable`` where this ComfyUI
    lacks what the family's MODEL needs (SGLD_MODEL works without it)."""
    family = family_of(engine.model_config)
    bundle = bundle_of_config(engine.model_config)  # the demo: its own latent
    latent_format = family.latent.comfy_format
    if bundle is None and getattr(comfy.latent_formats, latent_format, None) is None:
        text = (f"SGLDiffusion Model Loader: its comfy_model output does not work in this ComfyUI, which lacks "
                f"the {latent_format} latent format (comfy.latent_formats.{latent_format}): update to {compat.UPDATE}. "
                "Connect the 'model' output to SGLDiffusion KSampler instead.")
        log.warning("%s", text)
        return ComfyModelUnavailable(text)
    settings = settings_class(family, bundle)({**family.comfy_unet_config, "disable_unet_model_creation": True})
    call = EngineCall(handle, engine)
    call.multiplier = float(settings.sampling_settings.get("multiplier", MULTIPLIER))  # Z-Image's ComfyUI: 1
    settings.set_inference_dtype(call.dtype, None)
    native = getattr(comfy.model_base, family.comfy_model, None) if family.comfy_model else None
    model = _model_class(native or comfy.model_base.BaseModel)(settings, comfy.model_base.ModelType.FLOW, None)
    model.sgld_native = native is not None  # ComfyUI has its own model of the family (its LoRA key maps)
    model.diffusion_model = call
    device = torch.device(handle.config.device)
    size = estimate_bytes(handle.path, handle.config.dtype, handle.config.quant)
    model.sgld_rest_bytes = size
    patcher = SGLDModelPatcher(model, device, comfy.model_management.unet_offload_device(), size=size,
                               weight_inplace_update=True)
    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample)
    return patcher


class SGLDiffusionApplyCacheDiT:
    """MODEL + SGLD_CACHE -> MODEL: any ComfyUI sampler on our MODEL runs with Cache-DiT."""

    CATEGORY = "SGLDiffusion"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model; ComfyUI's samplers on it run with this Cache-DiT setting.",)
    FUNCTION = "apply"
    DESCRIPTION = ("Cache-DiT for any sampler on the SGLDiffusion Model Loader's comfy_model output. The step index "
                   "and total come from the sampler's sigmas; euler, euler_ancestral, heun and dpmpp_2m are counted.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL", {"tooltip": "The comfy_model output of SGLDiffusion Model Loader."}),
                             "cache": ("SGLD_CACHE", {"tooltip": "From SGLDiffusion Cache-DiT."})}}

    def apply(self, model, cache):
        if not isinstance(model, SGLDModelPatcher):
            raise ValueError("SGLDiffusion Apply Cache-DiT: 'model' must be the comfy_model output of SGLDiffusion "
                             f"Model Loader (got {type(getattr(model, 'model', model)).__name__})")
        patched = model.clone()
        patched.model_options.setdefault("transformer_options", {})[CACHE_OPTION] = cache
        return (patched,)
