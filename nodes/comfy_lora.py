"""ComfyUI's LoRA patches on the MODEL path (LoraLoaderModelOnly and other packs' loaders) as LoRAs the engine
applies its own way: held in memory (``engine.features.lora.LoRATensors``), never written to a file, named
by the user's file and keys in every message. Why: docs/comfyui_model.md ("LoRA").
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..engine import LoRAError
from ..engine.features.lora import LoRATensors
from ..engine.io.safetensors import CheckpointError, SafetensorsFile

SOURCES_ATTACHMENT = "sgld_lora_sources"  # patcher attachment: ((label, ids of the adapters it added), ...)
NATIVE_PREFIXES = ("transformer.", "base_model.model.")  # diffusers / PEFT keys: ComfyUI maps them from 0.19 on
FALLBACK = "ComfyUI's LoRA patches"


def executing_node() -> tuple:
    """(node id, class_type, inputs, the prompt's extra data, the prompt) of the node ComfyUI runs now, from its
    running prompt; (None, "", {}, {}, {}) when it cannot be read (outside a server)."""
    try:
        from comfy_execution.utils import get_executing_context
        from server import PromptServer

        ctx = get_executing_context()
        queue = PromptServer.instance.prompt_queue
        for item in list(queue.currently_running.values()):
            if ctx is not None and item[1] == ctx.prompt_id:
                node = item[2].get(str(ctx.node_id), {})
                extra = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
                return str(ctx.node_id), str(node.get("class_type", "")), dict(node.get("inputs", {})), extra, item[2]
    except Exception:
        pass
    return None, "", {}, {}, {}


def source_label(node_id, class_type: str, inputs: dict) -> str:
    """What messages call the LoRA a node added: its file and the node (``tiny.safetensors (LoraLoaderModelOnly,
    node 21)``)."""
    name = inputs.get("lora_name")
    if node_id is None:
        return FALLBACK
    where = f"{class_type or 'node'}, node {node_id}"
    return f"{name} ({where})" if isinstance(name, str) else f"the LoRA of {where}"


def check_native_keys(name, matched: dict, native_ernie: bool) -> None:
    """LoRAError when the file ``name`` (in models/loras) has diffusers / PEFT keys (``transformer.*``) that this
    ComfyUI left unmatched: before 0.19 ComfyUI maps them for no ERNIE-Image model and would only log "lora key
    not loaded" lines. ``matched``: the patches ComfyUI made from the file."""
    if native_ernie or not isinstance(name, str):
        return
    try:
        import folder_paths

        path = folder_paths.get_full_path("loras", name)
        keys = SafetensorsFile(path).keys() if path else []
    except (ImportError, CheckpointError, OSError):
        return
    loaded = {k for adapter in matched.values() for k in getattr(adapter, "loaded_keys", ())}
    native = [k for k in keys if k.startswith(NATIVE_PREFIXES) and k not in loaded]
    if native:
        raise LoRAError(f"LoRA {name}: {len(native)} of its {len(keys)} keys are in the diffusers / PEFT format "
                        f"('{native[0]}'), which this ComfyUI does not map for ERNIE-Image (ComfyUI 0.19 and later "
                        "do). Use SGLDiffusion LoRA Loader instead: it takes this MODEL too and reads that format.")


# the LoRA formats ComfyUI reads (comfy/weight_adapter/lora.py): suffix -> our part
UP_SUFFIXES = (".lora_B.default.weight", ".lora_linear_layer.up.weight", ".lora_up.weight", ".lora_B.weight",
               ".lora.up.weight", "_lora.up.weight", ".lora_B")
DOWN_SUFFIXES = (".lora_A.default.weight", ".lora_linear_layer.down.weight", ".lora_down.weight", ".lora_A.weight",
                 ".lora.down.weight", "_lora.down.weight", ".lora_A")
# ComfyUI's LyCORIS adapters (comfy/weight_adapter/lokr.py, loha.py): the parts of their ``weights`` tuple, in
# order ("alpha" is the alpha, None a part the engine does not take: DoRA's scale)
LYCORIS_WEIGHTS = {
    "LoKrAdapter": ("lokr_w1", "lokr_w2", "alpha", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2", None),
    "LoHaAdapter": ("hada_w1_a", "hada_w1_b", "alpha", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", None),
}
PARTS = [(s, "lora_up.weight") for s in UP_SUFFIXES] + [(s, "lora_down.weight") for s in DOWN_SUFFIXES] + [(".alpha", "alpha")] \
    + [(f".{p}", p) for parts in LYCORIS_WEIGHTS.values() for p in parts if p not in (None, "alpha")]


def _user_keys(adapter, key: str, key_map: dict) -> Dict[str, str]:
    """Our key -> the user's key for the adapter of ``key`` (a patched weight): the keys ComfyUI read (the whole
    file's, shared by its adapters) whose prefix ComfyUI's ``key_map`` sends to ``key``."""
    name = key[: -len(".weight")]
    out = {}
    for user in getattr(adapter, "loaded_keys", ()) or ():
        for suffix, part in PARTS:
            if user.endswith(suffix) and key_map.get(user[: -len(suffix)]) == key:
                out[f"{name}.{part}"] = user
                break
    return out


def comfy_loras(patches: dict, sources=(), key_map=None) -> List[tuple]:
    """ComfyUI's weight patches as [(LoRATensors, strength), ...]: one per node that added them and strength,
    named by ``sources`` ((label, adapter ids), ...), keys named as in the user's file through ComfyUI's
    ``key_map`` (LoRA key prefix -> weight). Plain LoRA (up / down with alpha), LoKr and LoHa are taken."""
    labels = {i: label for label, ids in sources for i in ids}
    groups: Dict[tuple, tuple] = {}
    for key, entries in sorted(patches.items()):
        if not key.startswith("diffusion_model.") or not key.endswith(".weight"):
            raise LoRAError(f"ComfyUI patch on '{key}': only the diffusion model's weights can be patched")
        name = key[: -len(".weight")]
        for strength, adapter, strength_model, offset, function in entries:
            label = labels.get(id(adapter), FALLBACK)
            weights = getattr(adapter, "weights", None)
            kind = type(adapter).__name__
            parts = LYCORIS_WEIGHTS.get(kind, ("lora_up.weight", "lora_down.weight", "alpha", None) if kind == "LoRAAdapter" else None)
            if parts is None or offset is not None or function is not None or strength_model != 1.0 \
                    or len(weights) != len(parts) and kind != "LoRAAdapter" \
                    or any(w is not None for w, p in zip(weights, parts + (None,) * len(weights)) if p is None):
                raise LoRAError(f"{label}: the patch on '{key}' is a {kind}: the engine applies LoRA (up/down with alpha), "
                                "LoKr and LoHa without DoRA; use SGLDiffusion LoRA Loader for other files")
            tensors, origin = groups.setdefault((label, float(strength)), ({}, {}))
            for w, part in zip(weights, parts):
                if part == "alpha" and w is not None:
                    tensors[f"{name}.alpha"] = torch.tensor(float(w))
                elif part not in (None, "alpha") and w is not None:
                    tensors[f"{name}.{part}"] = w.float().contiguous()
            origin.update(_user_keys(adapter, key, key_map or {}))
    return [(LoRATensors(label, tensors, origin), strength) for (label, strength), (tensors, origin) in groups.items()]
