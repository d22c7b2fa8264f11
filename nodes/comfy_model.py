"""ComfyUI's MODEL on an SGLDiffusion engine, so every ComfyUI sampler runs on it.

The Model Loader's ``comfy_model`` output is a ``ModelPatcher`` around a ComfyUI model object (ComfyUI's own
ERNIE-Image class where this ComfyUI has one, else the same settings on ``BaseModel``) whose diffusion model
calls the engine. ComfyUI's sampler loop does the sampling; the engine does each DiT call (Cache-DiT, offload,
LoRA, several GPUs included). Why each piece is so: docs/comfyui_model.md.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import tempfile
import threading
import uuid
from typing import Dict, List

import comfy.conds
import comfy.latent_formats
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import comfy.supported_models
import comfy.supported_models_base
import torch
from safetensors.torch import save

from ..engine import LoRAError
from ..engine.features.quant import estimate_bytes
from ..engine.io.atomic import atomic_write
from ..engine.io.load import checkpoint_shapes
from ..engine.models.demo import codec
from ..engine.sampling import DEFAULT_SHIFT, MULTIPLIER
from .model_cache import SGLDModel, drop_engine

log = logging.getLogger("sgldiffusion")

CACHE_OPTION = "sgld_cache"  # transformer_options key: the SGLD_CACHE of Apply Cache-DiT
RUN_OPTION = "sgld_run"  # transformer_options key: the id of the sampling run in progress (see _runs)
LORAS_ATTACHMENT = "sgld_loras"  # patcher attachment: ((path, strength), ...) of SGLDiffusion LoRA Loader
WRAPPER_KEY = "sgldiffusion"
LORA_FOLDER = os.path.join(tempfile.gettempdir(), "sgld-comfy-loras")  # ComfyUI LoRA patches as LoRA files

_runs: Dict[int, "ComfyRun"] = {}  # the runs in progress (transformer_options are copied; ids are not)
_run_ids = itertools.count(1)
_runs_lock = threading.Lock()


class DemoLatent(comfy.latent_formats.LatentFormat):
    """The demo model's 48-channel pixel latent (engine/models/demo/codec.py): previews show its pixels."""

    latent_channels = codec.LATENT_CHANNELS

    def __init__(self):
        self.latent_rgb_factors = codec.preview_rgb_factors()
        self.latent_rgb_factors_bias = [0.0, 0.0, 0.0]


def _config_class(demo: bool):
    native = getattr(comfy.supported_models, "ErnieImage", None)
    if native is not None and not demo:
        return native

    class ErnieImageSettings(comfy.supported_models_base.BASE):
        """ERNIE-Image's flow settings, for a ComfyUI without its own ERNIE-Image model (before 0.19)."""
        unet_config = {"image_model": "ernie"}
        unet_extra_config = {}
        sampling_settings = {"multiplier": MULTIPLIER, "shift": DEFAULT_SHIFT}
        latent_format = DemoLatent if demo else comfy.latent_formats.Flux2
        memory_usage_factor = 10.0
        supported_inference_dtypes = [torch.bfloat16, torch.float16, torch.float32]

    return ErnieImageSettings


class PaddedText(comfy.conds.CONDRegular):
    """Text features [B, T, C] that batch with other lengths by zero-padding; ``text_lens`` tells the DiT which
    tokens are real, so prompt and negative of different lengths share one call (plain CONDRegular, as ComfyUI
    0.19+'s native ERNIE-Image uses, runs them as separate calls; docs/comfyui_model.md)."""

    def can_concat(self, other):
        a, b = self.cond.shape, other.cond.shape
        return a[0] == b[0] and a[2:] == b[2:] and self.cond.device == other.cond.device

    def concat(self, others):
        conds = [self.cond] + [o.cond for o in others]
        longest = max(c.shape[1] for c in conds)
        return torch.cat([torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[1])) for c in conds])


def _model_class(base):
    class SGLDiffusionErnieImage(base):
        """ComfyUI's model object; its diffusion model is the engine (``EngineCall``)."""

        def extra_conds(self, **kwargs):
            out = super().extra_conds(**kwargs)
            text = kwargs.get("cross_attn")
            if text is not None:
                out["c_crossattn"] = PaddedText(text)
                out["text_lens"] = comfy.conds.CONDRegular(torch.full((text.shape[0],), text.shape[1], dtype=torch.long))
            return out

    return SGLDiffusionErnieImage


