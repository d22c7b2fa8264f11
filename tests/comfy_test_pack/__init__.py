"""Test-only ComfyUI nodes for inputs that ComfyUI 0.3.75 cannot make without real model files.

``SGLDTestTextFeatures`` returns CONDITIONING shaped like ComfyUI's ERNIE-Image text encoder output,
``[[tensor [1, T, C], {}]]``, filled with seeded noise; tests rebuild the same tensor with
:func:`text_features`. Imports only torch, so tests can load this file outside ComfyUI.
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


NODE_CLASS_MAPPINGS = {"SGLDTestTextFeatures": SGLDTestTextFeatures}
NODE_DISPLAY_NAME_MAPPINGS = {"SGLDTestTextFeatures": "SGLD Test Text Features"}
