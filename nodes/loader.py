"""SGLDiffusion Model Loader: a diffusion-model file + engine options -> SGLD_MODEL."""
from __future__ import annotations

import logging
import os

import folder_paths

from ..engine import CheckpointError, EngineConfig
from ..engine.models.demo import DEMO_WEIGHTS
from ..engine.parallel import ParallelConfigError, ParallelWorkerError
from .demo import DEMO_CHOICE
from .model_cache import SGLDModel, get_engine

FOLDER = "diffusion_models"  # ComfyUI maps the legacy "unet" folder into this one
log = logging.getLogger("sgldiffusion")
WEIGHT_DTYPES = ["default", "bf16", "fp16", "fp32"]
COMPILE = ["off", "static", "dynamic"]
QUANT = ["none", "fp8", "int4", "int4-g64"]
OFFLOAD = ["auto", "none", "layerwise"]


def model_folders() -> list:
    names = [FOLDER] + (["unet"] if "unet" in folder_paths.folder_names_and_paths and "unet" != FOLDER else [])
    out = []
    for name in names:
        for p in folder_paths.get_folder_paths(name):
            if p not in out:
                out.append(p)
    return out


def model_files() -> list:
    """The embedded demo model first, then the files of models/diffusion_models and models/unet."""
    files = list(folder_paths.get_filename_list(FOLDER))
    if "unet" in folder_paths.folder_names_and_paths:
        files += [f for f in folder_paths.get_filename_list("unet") if f not in files]
    return [DEMO_CHOICE] + sorted(files)


def resolve(name: str) -> str:
    if name == DEMO_CHOICE:
        return DEMO_WEIGHTS
    path = folder_paths.get_full_path(FOLDER, name)
    if path is None and "unet" in folder_paths.folder_names_and_paths:
        path = folder_paths.get_full_path("unet", name)
    if path is None or not os.path.exists(path):
        raise ValueError(
            f"SGLDiffusion Model Loader: model file '{name}' was not found in {', '.join(model_folders())}. "
            "Put the ERNIE-Image diffusion model (e.g. ernie-image-turbo.safetensors) in ComfyUI/models/diffusion_models "
            "and press R in the UI to refresh the list."
        )
    return path


def torch_device() -> str:
    import comfy.model_management as mm

    return str(mm.get_torch_device())


def attention_choices() -> list:
    """'auto' and the backends that can run on ComfyUI's device (others would fall back to sdpa)."""
    try:
        from ..engine.features.attention import available_backends

        return ["auto"] + [b for b in available_backends(torch_device()) if b != "auto"]
    except Exception:
        return ["auto", "sdpa"]