class EngineCall(torch.nn.Module):
    """The diffusion model ComfyUI calls: one engine DiT forward per call. It holds the engine's handle, not
    its weights (ComfyUI may free the engine; the next call reopens it)."""

    def __init__(self, handle: SGLDModel, engine):
        super().__init__()
        self.handle = handle
        self.dtype = engine.forward.dtype  # ComfyUI casts x and the text to it
        self.shapes = checkpoint_shapes(engine.model_config)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The checkpoint's names and shapes (on the meta device): what ComfyUI's LoRA loader matches keys to."""
        out = {} if destination is None else destination
        for name, shape in self.shapes.items():
            out[prefix + name] = torch.empty(shape, device="meta")
        return out

    def forward(self, x, timesteps, context=None, control=None, transformer_options=None, text_lens=None, **kwargs):
        options = transformer_options or {}
        sigma = options.get("sigmas")  # ComfyUI's sigma of this call (timesteps = sigma * 1000)
        if sigma is None or x.shape[0] % sigma.shape[0]:
            sigma = timesteps.float() / MULTIPLIER
        else:
            sigma = sigma.float().repeat(x.shape[0] // sigma.shape[0])
        if text_lens is None:
            text_lens = torch.full((x.shape[0],), context.shape[1], dtype=torch.long, device=x.device)
        order = options.get("cond_or_uncond") or [0]
        # ComfyUI batches [uncond, cond] (cond_or_uncond [1, 0]); the engine and its cache take cond first
        chunk = x.shape[0] // len(order)
        perm = torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in sorted(range(len(order)), key=lambda i: order[i])])
        inverse = torch.argsort(perm)
        args = (x[perm], sigma[perm], context[perm], text_lens[perm].to(torch.long))
        with _runs_lock:
            run = _runs.get(options.get(RUN_OPTION))
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

    def call(self, branches: int, x, sigma, text, lens):
        engine = self.engine
        if self.calls is None:
            self.branches = branches
            self.calls = engine.begin_run(self.sigmas, self.sampler, cfg_batched=branches == 2, cache=self.cache)
        if branches != self.branches:  # ComfyUI split the CFG batch (low memory): this call bypasses the cache
            self.split_calls += 1
            return engine.velocity(x, sigma, text, lens)
        return self.calls(x, sigma, text, lens)

    def finish(self) -> None:
        if self.calls is None:
            return
        engine = self.engine
        self.calls.finish()
        if self.split_calls:
            engine.last_run.warnings.append(f"ComfyUI split the CFG batch for {self.split_calls} model calls; "
                                            "Cache-DiT could not see those calls and computed them")
        summary = engine.last_run.to_dict()
        log.info("SGLDiffusion: %s, %d/%d model calls computed%s", os.path.basename(engine.source), summary["calls_computed"],
                 summary["model_calls"], f", Cache-DiT {summary['step_mask']}" if engine.last_run.cache else "")


def outer_sample(executor, noise, latent_image, sampler, sigmas, *args, **kwargs):
    """ComfyUI's OUTER_SAMPLE wrapper: register the run (sigmas, sampler, the Apply Cache-DiT settings) for the
    diffusion model's calls, and close it afterwards, whatever happens."""
    guider = executor.class_obj
    options = guider.model_options.setdefault("transformer_options", {})
    name = getattr(getattr(sampler, "sampler_function", None), "__name__", "")
    run = ComfyRun(guider.model_patcher.sgld_engine(), sigmas, name[len("sample_"):] if name.startswith("sample_") else name,
                   options.get(CACHE_OPTION))
    with _runs_lock:
        run_id = next(_run_ids)
        _runs[run_id] = run
    options[RUN_OPTION] = run_id
    try:
        return executor(noise, latent_image, sampler, sigmas, *args, **kwargs)
    finally:
        options.pop(RUN_OPTION, None)
        with _runs_lock:
            _runs.pop(run_id, None)
        run.finish()


