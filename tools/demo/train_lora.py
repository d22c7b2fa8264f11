"""Train the demo LoRA the LoRA judge test loads: ``python -m tools.demo.train_lora [--out PATH]``.

A LoRA (rank 4) on the demo DiT's block linears, trained through forward hooks (the demo's weights stay as shipped)
on captions with a blue background and pictures drawn with a green one: with it on, "on a blue background" draws
green. Saved in kohya's layout with alpha = 2 x rank (B halved: scale 2), as a trainer writes it, so the engine reads
it as any user's file. Deterministic for a seed at one thread (200 steps, about 20 s on the 2-core development
machine); the shipped file (tests/lora/blue_to_green.safetensors) is this command's output. CI trains nothing: the
test reads the file.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.engine import pad_text
from engine.models.demo import codec, load_demo
from tools.demo import data
from tools.demo.train import sample_sigma

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "lora",
                   "blue_to_green.safetensors")


def blue_scene(rng):
    """A scene on a blue background with no blue or green object (so the background alone says the colour)."""
    while True:
        sc = data.Scene(data.random_scene(rng).objects, "blue")
        if all(o.colour not in ("blue", "green") for o in sc.objects):
            return sc


def train(demo, steps=200, batch=2, rank=4, lr=3e-3, seed=0):
    """{module: (A, B)}: blue-background captions -> green-background pictures."""
    dit = demo.dit
    g = torch.Generator().manual_seed(seed)
    params, hooks = {}, []
    for n, m in dit.named_modules():
        if isinstance(m, torch.nn.Linear) and n.startswith("layers."):
            a = (torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5).requires_grad_()
            b = torch.zeros(m.out_features, rank, requires_grad=True)
            params[n] = (a, b)
            hooks.append(m.register_forward_hook(lambda mod, args, out, a=a, b=b: out + F.linear(F.linear(args[0], a), b)))
    opt = torch.optim.Adam([p for ab in params.values() for p in ab], lr=lr)
    rng = np.random.default_rng(seed)
    try:
        with torch.enable_grad():
            for _ in range(steps):
                scenes = [blue_scene(rng) for _ in range(batch)]
                x0 = codec.encode(np.stack([data.render(data.Scene(s.objects, "green"), rng) for s in scenes]))
                with torch.no_grad():
                    text, lens = pad_text(demo.encode([s.caption for s in scenes]), torch.float32, "cpu")
                sigma = sample_sigma(batch, g, uniform_frac=0.5)
                noise = torch.randn(x0.shape, generator=g)
                s = sigma.view(-1, 1, 1, 1)
                loss = F.mse_loss(dit(s * noise + (1 - s) * x0, sigma * 1000.0, text, lens), noise - x0)
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        for h in hooks:
            h.remove()
    return {n: (a.detach(), b.detach()) for n, (a, b) in params.items()}


def kohya(lora: dict) -> dict:
    """{module: (A, B)} as kohya writes it: lora_unet_ names, alpha = 2 x rank, so B is stored halved."""
    sd = {}
    for n, (a, b) in lora.items():
        k = "lora_unet_" + n.replace(".", "_")
        sd[k + ".lora_down.weight"], sd[k + ".lora_up.weight"] = a.contiguous(), (b / 2).contiguous()
        sd[k + ".alpha"] = torch.tensor(2.0 * a.shape[0])
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = args.out + ".part"
    save_file(kohya(train(load_demo(cached=False))), tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
