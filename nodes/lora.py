"""SGLDiffusion LoRA Loader: a model of SGLDiffusion Model Loader (either output) + a LoRA file from ComfyUI's
``loras`` folder + strength -> both outputs again, typed as the loader's (``model`` SGLD_MODEL for SGLDiffusion
KSampler, ``comfy_model`` MODEL for any sampler), so ComfyUI refuses a wrong link when the graph is drawn and
when it is queued, not a run later.

Chainable (each node adds one LoRA to the handle). On a model of SGLDiffusion Server the chain is sent with each
run: the server applies the LoRA of that name in its --lora-dir to that run only (no file goes over the wire;
the ``comfy_model`` output is empty: a remote model has no ComfyUI MODEL). The returned handle shares the base engine with
its input (nodes/model_cache.py): the LoRA set is part of the handle and the engine applies it
(``Engine.set_loras``, engine/features/lora) when a sampler asks the handle for its engine, so two graphs
using the same base with different LoRAs hold the base weights once.
"""
from __future__ import annotations

import logging
import math
import os

import folder_paths

from ..engine import CheckpointError
from .model_cache import SGLDModel, get_engine
from .server_nodes import RemoteModel

log = logging.getLogger("sgldiffusion")
FOLDER = "loras"
MODEL_TYPES = "SGLD_MODEL,MODEL"  # either output of the loader (or of another LoRA Loader)
NODE = "SGLDiffusion LoRA Loader"


def lora_files() -> list:
    return sorted(folder_paths.get_filename_list(FOLDER))


def resolve(name: str) -> str:
    path = folder_paths.get_full_path(FOLDER, name)
    if path is None or not os.path.exists(path):
        folders = ", ".join(folder_paths.get_folder_paths(FOLDER))
        raise ValueError(f"{NODE}: LoRA file '{name}' was not found in {folders}. Put the ERNIE-Image LoRA "
                         "(.safetensors) in ComfyUI/models/loras and press R in the UI to refresh the list.")
    return path


class SGLDiffusionLoraLoader:
    DESCRIPTION = ("Adds a LoRA to an SGLDiffusion model (chain several nodes to stack LoRAs). The base weights are "
                   "shared with the input model; the LoRA is merged before sampling and removed exactly when a graph "
                   "samples without it. Formats: diffusers/PEFT, ai-toolkit, kohya and the other forms ComfyUI reads.")
    CATEGORY = "SGLDiffusion"
    RETURN_TYPES = ("SGLD_MODEL", "MODEL")
    RETURN_NAMES = ("model", "comfy_model")
    OUTPUT_TOOLTIPS = ("The model with this LoRA added, for SGLDiffusion KSampler (or another LoRA Loader).",
                       "The same as ComfyUI's MODEL, for any sampler (KSampler, SamplerCustomAdvanced, ...).")
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPES, {"tooltip": "From SGLDiffusion Model Loader, SGLDiffusion Server (its server "
                                                   "applies the file of this name in its --lora-dir to each run) or "
                                                   "another SGLDiffusion LoRA Loader."}),
                "lora_name": (lora_files(), {"tooltip": "The LoRA file (models/loras), trained for ERNIE-Image."}),
                "strength": ("FLOAT", {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01,
                                       "tooltip": "How strongly the LoRA changes the model; 0 turns it off, negative inverts it."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, lora_name=None, **kwargs):
        return True  # a missing file is reported by load() with the folder to put it in

    @classmethod
    def IS_CHANGED(cls, lora_name, strength=1.0, **kwargs):
        try:
            st = os.stat(resolve(lora_name))
            return f"{st.st_mtime_ns}:{st.st_size}:{strength}"
        except Exception:
            return float("nan")

    def load(self, model, lora_name, strength=1.0):
        """``model``: SGLD_MODEL, or the loader's ComfyUI MODEL (comfy_model); both outputs carry the LoRA."""
        if not math.isfinite(float(strength)):
            raise ValueError(f"{NODE}: strength is {strength}; it must be a finite number (-100 to 100)")
        if isinstance(model, RemoteModel):  # the server applies it to this chain's runs only, by name in its --lora-dir
            return model.with_lora(lora_name, strength), None
        comfy = hasattr(model, "sgld_engine")  # the loader's comfy_model (nodes/comfy_model.py)
        if not comfy and not isinstance(model, SGLDModel):
            raise ValueError(f"{NODE}: 'model' must come from SGLDiffusion Model Loader (got {type(model).__name__})")
        path = resolve(lora_name)
        try:
            # read it now against the model (not applied yet), so a wrong file is reported on this node;
            # the engine's method: a multi-GPU engine reads it on its workers
            engine = model.sgld_engine() if comfy else get_engine(model)
            for msg in engine.check_lora(path):
                log.warning("%s: %s", NODE, msg)
        except CheckpointError as e:
            raise ValueError(f"{NODE}: {e}") from None
        if comfy:
            patched = model.with_loras([(path, float(strength))])
            return patched.sgld_handle(), patched
        from .comfy_model import comfy_model  # ComfyUI's model classes: only inside a running ComfyUI

        handle = model.with_lora(path, strength)
        return handle, comfy_model(handle, engine)
