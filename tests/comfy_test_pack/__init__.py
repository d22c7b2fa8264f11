"""Test-only ComfyUI nodes for inputs that ComfyUI 0.3.75 cannot make without real model files.

``SGLDTestTextFeatures`` returns CONDITIONING shaped like ComfyUI's ERNIE-Image text encoder output,
``[[tensor [1, T, C], {}]]``, filled with seeded noise; tests rebuild the same tensor with
:func:`text_features`. ``SGLDTestFaultyLatent`` returns a LATENT whose samples raise ``message`` when
the KSampler first uses them: a stand-in for a failure deep inside a run (out of memory, a driver
error) with a long multi-line message, which this machine cannot produce on purpose.
``SGLDTestNoiseMask`` sets a LATENT's ``noise_mask`` to any value and channel count: ComfyUI's own mask nodes
only make valid masks, so this stands in for another pack's node that makes a bad one. Imports only
torch, so tests can load this file outside ComfyUI.
"""
import torch


def text_features(seed: int, tokens: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(1, int(tokens), int(dim), generator=g, dtype=torch.float32)


class SGLDTestTextFeatures:
    CATEGORY = "_for_testing/sgldiffusion"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
            "tokens": ("INT", {"default": 7, "min": 0, "max": 4096}),
            "dim": ("INT", {"default": 48, "min": 1, "max": 8192}),
        }}

    def make(self, seed, tokens, dim):
        return ([[text_features(seed, tokens, dim), {}]],)


class FaultySamples:
    """Latent samples that raise RuntimeError(message) on first use."""

    def __init__(self, message: str):
        self.message = message

    def dim(self):
        raise RuntimeError(self.message)

    @property
    def shape(self):
        raise RuntimeError(self.message)


class SGLDTestFaultyLatent:
    CATEGORY = "_for_testing/sgldiffusion"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"message": ("STRING", {"multiline": True, "default": "a failure"})}}

    def make(self, message):
        return ({"samples": FaultySamples(message)},)


class SGLDTestNoiseMask:
    CATEGORY = "_for_testing/sgldiffusion"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "value": ("FLOAT", {"default": 1.0, "min": -1e9, "max": 1e9}),
                             "channels": ("INT", {"default": 1, "min": 1, "max": 256})}}

    def make(self, samples, value, channels):
        s = samples["samples"]
        return (dict(samples, noise_mask=torch.full((s.shape[0], int(channels), *s.shape[2:]), float(value))),)


NODE_CLASS_MAPPINGS = {"SGLDTestTextFeatures": SGLDTestTextFeatures, "SGLDTestFaultyLatent": SGLDTestFaultyLatent,
                       "SGLDTestNoiseMask": SGLDTestNoiseMask}
NODE_DISPLAY_NAME_MAPPINGS = {"SGLDTestTextFeatures": "SGLD Test Text Features", "SGLDTestFaultyLatent": "SGLD Test Faulty Latent",
                              "SGLDTestNoiseMask": "SGLD Test Noise Mask"}
