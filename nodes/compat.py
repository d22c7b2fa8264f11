"""What this ComfyUI lacks for the model workflows, found once at start-up by feature, never by
version number: ComfyUI's EmptyFlux2LatentImage node, CLIPLoader's ``flux2`` type, the Flux2 latent format
and the Flux.2 VAE (all since about 0.3.72) and the Ministral-3 3B text encoder (``TEModel.MINISTRAL_3_3B``,
``comfy/text_encoders/ernie.py``: since 0.19) for ERNIE-Image; Z-Image's Qwen3-4B text encoder
(``TEModel.QWEN3_4B``, ``comfy/text_encoders/z_image.py``: since about 0.3.75). Without the Flux2 latent format the Model Loader builds no
``comfy_model`` (comfy_model.py); SGLDiffusion KSampler needs none of these. Anything missing is logged in one line and
shown in the pack's nodes' descriptions, so a user knows to update ComfyUI; the web panel shows it only for a graph that
needs it (``graph_notice``: the demo workflow needs none of it). A probe that finds ComfyUI's modules shaped differently
counts as "not found"; it never raises."""
from __future__ import annotations

import importlib.util
import inspect
import logging

UPDATE = "ComfyUI 0.19 or newer"
# feature -> what a user reads when it is missing
FEATURES = {
    "empty_flux2_latent": "the EmptyFlux2LatentImage node (SGLDiffusion Empty Latent (ERNIE) makes the same latent)",
    "flux2_clip_type": "CLIPLoader's 'flux2' type",
    "ministral3_text_encoder": "the Ministral-3 text encoder (ministral-3-3b.safetensors in CLIPLoader)",
    "flux2_latent_format": "the Flux2 latent format (comfy.latent_formats.Flux2)",
    "flux2_vae": "the Flux.2 VAE (flux2-vae.safetensors in VAELoader)",
    "qwen3_4b_text_encoder": "the Qwen3-4B text encoder (qwen_3_4b.safetensors in CLIPLoader, for Z-Image)",
}
# feature -> what does not work without it (the rest of the pack does)
BROKEN = {"flux2_latent_format": "the Model Loader's comfy_model output (ComfyUI's own samplers on ERNIE-Image)",
          "flux2_vae": "decoding ERNIE-Image latents (VAEDecode)"}
log = logging.getLogger("sgldiffusion")
LOADER_OUTPUTS = {"SGLDiffusionModelLoader", "SGLDiffusionLoraLoader"}  # their output 1 is comfy_model
COMFY_MODEL_SLOT = 1


def _names(inputs: dict, word: str) -> bool:
    """Some text input of a node names ``word`` (a file name such as ministral-3-3b.safetensors)."""
    return any(isinstance(v, str) and word in v.lower() for v in inputs.values())


# feature -> does a node of an API prompt (class_type, inputs, the prompt) need it
NEEDED_BY = {
    "empty_flux2_latent": lambda kind, inputs, prompt: kind == "EmptyFlux2LatentImage",
    "flux2_clip_type": lambda kind, inputs, prompt: "CLIPLoader" in kind and inputs.get("type") == "flux2",
    "ministral3_text_encoder": lambda kind, inputs, prompt: "CLIPLoader" in kind and _names(inputs, "ministral"),
    "flux2_latent_format": lambda kind, inputs, prompt: any(
        isinstance(v, list) and len(v) == 2 and v[1] == COMFY_MODEL_SLOT
        and (prompt.get(str(v[0])) or {}).get("class_type") in LOADER_OUTPUTS for v in inputs.values()),
    "flux2_vae": lambda kind, inputs, prompt: "VAELoader" in kind and _names(inputs, "flux2"),
    "qwen3_4b_text_encoder": lambda kind, inputs, prompt: "CLIPLoader" in kind and _names(inputs, "qwen_3_4b"),
}


def _has_empty_flux2_latent() -> bool:
    import nodes

    return "EmptyFlux2LatentImage" in nodes.NODE_CLASS_MAPPINGS


def _has_flux2_clip_type() -> bool:
    import nodes

    return "flux2" in nodes.CLIPLoader.INPUT_TYPES()["required"]["type"][0]


