"""LocalRunner: the DiT in this process, with the features its EngineConfig asks for attached in order.

Order matters: quantization first (what is fused, offloaded and compiled are the quantized bytes),
fused projections, layer-wise offload (before the fp8 fast-path probe and the attention choice,
which look at the compute device), then the attention backend and regional compile.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
from torch import nn

from . import device as device_rt
from .compute_dtype import with_compute_dtype
from .config import EngineConfig
from .features import attention as attention_backends
from .features import quant
from .features.cache import DBCacheRunner, apply_cache, remove_cache
from .features.compile import compile_blocks, is_compiled
from .features.fuse import fuse_projections, fused_groups
from .features.lora import LoRAFileCache, active_loras, apply_loras
from .features.offload import apply_layerwise_offload, choose_call_offload, choose_offload, get_offload
from .features.offload.auto import CALL_WORKSPACE_BYTES
from .io.checkpoint import open_checkpoint
from .loading import plan_load
from .models import family_of
from .sampling import to_timestep


class LocalRun:
    """One sampling run on a local model: the Cache-DiT runner (if any) attached as the "cache" patch."""

    def __init__(self, owner: "LocalRunner", plan, cfg_batched: bool):
        self.owner = owner
        self.runner = DBCacheRunner(plan, branches=2 if cfg_batched else 1) if plan is not None else None
        if self.runner is not None:
            apply_cache(owner.model, self.runner)

    def call(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, lens: torch.Tensor):
        """(velocity in float32 on x's device, whether the DiT was computed at this call)."""
        v = self.owner.velocity(x, sigma, text, lens)
        computed = bool(self.runner.computed[-1]) if self.runner is not None and self.runner.computed else True
        return v, computed

    def finish(self) -> Optional[dict]:
        """Put the model's own block runner back; the cache's summary of the run (None when off)."""
        if self.runner is None:
            return None
        remove_cache(self.owner.model)
        return self.runner.summary()


class LocalRunner:
    def __init__(self, model: nn.Module, config: Optional[EngineConfig] = None, offload_decision: Optional[tuple] = None):
        """Attach to ``model`` what ``config`` asks for. ``offload_decision``: ("none" | "layerwise", why) when the
        router decided before loading (an offloaded model is loaded into CPU memory)."""
        self.model = model
        self.config = config or EngineConfig()
        self.warnings: List[str] = []
        self.notes: List[str] = []
        self.lora_files = LoRAFileCache()  # LoRA files read against this model
        self._calls_that_fit = set()  # (x shape, text tokens) that offload "auto" found room for
        if self.config.quant:
            self.warnings += quant.apply_quant(model, self.config.quant).warnings
        fuse_projections(model)  # q/k/v and gate/up as one GEMM each (after quantization: rows concatenate exactly)
        fused, groups = fused_groups(model)
        self.notes.append(f"fused projections: {fused} of {groups} q/k/v and gate/up groups run as one GEMM each")
        self._apply_offload(offload_decision)
        offloader = get_offload(model)
        with offloader.hold(0) if offloader is not None else contextlib.nullcontext():
            self.notes += quant.prepare_fast_paths(model)  # probes on block 0's weights on the device
        choice = attention_backends.select_backend(self.config.attention, self.device, model.dtype, model.config.head_dim)
        self.warnings += choice.warnings
        attention_backends.apply_attention(model, choice)
        self.attention_backend = choice.name
        self.notes.append(choice.describe())
        if self.config.compile:
            self.warnings += compile_blocks(model, self.config.compile)

    def _apply_offload(self, decision: Optional[tuple]) -> None:
        mode = self.config.offload
        if mode == "none":
            return
        if decision is None:  # a model given in memory: decide from what it holds now
            dev = torch.device(self.config.device)
            on_dev = sum(t.numel() * t.element_size() for t in list(self.model.parameters()) + list(self.model.buffers())
                         if t.device == dev or (dev.type == "cuda" and t.is_cuda and dev.index is None))
            decision = choose_offload(mode, dev, quant.weight_bytes(self.model), resident_bytes=on_dev)
        choice, why = decision
        if why and mode == "auto":
            self.notes.append(why)
        if choice == "layerwise":
            offloader = apply_layerwise_offload(self.model, self.config.device, self.config.resident_layers)
            self.notes.append(offloader.summary())

    def make_room(self, x_shape, text_tokens: int) -> Optional[str]:
        """Before a call on ``x_shape`` [rows, C, h, w] with ``text_tokens``: offload "auto" kept the model resident
        at load, when the image size was unknown; a call whose activations (the family's estimate) would not fit
        beside it moves the blocks to host memory first (layer-wise offload, for good: as ComfyUI frees memory for
        a larger sampling run). Returns what it did (None: nothing to do). Between runs only: no run is attached."""
        if self.config.offload != "auto" or get_offload(self.model) is not None or self.device.type != "cuda":
            return None
        key = (tuple(int(n) for n in x_shape), int(text_tokens))
        if key in self._calls_that_fit:
            return None
        choice, why = choose_call_offload(self.device, self.activation_bytes(*key))
        if choice == "none":
            self._calls_that_fit.add(key)
            return None
        if is_compiled(self.model):  # offload would rebind the compiled blocks' weights: said, not done
            msg = (f"offload {why}: the compiled model stays resident (this call may run out of memory); "
                   "load it with offload 'layerwise' for images this size")
            self._calls_that_fit.add(key)
            self.warnings.append(msg)
            return msg
        loras = active_loras(self.model)  # merged into the resident weights: off while the blocks move, then on again
        apply_loras(self.model, [])
        try:
            offloader = apply_layerwise_offload(self.model, self.config.device, self.config.resident_layers)
        finally:
            apply_loras(self.model, loras)
        msg = f"offload {why}: switched to layer-wise offload ({offloader.summary()})"
        self.notes.append(msg)
        return msg

    def activation_bytes(self, x_shape, text_tokens: int) -> int:
        """The model family's estimate of a call's device bytes besides the weights (engine/models/family.py)."""
        return family_of(self.model).activation_bytes(self.model.config, tuple(int(n) for n in x_shape),
                                                      int(text_tokens), self.dtype)

    def activation_room(self) -> Optional[int]:
        """Device bytes calls may fill with activations now: the free memory, less the layer buffers offload makes
        at the next forward and offload "auto"'s workspace (the server's batcher admits jobs within it). None off
        CUDA: no bound."""
        free = device_rt.free_bytes(self.device)
        if free is None:
            return None
        offloader = get_offload(self.model)
        return free - (offloader.unallocated_bytes() if offloader is not None else 0) - CALL_WORKSPACE_BYTES

    # -- what it is ----------------------------------------------------------------------------------------
    @property
    def model_config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return family_of(self.model).device_of(self.model)

    def describe(self) -> dict:
        model = self.model
        offloader = get_offload(model)
        fused, groups = fused_groups(model)
        return {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "params": sum(p.numel() for p in model.parameters()), "model": model.config.to_dict(),
                "attention": self.attention_backend, "quant": quant.model_quant_format(model),
                "weights": quant.weights_format(model),  # by name for people: "gguf q4_k + q6_k", not "mixed"
                "fused_projections": [fused, groups], "offload": None if offloader is None else offloader.describe(),
                "compile": self.config.compile if is_compiled(model) else None, "parallel": None}

    # -- weights -------------------------------------------------------------------------------------------
    def set_loras(self, loras) -> List[str]:
        return apply_loras(self.model, self.lora_files.files(loras, self.model))

    def check_lora(self, path) -> List[str]:
        return self.lora_files.read(path, self.model).report()

    def active_loras(self) -> list:
        return [(lf.path, s) for lf, s in active_loras(self.model)]

    @property
    def lora_report(self) -> List[str]:
        """Messages about the active LoRAs' keys that were not applied."""
        return [m for lf, _ in active_loras(self.model) for m in lf.report()]

    def release(self) -> int:
        offloader = get_offload(self.model)
        freed = offloader.release_buffers() if offloader is not None else 0
        device_rt.empty_cache()
        return freed

    # -- calls ---------------------------------------------------------------------------------------------
    def run(self, plan, cfg_batched: bool) -> LocalRun:
        return LocalRun(self, plan, cfg_batched)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """One DiT forward: flow velocity in float32."""
        timestep = to_timestep(sigma).float().to(self.device)
        return self.model(x.to(self.device), timestep, text, lens).float().to(x.device)

    @torch.no_grad()
    def dit(self, x, timestep, text, lens) -> torch.Tensor:
        return self.model(x, timestep, text, lens)


def open_local(path: str, config: EngineConfig) -> LocalRunner:
    """Load a checkpoint into this process with ``config``'s features. Layer-wise offload is decided from the
    header before loading: an offloaded model is loaded into CPU memory, never whole onto the GPU."""
    decision = None
    device = config.device
    ckpt = open_checkpoint(path)  # the header, read once
    config, why = with_compute_dtype(config, ckpt.family)  # one rule for every entry point, not the file's dtype
    plan = plan_load(ckpt, config.dtype, config.quant)
    if config.offload != "none":
        decision = choose_offload(config.offload, config.device, plan.bytes_at_rest())
        if decision[0] == "layerwise":
            device = "cpu"
    model = plan.read(device)
    runner = LocalRunner(model, config, offload_decision=decision)
    runner.dtype_reason = why
    return runner
