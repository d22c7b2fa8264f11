"""SGLDiffusion LoRA Loader: SGLD_MODEL + a LoRA file from ComfyUI's ``loras`` folder + strength -> SGLD_MODEL.

Chainable (each node adds one LoRA to the handle). The returned handle shares the base engine with
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
from .model_cache import get_engine

log = logging.getLogger("sgldiffusion")
FOLDER = "loras"
MODEL_TYPES = "SGLD_MODEL,MODEL"  # either output of the loader; the result has the input's type
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
    RETURN_TYPES = (MODEL_TYPES,)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("The model with this LoRA added, of the input's type (SGLD_MODEL for SGLDiffusion KSampler, "
                       "MODEL for any sampler).",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPES, {"tooltip": "From SGLDiffusion Model Loader (either output) or another "
                                                   "SGLDiffusion LoRA Loader."}),
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
        """``model``: SGLD_MODEL, or the loader's ComfyUI MODEL (comfy_model); the result is of the same type."""
        comfy = hasattr(model, "sgld_engine")  # the loader's comfy_model (nodes/comfy_model.py)
        if not comfy and not hasattr(model, "with_lora"):
            raise ValueError(f"{NODE}: 'model' must come from SGLDiffusion Model Loader (got {type(model).__name__})")
        if not math.isfinite(float(strength)):
            raise ValueError(f"{NODE}: strength is {strength}; it must be a finite number (-100 to 100)")
        path = resolve(lora_name)
        try:
            # read it now against the model (not applied yet), so a wrong file is reported on this node;
            # the engine's method: a multi-GPU engine reads it on its workers
            for msg in (model.sgld_engine() if comfy else get_engine(model)).check_lora(path):
                log.warning("%s: %s", NODE, msg)
        except CheckpointError as e:
            raise ValueError(f"{NODE}: {e}") from None
        return (model.with_loras([(path, float(strength))]) if comfy else model.with_lora(path, strength),)