def _has_ministral3_text_encoder() -> bool:
    """What decides how CLIPLoader loads ministral-3-3b.safetensors: without this member ComfyUI's
    detect_te_model takes the file for another Llama-style encoder."""
    import comfy.sd

    return hasattr(comfy.sd.TEModel, "MINISTRAL_3_3B") or importlib.util.find_spec("comfy.text_encoders.ernie") is not None


def _has_flux2_latent_format() -> bool:
    import comfy.latent_formats

    return hasattr(comfy.latent_formats, "Flux2")


def _has_flux2_vae() -> bool:
    """The Flux.2 VAE's batch-normed latent (its ``bn.running_mean``), which ComfyUI's VAE builds in
    AutoencodingEngineLegacy (where older ComfyUI loads flux2-vae.safetensors as a wrong 32-channel VAE)."""
    import comfy.ldm.models.autoencoder as autoencoder

    return "batch_norm_latent" in inspect.getsource(autoencoder.AutoencodingEngineLegacy.__init__)


def _has_qwen3_4b_text_encoder() -> bool:
    """What decides how CLIPLoader loads qwen_3_4b.safetensors (Z-Image's encoder)."""
    import comfy.sd

    return hasattr(comfy.sd.TEModel, "QWEN3_4B")


PROBES = {"empty_flux2_latent": _has_empty_flux2_latent, "flux2_clip_type": _has_flux2_clip_type,
          "ministral3_text_encoder": _has_ministral3_text_encoder, "flux2_latent_format": _has_flux2_latent_format,
          "flux2_vae": _has_flux2_vae, "qwen3_4b_text_encoder": _has_qwen3_4b_text_encoder}


def probe() -> dict:
    """{feature: found} for each of FEATURES, in this ComfyUI (a probe that raises counts as not found)."""
    return {name: found(name) for name in PROBES}


def found(name: str) -> bool:
    """One probe of PROBES (False when it raises)."""
    try:
        return bool(PROBES[name]())
    except Exception:
        return False


def version() -> str:
    """ComfyUI's version, for the message only ("" when it cannot be read)."""
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except Exception:
        return ""


def notice(found: dict, version: str = "") -> str:
    """One line saying what is missing and what to update, or "" when nothing is."""
    missing = [FEATURES[name] for name in FEATURES if not found.get(name, False)]
    if not missing:
        return ""
    this = f"this ComfyUI ({version})" if version else "this ComfyUI"
    broken = [BROKEN[name] for name in BROKEN if not found.get(name, False)]
    works = (f"Not working here: {'; '.join(broken)}. SGLDiffusion KSampler and the demo work." if broken else
             "The pack's nodes and its demo work as they are.")
    return (f"SGLDiffusion: {this} lacks {'; '.join(missing)}, which the model workflows need: update to "
            f"{UPDATE}. {works}")


def needed(prompt) -> set:
    """The features of FEATURES that the nodes of an API prompt (``{id: {"class_type", "inputs"}}``) need: a
    CLIPLoader of a Ministral-3 file needs the Ministral-3 text encoder, a sampler on comfy_model the Flux2
    latent format, and so on; the demo's nodes need none."""
    out = set()
    for node in (prompt.values() if isinstance(prompt, dict) else ()):
        kind = node.get("class_type") if isinstance(node, dict) else None
        inputs = node.get("inputs") if isinstance(node, dict) else None
        if not isinstance(kind, str) or not isinstance(inputs, dict):
            continue
        out |= {name for name, needs in NEEDED_BY.items() if needs(kind, inputs, prompt)}
    return out


def graph_notice(found: dict, prompt, version: str = "") -> str:
    """notice() for one graph: only what this ComfyUI lacks of what the graph needs ("" when nothing)."""
    wanted = needed(prompt)
    return notice({name: found.get(name, False) or name not in wanted for name in FEATURES}, version)


def mark_nodes(node_classes, text: str) -> None:
    """Append ``text`` to the description of each node class (ComfyUI shows it on hover and in the node library)."""
    for cls in node_classes:
        base = getattr(cls, "DESCRIPTION", "")
        cls.DESCRIPTION = f"{base}\n\n{text}" if base else text


def check_at_startup(node_classes) -> dict:
    """Probe once, log the notice (one line) and put it on ``node_classes`` (the nodes that take ERNIE-Image files);
    returns what the probes found (``notice(found, version())`` is the line, "" when nothing is missing)."""
    found = probe()
    text = notice(found, version())
    if text:
        log.warning(text)
        mark_nodes(node_classes, text)
    return found
