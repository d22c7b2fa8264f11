"""The embedded demo model: a small ERNIE-Image DiT trained here on procedural scenes.

    from engine import open_demo
    demo = open_demo()                                   # shipped weights, float32, CPU; demo.engine samples
    latent = demo.engine.sample(demo.empty_latent(1), demo.encode(["a large red circle on the left, on a blue background"]),
                                demo.encode([""]), seed=0, steps=demo.default_steps, cfg=demo.default_cfg,
                                sampler=demo.default_sampler)
    images = demo.decode(latent)                         # uint8 [B, 64, 64, 3]
    demo.generate("a small green square at the top, on a white background", seed=0)   # the same, in one call

The DiT is a plain ``ErnieImageTransformer`` read by ``engine.load_model`` from the same file
(``DEMO_WEIGHTS``; keys ``diffusion_model.*``), so ``engine.Engine`` samples it unchanged. Latents
are the lossless 4x4 space-to-depth of the image (``codec``): [B, 48, 16, 16] for 64x64 pixels.
Retrained with ``python -m tools.demo.train`` from the repository (under an hour on 2 CPU cores).
"""
from __future__ import annotations

import functools
import json
import os
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from ...errors import InputError
from ...image_parts import BundledParts
from ...io.checkpoint import check_architecture, open_checkpoint
from ...io.load import read_model
from ...io.readers import open_file
from ..bundle import Bundle, register_bundle
from . import codec
from .text_encoder import DemoTextEncoder, TextEncoderConfig, WordTokenizer
from .weights_io import DEMO_METADATA_KEY, read_demo_parts

DEMO_WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights", "demo.safetensors")
# the demo distilled to 8 steps at cfg 1 into 36 narrow blocks, the release's depth (tools/demo/distill_turbo.py)
DEMO_TURBO_WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights", "demo-turbo.safetensors")
NAMED = {"demo": DEMO_WEIGHTS, "demo-turbo": DEMO_TURBO_WEIGHTS}  # the embedded models by the name every entry takes
DEFAULT_STEPS = 30
DEFAULT_CFG = 3.0
DEFAULT_SAMPLER = "euler"
DEFAULT_SCHEDULER = "simple"
IMAGE_SIZE = 64
LATENT_CHANNELS = codec.LATENT_CHANNELS  # 48
LATENT_SIZE = IMAGE_SIZE // codec.FACTOR  # 16
EXAMPLE_PROMPT = "a large red circle on the left, on a blue background"
# CPU threads for the demo's DiT: its matrices are tiny, so a second thread costs more in synchronisation than it
# computes, and on a busy machine it waits for a core (measured 10-20x slower); engine/threads.py applies it
THREADS = 1

__all__ = ["DEMO_WEIGHTS", "DEMO_TURBO_WEIGHTS", "NAMED", "DEFAULT_STEPS", "DEFAULT_CFG", "DEFAULT_SAMPLER", "DEFAULT_SCHEDULER", "EXAMPLE_PROMPT",
           "THREADS", "DemoModel", "load_demo", "is_demo_file", "has_demo_shapes", "named", "sampling_defaults",
           "file_sampling_defaults"]


def named(source) -> str:
    """``source`` with an embedded model's name ("demo", "demo-turbo") as its file."""
    return NAMED.get(source, source) if isinstance(source, str) else source


def sampling_defaults(sampling: Optional[dict] = None) -> dict:
    """{"steps", "cfg", "sampler", "scheduler"}: a demo file's own (``demo_config.sampling``: a distilled one's), else
    the demo's."""
    own = sampling or {}
    return {"steps": int(own.get("steps", DEFAULT_STEPS)), "cfg": float(own.get("cfg", DEFAULT_CFG)),
            "sampler": own.get("sampler", DEFAULT_SAMPLER), "scheduler": own.get("scheduler", DEFAULT_SCHEDULER)}


def file_sampling_defaults(path: str) -> dict:
    """``sampling_defaults`` of the demo file at ``path``: its own metadata's, else (a copy in another format) those of
    the embedded file of its shapes, else the demo's."""
    try:
        raw = open_file(path).metadata.get(DEMO_METADATA_KEY)
        if raw is None:
            own = embedded_with(check_architecture(open_checkpoint(path)))
            raw = open_file(own).metadata.get(DEMO_METADATA_KEY) if own else None
        return sampling_defaults(json.loads(raw).get("sampling") if raw else None)
    except Exception:  # an unreadable file: its loading says what is wrong
        return sampling_defaults()


