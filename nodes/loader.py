"""SGLDiffusion Model Loader: a diffusion-model file + engine options -> SGLD_MODEL."""
from __future__ import annotations

import logging
import os

import folder_paths

from ..engine import CheckpointError, EngineConfig
from ..engine.features.attention import BACKENDS, available_backends
from ..engine.loading import weight_file_suffixes
from ..engine.options import from_widgets, node_inputs, widget_defaults
from ..engine.parallel import ParallelConfigError, ParallelWorkerError
from .demo import EMBEDDED
from .model_cache import SGLDModel, get_engine

NODE = "SGLDiffusion Model Loader"
FOLDER = "diffusion_models"  # ComfyUI maps the legacy "unet" folder into this one
# ComfyUI lists only its own extensions (.safetensors, ...) under diffusion_models: the files of the same folders
# (and of models/unet) that only this pack's readers take (.gguf) are listed under a folder name of this pack's,
# as ComfyUI-GGUF does with its own
OWN_FOLDER = "sgldiffusion_weights"
log = logging.getLogger("sgldiffusion")


def model_folders() -> list:
    names = [FOLDER] + (["unet"] if "unet" in folder_paths.folder_names_and_paths and "unet" != FOLDER else [])
    out = []
    for name in names:
        for p in folder_paths.get_folder_paths(name):
            if p not in out:
                out.append(p)
    return out


def own_suffixes() -> tuple:
    """The weight files the engine's readers take that ComfyUI does not list under diffusion_models (.gguf)."""
    listed = folder_paths.folder_names_and_paths.get(FOLDER, ((), set()))[1]
    return tuple(s for s in weight_file_suffixes() if s not in listed)


def _own_folder() -> str:
    """The pack's folder name for those files: the model folders as they are now, those suffixes only."""
    folder_paths.folder_names_and_paths[OWN_FOLDER] = (model_folders(), set(own_suffixes()))
    return OWN_FOLDER


def model_files() -> list:
    """The embedded demo model first, then the files of models/diffusion_models and models/unet (``own_suffixes``
    too)."""
    files = list(folder_paths.get_filename_list(FOLDER))
    if "unet" in folder_paths.folder_names_and_paths:
        files += [f for f in folder_paths.get_filename_list("unet") if f not in files]
    files += [f for f in folder_paths.get_filename_list(_own_folder()) if f not in files]
    return [name for name, path in EMBEDDED.items() if os.path.isfile(path)] + sorted(files)


def resolve(name: str) -> str:
    if name in EMBEDDED:
        return EMBEDDED[name]
    path = folder_paths.get_full_path(FOLDER, name)
    if path is None and "unet" in folder_paths.folder_names_and_paths:
        path = folder_paths.get_full_path("unet", name)
    if path is None and name.lower().endswith(own_suffixes()):
        path = folder_paths.get_full_path(_own_folder(), name)
    if path is None or not os.path.exists(path):
        raise ValueError(
            f"SGLDiffusion Model Loader: model file '{name}' was not found in {', '.join(model_folders())}. "
            f"Put the ERNIE-Image diffusion model (e.g. ernie-image-turbo.safetensors; files ending in "
            f"{' or '.join(weight_file_suffixes())}) in ComfyUI/models/diffusion_models "
            "and press R in the UI to refresh the list."
        )
    return path


def torch_device() -> str:
    import comfy.model_management as mm

    return str(mm.get_torch_device())


def attention_choices() -> list:
    """'auto' and the backends that can run on ComfyUI's device (others would fall back to sdpa)."""
    try:
        return ["auto"] + [b for b in available_backends(torch_device()) if b != "auto"]
    except Exception:
        return ["auto", "sdpa"]


def engine_config(unet_name: str, widgets: dict) -> EngineConfig:
    """The loader's inputs -> EngineConfig (an input a saved workflow does not have gets its default);
    a ValueError naming this node and the input on a bad value."""
    widgets = {**widget_defaults(EngineConfig), **widgets}
    if widgets["attention"] not in BACKENDS:  # ComfyUI's list check is off for it (VALIDATE_INPUTS)
        raise ValueError(f"{NODE}: attention '{widgets['attention']}' is not one of {', '.join(BACKENDS)}")
    given = from_widgets(EngineConfig, widgets, NODE)  # weight_dtype "default": the engine's rule for the device
    try:
        return EngineConfig(**given, device=torch_device())
    except ValueError as e:
        raise ValueError(f"{NODE}: {e}") from None


class SGLDiffusionModelLoader:
    DESCRIPTION = (f"Loads an ERNIE-Image diffusion model ({' or '.join(weight_file_suffixes())} from models/diffusion_models) "
                   "into the SGLDiffusion engine. The model stays loaded between runs until the inputs change or ComfyUI frees memory.")
    CATEGORY = "SGLDiffusion"
    RETURN_TYPES = ("SGLD_MODEL", "MODEL")
    RETURN_NAMES = ("model", "comfy_model")
    OUTPUT_TOOLTIPS = ("For SGLDiffusion KSampler and LoRA Loader.",
                       "ComfyUI's MODEL on the same engine: any sampler (KSampler, SamplerCustomAdvanced, ...); "
                       "SGLDiffusion Apply Cache-DiT adds the cache.")
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        """The engine's options as EngineConfig declares them (their widget names, defaults and tooltips);
        the attention list narrowed to the backends that run here."""
        inputs = node_inputs(EngineConfig)
        attention = inputs["optional"]["attention"]
        inputs["optional"]["attention"] = (attention_choices(), attention[1])
        unet = (model_files(), {"tooltip": "The diffusion model file (models/diffusion_models or models/unet)."})
        return {"required": {"unet_name": unet, **inputs["required"]}, "optional": inputs["optional"],
                "hidden": {"unique_id": "UNIQUE_ID"}}

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

    def load(self, unet_name, unique_id=None, **widgets):
        """``widgets``: the engine's options by their widget names."""
        config = engine_config(unet_name, widgets)
        path = resolve(unet_name)
        handle = SGLDModel(path, config, name=unet_name, owner=str(unique_id) if unique_id is not None else None)
        try:
            engine = get_engine(handle)  # load now, so a bad file is reported on this node
        except (CheckpointError, ParallelConfigError, ParallelWorkerError) as e:
            # a ValueError: ComfyUI shows the exception's class with its module path (the pack's folder)
            raise ValueError(f"{NODE}: {e}") from None
        for w in engine.warnings:
            log.warning("%s: %s", NODE, w)
        from .comfy_model import comfy_model  # ComfyUI's model classes: only inside a running ComfyUI

        return handle, comfy_model(handle, engine)