class SGLDiffusionModelLoader:
    DESCRIPTION = ("Loads an ERNIE-Image diffusion model (.safetensors from models/diffusion_models) into the "
                   "SGLDiffusion engine. The model stays loaded between runs until the inputs change or ComfyUI frees memory.")
    CATEGORY = "SGLDiffusion"
    RETURN_TYPES = ("SGLD_MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("The loaded model, for SGLDiffusion KSampler.",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "unet_name": (model_files(), {"tooltip": "The diffusion model file (models/diffusion_models or models/unet)."}),
                "weight_dtype": (WEIGHT_DTYPES, {"default": "default",
                                                 "tooltip": "Weight dtype in memory; 'default' keeps the file's dtype."}),
            },
            "optional": {
                "attention": (attention_choices(), {"default": "auto", "tooltip": (
                    "Attention backend. auto: SageAttention, then FlashAttention, then PyTorch SDPA, whichever runs "
                    "here. Only backends that work on this machine are listed.")}),
                "compile": (COMPILE, {"default": "off", "tooltip": (
                    "torch.compile of the transformer block. static: one graph per resolution; dynamic: one extra "
                    "graph for all new resolutions. The first run at a size is slower.")}),
                "quant": (QUANT, {"default": "none", "tooltip": (
                    "Weight-only quantization of the transformer blocks' linear layers (fp8, or int4 in groups of "
                    "128 / 64). Pre-quantized files load quantized whatever this says.")}),
                "offload": (OFFLOAD, {"default": "auto", "tooltip": (
                    "Layer-wise offload: transformer blocks stay in CPU memory and stream through a few GPU buffers. "
                    "auto: only when the GPU has too little free memory for the whole model.")}),
                "resident_layers": ("INT", {"default": 2, "min": 1, "max": 64, "tooltip": (
                    "GPU layer buffers used by offload; more = faster, more VRAM.")}),
                "num_gpus": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": (
                    "GPUs working on one image (one worker process each). 1: this process only. The degrees below "
                    "must multiply to it; with all of them at 1, N GPUs means Ulysses over N.")}),
                "ulysses_degree": ("INT", {"default": 1, "min": 1, "max": 32, "tooltip": (
                    "Ulysses sequence parallel: attention heads split over this many GPUs (all-to-all).")}),
                "ring_degree": ("INT", {"default": 1, "min": 1, "max": 8, "tooltip": (
                    "Ring sequence parallel: keys/values passed around this many GPUs.")}),
                "tp": ("INT", {"default": 1, "min": 1, "max": 8, "tooltip": (
                    "Tensor parallel: each block's weights sharded over this many GPUs.")}),
                "cfg_parallel": ("BOOLEAN", {"default": False, "tooltip": (
                    "Run the positive and negative prompt on different GPUs (needs cfg > 1).")}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, unet_name, attention="auto"):
        # Naming these two here turns off ComfyUI's "value not in list" check for them: a model name
        # that is not (yet) in the folder gets load()'s message that says where to put the file, and an
        # attention backend this machine lacks (a workflow made elsewhere) falls back to sdpa with a
        # warning. A message returned here would be listed under every input named in this signature
        # (ComfyUI 0.3.75's execution.validate_inputs), so load() refuses an unknown backend instead.
        return True

    @classmethod
    def IS_CHANGED(cls, unet_name, **kwargs):
        try:
            st = os.stat(resolve(unet_name))
            return f"{st.st_mtime_ns}:{st.st_size}"
        except Exception:
            return float("nan")  # never equal: run load() and let it report the problem

    def load(self, unet_name, weight_dtype="default", attention="auto", compile="off", quant="none",
             offload="auto", resident_layers=2, num_gpus=1, ulysses_degree=1, ring_degree=1, tp=1,
             cfg_parallel=False, unique_id=None):
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"SGLDiffusion Model Loader: weight_dtype '{weight_dtype}' is not one of {', '.join(WEIGHT_DTYPES)}")
        from ..engine.features.attention import BACKENDS

        if attention not in BACKENDS:
            raise ValueError(f"SGLDiffusion Model Loader: attention '{attention}' is not one of {', '.join(BACKENDS)}")
        path = resolve(unet_name)
        try:
            # the demo file is stored in fp16; its default is fp32, as the engine and CLI run it on a CPU
            default = "fp32" if unet_name == DEMO_CHOICE else None
            config = EngineConfig(dtype=default if weight_dtype == "default" else weight_dtype, device=torch_device(),
                                  attention=attention, compile=False if compile == "off" else compile,
                                  quant=None if quant == "none" else quant, offload=offload,
                                  resident_layers=int(resident_layers), num_gpus=int(num_gpus),
                                  ulysses_degree=int(ulysses_degree), ring_degree=int(ring_degree), tp=int(tp),
                                  cfg_parallel=bool(cfg_parallel))
        except ValueError as e:
            raise ValueError(f"SGLDiffusion Model Loader: {e}") from None
        handle = SGLDModel(path, config, name=unet_name, owner=str(unique_id) if unique_id is not None else None)
        try:
            engine = get_engine(handle)  # load now, so a bad file is reported on this node
        except (CheckpointError, ParallelConfigError, ParallelWorkerError) as e:
            # a ValueError: ComfyUI shows the exception's class with its module path (the pack's folder)
            raise ValueError(f"SGLDiffusion Model Loader: {e}") from None
        for w in engine.warnings:
            log.warning("SGLDiffusion Model Loader: %s", w)
        return (handle,)