class DemoModel:
    """Text encoder + DiT + pixel codec of the demo model (the demo-turbo too: its sampling defaults are its own)."""

    def __init__(self, path: str, dit, text_encoder: DemoTextEncoder, tokenizer: WordTokenizer, info: dict,
                 sampling: Optional[dict] = None):
        self.path = path
        self.dit = dit
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.info = info
        defaults = sampling_defaults(sampling)
        self.default_steps, self.default_cfg = defaults["steps"], defaults["cfg"]
        self.default_sampler, self.default_scheduler = defaults["sampler"], defaults["scheduler"]
        self.engine = None  # an engine.Engine on the DiT: set by engine.open_demo()

    @torch.no_grad()
    def encode(self, prompts: Union[str, Sequence[str]]) -> List[torch.Tensor]:
        """Prompts -> list of text features [T_i, text_dim] (float32); "" is the unconditional prompt."""
        if isinstance(prompts, str):
            prompts = [prompts]
        out = []
        for p in prompts:
            ids, lens = self.tokenizer.batch([p], self.text_encoder.config.max_len)
            out.append(self.text_encoder(ids, lens)[0].float())
        return out

    @staticmethod
    def empty_latent(batch: int = 1) -> torch.Tensor:
        return torch.zeros(batch, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)

    # -- what a bundled model's image parts ask (engine/image_parts.py's BundledParts) ------------------------
    image_size = IMAGE_SIZE  # its one picture size, the default of every entry point

    @staticmethod
    def latent_shape(width: int, height: int, batch: int = 1) -> tuple:
        if (width, height) != (IMAGE_SIZE, IMAGE_SIZE):
            raise InputError(f"the demo model makes {IMAGE_SIZE}x{IMAGE_SIZE} pictures only")
        return (batch, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)

    def warnings(self, prompts: Sequence[str], negatives: Sequence[str],
                 names: Sequence[str] = ("prompt", "negative_prompt")) -> List[str]:
        """One per prompt that uses what the demo model does not know (WordTokenizer.unknown_words, "top right");
        ``names``: how the caller spells the prompt and the negative."""
        found = [self.tokenizer.unknown_words_warning(p, where=f" in {name}")
                 for name, texts in zip(names, (prompts, negatives)) for p in dict.fromkeys(texts)]
        return [w for w in found if w]

    @staticmethod
    def decode(latent: torch.Tensor) -> np.ndarray:
        """latent [B, 48, 16, 16] -> uint8 images [B, 64, 64, 3]."""
        return codec.decode(latent)

    @staticmethod
    def decode_float(latent: torch.Tensor) -> torch.Tensor:
        """latent [B, 48, 16, 16] -> float images [B, 64, 64, 3] in 0..1 (ComfyUI's IMAGE layout)."""
        return codec.decode_float(latent)

    @staticmethod
    def encode_image(images) -> torch.Tensor:
        """uint8 [B, 64, 64, 3] (or float 0..1) -> latent [B, 48, 16, 16]."""
        return codec.encode(images)

    def generate(self, prompts: Union[str, Sequence[str]], seed: int = 0, steps: Optional[int] = None,
                 cfg: Optional[float] = None, sampler: Optional[str] = None, scheduler: Optional[str] = None,
                 negative: str = "", callback=None) -> np.ndarray:
        """Prompts -> uint8 images [B, 64, 64, 3] through ``self.engine`` (see ``engine.open_demo``) and the engine's
        one text-to-image path (``Engine.pictures``); the settings not given are the model's own defaults."""
        if self.engine is None:
            raise RuntimeError("this DemoModel has no engine: open it with engine.open_demo()")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        latent = self.engine.pictures(BundledParts(self), prompts, [negative] * len(prompts), self.image_size,
                                      self.image_size, callback=callback, seed=seed, steps=steps or self.default_steps,
                                      cfg=self.default_cfg if cfg is None else cfg,
                                      sampler=sampler or self.default_sampler,
                                      scheduler=scheduler or self.default_scheduler)
        return self.decode(latent)


def is_demo_file(path: str) -> bool:
    """True if ``path`` is a safetensors file carrying the demo model's text encoder and vocabulary."""
    try:
        return DEMO_METADATA_KEY in open_file(path).metadata
    except Exception:
        return False


def has_demo_shapes(config) -> bool:
    """True when an ERNIE-Image DiT configuration is an embedded demo's (a GGUF / quantized copy of the demo or the
    demo-turbo, say): the demo's text encoder and pixel codec fit it, and it runs on the demo's CPU threads."""
    return embedded_with(config) is not None


def embedded_with(config) -> Optional[str]:
    """The embedded demo file whose DiT has ``config``, or None."""
    return next((path for path, own in _embedded_configs() if own == config), None)


@functools.lru_cache(maxsize=1)
def _embedded_configs() -> tuple:
    """(file, DiT configuration) of each embedded demo file shipped, from their headers (read once)."""
    return tuple((path, check_architecture(open_checkpoint(path))) for path in NAMED.values() if os.path.isfile(path))


_CACHE = {}


def load_demo(path: Optional[str] = None, dtype: Union[str, torch.dtype] = torch.float32, cached: bool = True) -> DemoModel:
    """Load the demo model (the shipped weights by default; "demo-turbo": the distilled one) on the CPU; cached per
    (path, dtype)."""
    path = os.fspath(named(path or DEMO_WEIGHTS))
    key = (os.path.abspath(path), str(dtype))
    if cached and key in _CACHE:
        return _CACHE[key]
    meta, te_state = read_demo_parts(path)
    tok = WordTokenizer(meta["vocab"])
    te = DemoTextEncoder(TextEncoderConfig(**meta["text_encoder"]))
    te.load_state_dict(te_state, strict=True)
    te.eval().requires_grad_(False)
    dit = read_model(path, dtype=dtype)
    demo = DemoModel(path, dit, te, tok, meta.get("train", {}), meta.get("sampling"))
    if cached:
        _CACHE[key] = demo
    return demo


BUNDLE = register_bundle(Bundle(
    name="demo", title="the demo model", image_size=IMAGE_SIZE, named=NAMED, load=load_demo,
    owns_config=has_demo_shapes, owns_metadata=is_demo_file,
    file_defaults=file_sampling_defaults, defaults={"steps": DEFAULT_STEPS, "cfg": DEFAULT_CFG}, threads=THREADS,
    latent_channels=LATENT_CHANNELS, preview_rgb_factors=codec.preview_rgb_factors,
    latent_hint=(f"the demo model makes {IMAGE_SIZE}x{IMAGE_SIZE} pictures only, from a latent of {LATENT_CHANNELS} "
                 f"channels at {LATENT_SIZE}x{LATENT_SIZE}: use SGLDiffusion Demo Empty Latent")))
