"""Parity of our DiT with diffusers 0.42.1 on the test configurations: max abs error / max |ref|.

    .venv/bin/python bench/eval/parity_table.py
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_model_parity import CONFIGS, diffusers_model, inputs  # noqa: E402

from bench.metrics import max_rel_err  # noqa: E402
from engine.models.random_weights import random_model, random_state_dict  # noqa: E402


def main():
    print("| config | latent | text lens | fp32 err | bf16 err |")
    print("|---|---|---|---|---|")
    for name, (cfg, h, w, lens) in CONFIGS.items():
        errs = []
        for dtype in (torch.float32, torch.bfloat16):
            ours = random_model(cfg, seed=3, dtype=dtype)
            ref = diffusers_model(cfg, random_state_dict(cfg, seed=3), dtype)
            x, t, text, text_lens = inputs(cfg, h, w, lens, dtype)
            with torch.no_grad():
                a = ours(x, t, text, text_lens).float()
                b = ref(x, t, text, text_lens, return_dict=False)[0].float()
            errs.append(max_rel_err(a, b))
        print(f"| {name} (hidden {cfg.hidden_size}, {cfg.num_layers} layers, patch {cfg.patch_size}) | "
              f"{len(lens)}×{cfg.in_channels}×{h}×{w} | {lens} | {errs[0]:.1e} | {errs[1]:.1e} |")


if __name__ == "__main__":
    main()
