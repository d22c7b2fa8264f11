"""What this ComfyUI lacks for the ERNIE-Image workflows, found once at start-up by feature, never by
version number: ComfyUI's EmptyFlux2LatentImage node, CLIPLoader's ``flux2`` type, the Flux2 latent format
and the Flux.2 VAE (all since about 0.3.72) and the Ministral-3 3B text encoder (``TEModel.MINISTRAL_3_3B``,
``comfy/text_encoders/ernie.py``: since 0.19). Without the Flux2 latent format the Model Loader builds no
``comfy_model`` (comfy_model.py); SGLDiffusion KSampler needs none of these. Anything missing is logged in one line and shown on the pack's nodes (their description, and
the web extension through GET /sgldiffusion/last_runs), so a user knows to update ComfyUI. A probe that
finds ComfyUI's modules shaped differently counts as "not found"; it never raises."""
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
}
# feature -> what does not work without it (the rest of the pack does)
BROKEN = {"flux2_latent_format": "the Model Loader's comfy_model output (ComfyUI's own samplers on ERNIE-Image)",
          "flux2_vae": "decoding ERNIE-Image latents (VAEDecode)"}
log = logging.getLogger("sgldiffusion")


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


PROBES = {"empty_flux2_latent": _has_empty_flux2_latent, "flux2_clip_type": _has_flux2_clip_type,
          "ministral3_text_encoder": _has_ministral3_text_encoder, "flux2_latent_format": _has_flux2_latent_format,
          "flux2_vae": _has_flux2_vae}


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
    return (f"SGLDiffusion: {this} lacks {'; '.join(missing)}, which the ERNIE-Image workflows need: update to "
            f"{UPDATE}. {works}")


def mark_nodes(node_classes, text: str) -> None:
    """Append ``text`` to the description of each node class (ComfyUI shows it on hover and in the node library)."""
    for cls in node_classes:
        base = getattr(cls, "DESCRIPTION", "")
        cls.DESCRIPTION = f"{base}\n\n{text}" if base else text


def check_at_startup(node_classes) -> str:
    """Probe once, log the notice (one line) and put it on ``node_classes`` (the nodes that take ERNIE-Image files);
    returns it ("" when nothing is missing)."""
    text = notice(probe(), version())
    if text:
        log.warning(text)
        mark_nodes(node_classes, text)
    return text
