"""Test-only ComfyUI nodes for inputs that ComfyUI 0.3.75 cannot make without real model files.

``SGLDTestTextFeatures`` returns CONDITIONING shaped like ComfyUI's ERNIE-Image text encoder output,
``[[tensor [1, T, C], {}]]``, filled with seeded noise; tests rebuild the same tensor with
:func:`text_features`. ``SGLDTestFaultyLatent`` returns a LATENT whose samples raise ``message`` when
the KSampler first uses them: a stand-in for a failure deep inside a run (out of memory, a driver
error) with a long multi-line message, which this machine cannot produce on purpose.
``SGLDTestNoiseMask`` sets a LATENT's ``noise_mask`` to any value and channel count: ComfyUI's own mask nodes
only make valid masks, so this stands in for another pack's node that makes a bad one. ``SGLDTestModelMemory``
shows what ComfyUI's memory management reads from a MODEL (its sizes, what load_models_gpu would free for it and
the host memory a 2026 ComfyUI would pin for it), or calls a newest-ComfyUI path on it (``deepclone_multigpu``,
which 0.3.75's nodes never call). Imports only torch at the top, so tests can load this file outside ComfyUI.
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


class SGLDTestModelMemory:
    CATEGORY = "_for_testing/sgldiffusion"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "probe"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "action": (["memory", "deepclone_multigpu"],)},
                "optional": {"after": ("LATENT", {"tooltip": "Run after the sampler that makes this latent."})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # always run: it reads the state of the moment

    def probe(self, model, action, after=None):
        import comfy.model_management as mm

        if action == "deepclone_multigpu":
            model.deepclone_multigpu(new_load_device=model.load_device)
        loaded = mm.LoadedModel(model)
        report = {"model_size": int(model.model_size()), "loaded_size": int(model.loaded_size()),
                  "memory_required": int(loaded.model_memory_required(model.load_device)),
                  "pins_2026": 0 if getattr(model, "is_dynamic", lambda: False)() else int(loaded.model_memory()),
                  "pin_requests": list(getattr(mm, "PIN_BUDGET_REQUESTS", [])),
                  "in_current_loaded_models": any(m.model is model or m.model.model is model.model
                                                  for m in mm.current_loaded_models if m.model is not None)}
        return {"ui": {"memory": [report]}}


NODE_CLASS_MAPPINGS = {"SGLDTestTextFeatures": SGLDTestTextFeatures, "SGLDTestFaultyLatent": SGLDTestFaultyLatent,
                       "SGLDTestNoiseMask": SGLDTestNoiseMask, "SGLDTestModelMemory": SGLDTestModelMemory}
NODE_DISPLAY_NAME_MAPPINGS = {"SGLDTestTextFeatures": "SGLD Test Text Features", "SGLDTestFaultyLatent": "SGLD Test Faulty Latent",
                              "SGLDTestNoiseMask": "SGLD Test Noise Mask", "SGLDTestModelMemory": "SGLD Test Model Memory"}
