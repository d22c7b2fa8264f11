"""SGLDiffusion Empty Latent (ERNIE): the empty latent of the ERNIE-Image family (the Flux2 latent), for graphs
on a ComfyUI without EmptyFlux2LatentImage (before 0.3.72) or that should not depend on it. The shape and its
limits are the engine's (engine.inputs.empty_latent_shape), the latent's facts the family's."""
from __future__ import annotations

import torch

from ..engine.errors import InputError
from ..engine.inputs import empty_latent_shape
from ..engine.models import get
from ..engine.sampling import MAX_BATCH, MAX_IMAGE_SIDE

NODE = "SGLDiffusion Empty Latent (ERNIE)"
FAMILY = get("ernie-image")  # the family whose latent this node makes
LATENT = FAMILY.latent
SIZES = ", ".join(f"{w}x{h}" for w, h in FAMILY.sizes)


def _side(name: str) -> tuple:
    return ("INT", {"default": 1024, "min": LATENT.stride, "max": MAX_IMAGE_SIDE, "step": LATENT.stride,
                    "tooltip": f"The image {name} in pixels, a multiple of {LATENT.stride} up to {MAX_IMAGE_SIDE}. "
                               f"{FAMILY.title}'s recommended sizes (width x height): {SIZES}."})


class SGLDiffusionEmptyLatentERNIE:
    DESCRIPTION = (f"An empty {FAMILY.title} latent: {LATENT.channels} channels at 1/{LATENT.stride} of the "
                   f"image size ({LATENT.name}, as ComfyUI's EmptyFlux2LatentImage makes it), for SGLDiffusion "
                   "KSampler or any sampler.")
    CATEGORY = "SGLDiffusion"
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = (f"The empty latent batch: zeros [batch_size, {LATENT.channels}, height/{LATENT.stride}, "
                       f"width/{LATENT.stride}].",)
    FUNCTION = "generate"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"width": _side("width"), "height": _side("height"),
                             "batch_size": ("INT", {"default": 1, "min": 1, "max": MAX_BATCH,
                                                    "tooltip": "The number of latent images in the batch."})}}

    def generate(self, width, height, batch_size=1):
        """Zeros on ComfyUI's intermediate device, as ComfyUI's empty-latent nodes make them. ComfyUI checks
        min and max but not the step, so a size that is not a multiple of the stride is refused here."""
        import comfy.model_management

        try:
            shape = empty_latent_shape(FAMILY, width, height, batch_size)
        except InputError as e:
            raise ValueError(f"{NODE}: {e}") from None  # ComfyUI shows a ValueError without the pack's module path
        return ({"samples": torch.zeros(shape, device=comfy.model_management.intermediate_device())},)


NODE_CLASS_MAPPINGS = {"SGLDiffusionEmptyLatentERNIE": SGLDiffusionEmptyLatentERNIE}
NODE_DISPLAY_NAME_MAPPINGS = {"SGLDiffusionEmptyLatentERNIE": NODE}
