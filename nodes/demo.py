"""Nodes for the embedded demo model, so a CPU-only ComfyUI runs a real text-to-image graph in
seconds: Demo Text Encode (-> CONDITIONING), Demo Empty Latent (-> LATENT), Demo Decode (-> IMAGE).
The demo DiT itself is chosen in SGLDiffusion Model Loader (``DEMO_CHOICE``)."""
from __future__ import annotations

import logging

import torch

from ..engine.models import demo as demo_model

DEMO_CHOICE = "sgld-demo (embedded, 64x64)"
DEMO_TURBO_CHOICE = "sgld-demo-turbo (embedded, 64x64, 8 steps at cfg 1)"
# the loader's names of the embedded models (those shipped) -> their files
EMBEDDED = {DEMO_CHOICE: demo_model.NAMED["demo"], DEMO_TURBO_CHOICE: demo_model.NAMED["demo-turbo"]}
WARNINGS_KEY = "sgld_warnings"  # in a CONDITIONING entry's options: SGLDiffusion KSampler puts them in the run's warnings


def _demo():
    return demo_model.load_demo()  # cached per process


class SGLDiffusionDemoTextEncode:
    DESCRIPTION = "Encodes a prompt with the demo model's text encoder (shapes, colours, positions; see the README)."
    CATEGORY = "SGLDiffusion/demo"
    RETURN_TYPES = ("CONDITIONING",)
    OUTPUT_TOOLTIPS = ("The prompt's text features, for SGLDiffusion KSampler's positive or negative input.",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text": ("STRING", {"multiline": True, "default": demo_model.EXAMPLE_PROMPT,
                                                 "tooltip": "e.g. 'a large red circle on the left, on a blue background'; "
                                                            "empty for the negative prompt"})}}

    def encode(self, text):
        """The words the demo does not know travel with the conditioning, so the KSampler's run shows them
        (this node has no run panel of its own; ComfyUI may also reuse its output without running it)."""
        warning = _demo().tokenizer.unknown_words_warning(text)
        if warning:
            logging.warning("SGLDiffusion Demo Text Encode: %s", warning)
        try:
            features = _demo().encode([text])[0]
        except (KeyError, ValueError) as e:
            raise ValueError(f"SGLDiffusion Demo Text Encode: {e}") from None
        return ([[features[None], {WARNINGS_KEY: [warning]} if warning else {}]],)


DEMO_SIZE = f"{demo_model.IMAGE_SIZE}x{demo_model.IMAGE_SIZE}"  # the one picture size the demo makes


class SGLDiffusionDemoEmptyLatent:
    DESCRIPTION = (f"An empty latent for the demo model, which makes {DEMO_SIZE} pictures only "
                   f"({demo_model.LATENT_CHANNELS} channels at {demo_model.LATENT_SIZE}x{demo_model.LATENT_SIZE}).")
    CATEGORY = "SGLDiffusion/demo"
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = (f"An empty demo latent [batch_size, {demo_model.LATENT_CHANNELS}, {demo_model.LATENT_SIZE}, "
                       f"{demo_model.LATENT_SIZE}], for SGLDiffusion KSampler's latent_image.",)
    FUNCTION = "generate"

    @classmethod
    def INPUT_TYPES(cls):
        """``size``: a list of one, so the node shows the size it makes (optional: graphs saved without it still run)."""
        return {"required": {"batch_size": ("INT", {"default": 1, "min": 1, "max": 64,
                                                    "tooltip": f"How many {DEMO_SIZE} pictures to make at once."})},
                "optional": {"size": ([DEMO_SIZE], {"default": DEMO_SIZE,
                                                    "tooltip": f"The demo model makes {DEMO_SIZE} pictures only."})}}

    def generate(self, batch_size, size=DEMO_SIZE):
        return ({"samples": demo_model.DemoModel.empty_latent(batch_size)},)


class SGLDiffusionDemoDecode:
    DESCRIPTION = "Decodes a demo-model latent (lossless 4x4 space-to-depth) into a 64x64 image."
    CATEGORY = "SGLDiffusion/demo"
    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The 64x64 pictures.",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT", {"tooltip": "The demo model's latent from SGLDiffusion KSampler "
                                                               "(48 channels at 16x16)."})}}

    def decode(self, samples):
        latent = samples["samples"]
        if latent.dim() != 4 or latent.shape[1] != demo_model.LATENT_CHANNELS:
            raise ValueError(f"SGLDiffusion Demo Decode: latent has shape {tuple(latent.shape)}; the demo model's latent "
                             f"is [batch, {demo_model.LATENT_CHANNELS}, 16, 16] (use SGLDiffusion Demo Empty Latent)")
        return (demo_model.DemoModel.decode_float(latent.float()).to(torch.float32),)


NODE_CLASS_MAPPINGS = {
    "SGLDiffusionDemoTextEncode": SGLDiffusionDemoTextEncode,
    "SGLDiffusionDemoEmptyLatent": SGLDiffusionDemoEmptyLatent,
    "SGLDiffusionDemoDecode": SGLDiffusionDemoDecode,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "SGLDiffusionDemoTextEncode": "SGLDiffusion Demo Text Encode",
    "SGLDiffusionDemoEmptyLatent": "SGLDiffusion Demo Empty Latent",
    "SGLDiffusionDemoDecode": "SGLDiffusion Demo Decode",
}
