"""SGLDiffusion Empty Latent (ERNIE): the empty Flux2 latent ERNIE-Image takes, for graphs on a ComfyUI
without EmptyFlux2LatentImage (before 0.3.72) or that should not depend on it. The shape and its limits
are the engine's (engine.inputs.flux2_latent_shape)."""
from __future__ import annotations

import torch

from ..engine.errors import InputError
from ..engine.inputs import flux2_latent_shape
from ..engine.models.ernie_image import ErnieImageConfig
from ..engine.sampling import LATENT_FACTOR, MAX_BATCH, MAX_IMAGE_SIDE

NODE = "SGLDiffusion Empty Latent (ERNIE)"
SIZES = "1024x1024, 848x1264, 1264x848, 768x1376, 1376x768, 896x1200, 1200x896"  # ERNIE-Image's model card


def _side(name: str) -> tuple:
    return ("INT", {"default": 1024, "min": LATENT_FACTOR, "max": MAX_IMAGE_SIDE, "step": LATENT_FACTOR,
                    "tooltip": f"The image {name} in pixels, a multiple of {LATENT_FACTOR} up to {MAX_IMAGE_SIDE}. "
                               f"ERNIE-Image's recommended sizes (width x height): {SIZES}."})


class SGLDiffusionEmptyLatentERNIE:
    DESCRIPTION = (f"An empty ERNIE-Image latent: {ErnieImageConfig.in_channels} channels at 1/{LATENT_FACTOR} of the "
                   "image size (the Flux2 latent, as ComfyUI's EmptyFlux2LatentImage makes it), for SGLDiffusion "
                   "KSampler or any sampler.")
    CATEGORY = "SGLDiffusion"
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = (f"The empty latent batch: zeros [batch_size, {ErnieImageConfig.in_channels}, height/{LATENT_FACTOR}, "
                       f"width/{LATENT_FACTOR}].",)
    FUNCTION = "generate"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"width": _side("width"), "height": _side("height"),
                             "batch_size": ("INT", {"default": 1, "min": 1, "max": MAX_BATCH,
                                                    "tooltip": "The number of latent images in the batch."})}}

    def generate(self, width, height, batch_size=1):
        """Zeros on ComfyUI's intermediate device, as ComfyUI's empty-latent nodes make them. ComfyUI checks
        min and max but not the step, so a size that is not a multiple of 16 is refused here."""
        import comfy.model_management

        try:
            shape = flux2_latent_shape(width, height, batch_size)
        except InputError as e:
            raise ValueError(f"{NODE}: {e}") from None  # ComfyUI shows a ValueError without the pack's module path
        return ({"samples": torch.zeros(shape, device=comfy.model_management.intermediate_device())},)


NODE_CLASS_MAPPINGS = {"SGLDiffusionEmptyLatentERNIE": SGLDiffusionEmptyLatentERNIE}
NODE_DISPLAY_NAME_MAPPINGS = {"SGLDiffusionEmptyLatentERNIE": NODE}
