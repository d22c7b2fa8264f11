"""Thumbnails for the template browser: ``workflows/<name>.jpg`` next to each ``workflows/<name>.json``.

ComfyUI's frontend shows a pack's workflows as template cards with the image
``/api/workflow_templates/<pack folder>/<name>.jpg`` (always .jpg for custom-node templates, frontend
1.32 to 1.58) and the file name as title and description. The demo workflow's card is the demo's
real output for the workflow's own prompt and settings (64x64, enlarged 8x without smoothing); each
model workflow's card (ERNIE-Image, Z-Image) is a text card headed by its own name (the weights are not here to draw a picture).

    .venv/bin/python scripts/workflow_thumbnails.py     # rewrites every thumbnail
"""
from __future__ import annotations

import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 512
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
FONT_BOLD = "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf"


def linked_node(wf: dict, node: dict, input_name: str) -> dict:
    """The node whose output feeds ``node``'s input ``input_name`` in a UI-format workflow."""
    link = next(i["link"] for i in node["inputs"] if i["name"] == input_name)
    origin = next(lk[1] for lk in wf["links"] if lk[0] == link)
    return next(n for n in wf["nodes"] if n["id"] == origin)


def demo_settings(wf: dict) -> dict:
    """Prompt, negative prompt, sampler settings and cache preset of the demo workflow."""
    ks = next(n for n in wf["nodes"] if n["type"] == "SGLDiffusionKSampler")
    seed, _control, steps, cfg, sampler, scheduler, denoise = ks["widgets_values"]
    cache = linked_node(wf, ks, "cache")
    enabled, preset, advanced = cache["widgets_values"][:3]
    assert enabled and not advanced, "the thumbnail follows the cache preset only"
    return {"prompt": linked_node(wf, ks, "positive")["widgets_values"][0],
            "negative": linked_node(wf, ks, "negative")["widgets_values"][0],
            "seed": seed, "steps": steps, "cfg": cfg, "sampler": sampler, "scheduler": scheduler, "denoise": denoise,
            "preset": preset}


def demo_image(settings: dict):
    """The demo's picture for these settings, as SGLDiffusion KSampler + Demo Decode make it (uint8 [64, 64, 3])."""
    import numpy as np
    import torch

    from engine import EngineConfig, open_engine
    from engine.features.cache import CacheConfig
    from engine.models.demo import DEMO_WEIGHTS, DemoModel, load_demo

    demo = load_demo()
    engine = open_engine(DEMO_WEIGHTS, EngineConfig(dtype="fp32", device="cpu"))  # the loader's choice for the demo
    with torch.inference_mode():
        latent = engine.sample(DemoModel.empty_latent(1), demo.encode([settings["prompt"]]), demo.encode([settings["negative"]]),
                               seed=settings["seed"], steps=settings["steps"], cfg=settings["cfg"], sampler=settings["sampler"],
                               scheduler=settings["scheduler"], denoise=settings["denoise"],
                               cache=CacheConfig(enabled=True, preset=settings["preset"]))
        image = DemoModel.decode_float(latent.float())[0]
    return np.clip(255.0 * image.numpy(), 0, 255).astype(np.uint8)  # as ComfyUI's SaveImage converts


def font(path: str, size: int):
    from PIL import ImageFont

    return ImageFont.truetype(path, size) if os.path.exists(path) else ImageFont.load_default(size)


def text_card(title: str, lines: list):
    """A dark card with the workflow's name and what it runs and needs."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), (28, 33, 43))
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, SIZE, 10], fill=(74, 158, 255))
    y = 150
    for part in title.split("\n"):
        d.text((40, y), part, font=font(FONT_BOLD, 46), fill=(240, 240, 240))
        y += 58
    y += 20
    for line in lines:
        d.text((40, y), line, font=font(FONT, 24), fill=(175, 185, 200))
        y += 36
    d.text((40, 44), "SGLDiffusion for ComfyUI", font=font(FONT, 22), fill=(110, 170, 255))  # the bottom: the card's tag
    return img


def card_text(name: str, wf: dict) -> tuple:
    """(title, lines) of a model workflow's card: headed by the workflow's own name (its file's, as the
    template browser titles the card), then the model it runs, its settings and sampler, and what it needs."""
    model = wf["extra"]["sgldiffusion"]
    sampler = "ComfyUI KSampler + Cache-DiT" if "sampler" in model else "SGLDiffusion KSampler"  # MODEL path or ours
    return name.replace(" ", "\n", 1), [model["model"], f"{model['steps']} steps, cfg {model['cfg']:g}, 1024 x 1024",
                                        sampler, f"needs the {model['model'].split()[0]} model files"]


def thumbnail(path: str):
    from PIL import Image

    with open(path) as f:
        wf = json.load(f)
    name = os.path.splitext(os.path.basename(path))[0]
    if "demo" in name:
        pixels = demo_image(demo_settings(wf))
        return Image.fromarray(pixels).resize((SIZE, SIZE), Image.NEAREST)
    return text_card(*card_text(name, wf))


def main() -> int:
    sys.path.insert(0, ROOT)
    for path in sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json"))):
        out = os.path.splitext(path)[0] + ".jpg"
        tmp = out + ".part"
        thumbnail(path).save(tmp, "JPEG", quality=92)
        os.replace(tmp, out)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