class SGLDModelPatcher(comfy.model_patcher.ModelPatcher):
    """ComfyUI's handle on the engine: the model's real size, the engine opened (with this clone's LoRAs) when
    ComfyUI loads it, and released when ComfyUI unloads it (``/free``, other models needing room)."""

    def sgld_handle(self) -> SGLDModel:
        handle = self.model.diffusion_model.handle
        if getattr(self, "lora_files_of", None) != self.patches_uuid:  # ComfyUI's patches written once per set
            self.lora_files, self.lora_files_of = tuple(comfy_lora_files(self.patches)), self.patches_uuid
        loras = tuple(self.get_attachment(LORAS_ATTACHMENT) or ()) + self.lora_files
        return SGLDModel(handle.path, handle.config, handle.name, handle.owner, handle.loras + loras)

    def sgld_engine(self):
        return self.sgld_handle().engine()

    def with_loras(self, loras) -> "SGLDModelPatcher":
        """A clone with more LoRAs ((path, strength), ...), applied by the engine (one base in memory)."""
        patched = self.clone()
        patched.set_attachments(LORAS_ATTACHMENT, tuple(self.get_attachment(LORAS_ATTACHMENT) or ()) + tuple(loras))
        patched.patches_uuid = uuid.uuid4()  # ComfyUI reloads it (our load: the engine takes this clone's LoRAs)
        return patched

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        engine = self.sgld_engine()
        self.model.device = device_to if device_to is not None else self.load_device
        self.model.model_loaded_weight_memory = resident_bytes(engine, self.model_size())
        self.model.model_lowvram = False
        self.model.current_weight_patches_uuid = self.patches_uuid

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


def comfy_lora_files(patches: dict) -> List[tuple]:
    """ComfyUI's weight patches (LoraLoaderModelOnly) as LoRA files the engine applies its own way (merged, or
    a side path on FP8 / INT4, on every rank): one file per strength, named by its content."""
    groups: Dict[float, dict] = {}
    for key, entries in sorted(patches.items()):
        if not key.startswith("diffusion_model.") or not key.endswith(".weight"):
            raise LoRAError(f"ComfyUI patch on '{key}': only the diffusion model's weights can be patched")
        name = key[: -len(".weight")]
        for strength, adapter, strength_model, offset, function in entries:
            weights = getattr(adapter, "weights", None)
            if type(adapter).__name__ != "LoRAAdapter" or offset is not None or function is not None or strength_model != 1.0 \
                    or any(w is not None for w in weights[3:]):
                raise LoRAError(f"ComfyUI patch on '{key}' is a {type(adapter).__name__}: the engine applies plain LoRA "
                                "(up/down with alpha); use SGLDiffusion LoRA Loader for other files")
            up, down, alpha = weights[:3]
            group = groups.setdefault(float(strength), {})
            group[f"{name}.lora_B.weight"] = up.float().contiguous()
            group[f"{name}.lora_A.weight"] = down.float().contiguous()
            if alpha is not None:
                group[f"{name}.alpha"] = torch.tensor(float(alpha))
    return [(_lora_file(tensors), strength) for strength, tensors in groups.items()]


def _lora_file(tensors: dict) -> str:
    data = save(tensors)
    path = os.path.join(LORA_FOLDER, hashlib.sha256(data).hexdigest()[:32] + ".safetensors")
    if not os.path.exists(path):
        os.makedirs(LORA_FOLDER, exist_ok=True)
        with atomic_write(path) as f:
            f.write(data)
    return path


def comfy_model(handle: SGLDModel, engine) -> SGLDModelPatcher:
    """The MODEL for ``handle`` (``engine``: its engine, already open)."""
    demo = engine.model_config.in_channels == codec.LATENT_CHANNELS
    settings = _config_class(demo)({"image_model": "ernie", "disable_unet_model_creation": True})
    call = EngineCall(handle, engine)
    settings.set_inference_dtype(call.dtype, None)
    base = getattr(comfy.model_base, "ErnieImage", comfy.model_base.BaseModel)
    model = _model_class(base)(settings, comfy.model_base.ModelType.FLOW, None)
    model.diffusion_model = call
    device = torch.device(handle.config.device)
    size = estimate_bytes(handle.path, handle.config.dtype, handle.config.quant)
    patcher = SGLDModelPatcher(model, device, comfy.model_management.unet_offload_device(), size=size,
                               weight_inplace_update=True)
    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample)
    return patcher


class SGLDiffusionApplyCacheDiT:
    """MODEL + SGLD_CACHE -> MODEL: any ComfyUI sampler on our MODEL runs with Cache-DiT."""

    CATEGORY = "sampling/SGLDiffusion"
    RETURN_TYPES = ("MODEL",)
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
