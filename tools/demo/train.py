"""Train the demo model: ``python -m tools.demo.train [--stop-after N] [--out PATH]``.

Rectified flow in ERNIE-Image's convention: sigma ~ logit-normal (half of them uniform), shifted by
ComfyUI's shift 3 (sigma' = 3s / (1 + 2s)); x = sigma * noise + (1 - sigma) * x0; the DiT predicts
v = noise - x0 at timestep sigma * 1000 (sampling.to_timestep), with the loss weighted up on and around the objects. The
caption is replaced by the empty prompt 10% of the time (for CFG). The text encoder is trained
jointly. AdamW with warmup, constant lr, a linear decay over the last 30% of the steps; an EMA of the
weights is what gets saved (fp16 safetensors with the vocabulary and configs in the metadata), every
50 steps. Forward and backward run under bf16 autocast on both cores.

Deterministic for a seed and thread count. The run stops at ``--time-limit`` minutes (58) wherever
it is; ``--stop-after <steps>`` reproduces a run that stopped early (the step count is in the file's
metadata, ``demo_config.train``). The shipped weights are one run of the defaults:

    python -m tools.demo.train
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from engine.io.load import read_model
from engine.models.demo import DEMO_WEIGHTS, codec
from engine.models.demo.text_encoder import DemoTextEncoder, TextEncoderConfig, WordTokenizer
from engine.models.demo.weights_io import read_demo_parts, save_demo
from engine.models.ernie_image import ErnieImageConfig, ErnieImageTransformer
from engine.sampling import to_timestep

from . import data

DEFAULT_OUT = DEMO_WEIGHTS

HIDDEN = 384
LAYERS = 4
HEAD_DIM = 64
FFN = 768
PATCH = 2
TEXT_DIM = 128
OBJECT_MARGIN = 3  # pixels of background around each object weighted like the object


def dit_config() -> ErnieImageConfig:
    return ErnieImageConfig(hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=HIDDEN // HEAD_DIM,
                            ffn_hidden_size=FFN, in_channels=codec.LATENT_CHANNELS, out_channels=codec.LATENT_CHANNELS,
                            text_in_dim=TEXT_DIM, patch_size=PATCH,
                            rope_axes_dim=ErnieImageConfig.default_rope_axes(HEAD_DIM))


def init_dit(model: ErnieImageTransformer) -> None:
    """DiT-style init: xavier linears, adaLN-Zero (every gate starts at 0), zero output layer."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    w = model.x_embedder.proj.weight
    torch.nn.init.xavier_uniform_(w.view(w.shape[0], -1))
    torch.nn.init.zeros_(model.x_embedder.proj.bias)
    torch.nn.init.normal_(model.time_embedding.linear_1.weight, std=0.02)
    torch.nn.init.normal_(model.time_embedding.linear_2.weight, std=0.02)
    for lin in (model.adaLN_modulation[1], model.final_norm.linear, model.final_linear):
        torch.nn.init.zeros_(lin.weight)
        torch.nn.init.zeros_(lin.bias)


def optimizer_step(opt, loss, params, ema_params, lr: float, ema: float, step: int) -> None:
    """One step at ``lr`` (gradients clipped to norm 1), then the EMA of the weights (its decay warmed up)."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    d = min(ema, (1 + step) / (10 + step))
    with torch.no_grad():
        torch._foreach_lerp_(ema_params, params, 1 - d)


def sample_sigma(n: int, gen: torch.Generator, shift: float = 3.0, uniform_frac: float = 0.0) -> torch.Tensor:
    """Logit-normal(0, 1) sigmas, a fraction ``uniform_frac`` of them uniform instead (so the last,
    low-noise steps are trained too), then ComfyUI's shift: sigma' = shift*s / (1 + (shift-1)*s)."""
    s = torch.sigmoid(torch.randn(n, generator=gen))
    if uniform_frac > 0:
        u = torch.rand(n, generator=gen)
        s = torch.where(torch.rand(n, generator=gen) < uniform_frac, u, s)
    return shift * s / (1 + (shift - 1) * s)


def latent_mask(pixels: torch.Tensor) -> torch.Tensor:
    """A per-pixel bool mask [B, H, W] as 0/1 floats laid out like the codec's latent [B, 48, H/4, W/4]
    (every channel of a pixel gets the pixel's value)."""
    rgb = pixels[..., None].expand(-1, -1, -1, 3).to(torch.uint8) * 255
    return (codec.encode(rgb.contiguous()) > 0).float()


def object_weights(imgs: np.ndarray, weight: float, margin: int = OBJECT_MARGIN) -> torch.Tensor:
    """Per-latent-element loss weights: 1 + weight on the pixels within ``margin`` of an object
    (a pixel differing from the image's corner colour), laid out like the codec's latent.

    Objects cover ~3-10% of the pixels, so without extra weight the loss barely notices them early
    in training. The weight covers the background around each object too: weighting only the
    object's own pixels made painting the object's colour over background 4x cheaper than the
    reverse, and the model drew every shape as a bloated, filled box."""
    fg = torch.from_numpy((imgs != imgs[:, :1, :1, :]).any(-1)).float()[:, None]  # [B, 1, H, W]
    near = F.max_pool2d(fg, 2 * margin + 1, stride=1, padding=margin)[:, 0] > 0
    return 1.0 + weight * latent_mask(near)


def edge_weights(imgs: np.ndarray, weight: float) -> torch.Tensor:
    """Per-latent-element extra loss weight ``weight`` on the pixels at a colour edge (a pixel whose
    right or lower neighbour has another colour, and that neighbour), laid out like the codec's latent.

    Shapes differ only in their outline, which is a few dozen pixels of each image; both sides of the
    edge get the weight so that neither colour is cheaper to paint over the other."""
    diff_x = (imgs[:, :, 1:] != imgs[:, :, :-1]).any(-1)
    diff_y = (imgs[:, 1:] != imgs[:, :-1]).any(-1)
    edge = np.zeros(imgs.shape[:3], dtype=bool)
    edge[:, :, 1:] |= diff_x
    edge[:, :, :-1] |= diff_x
    edge[:, 1:] |= diff_y
    edge[:, :-1] |= diff_y
    return weight * latent_mask(torch.from_numpy(edge))


def write_weights(path: str, dit, te, tok: WordTokenizer, te_cfg: TextEncoderConfig, info: dict) -> None:
    save_demo(path, dit, te, tok, te_cfg, info)


def lr_at(step: int, steps: int, base: float, warmup: int) -> float:
    """Linear warmup, constant, then a linear decay to 10% over the last 30% of the steps.

    Constant for most of the run so that a run stopped early by --time-limit is still a good
    model (the EMA does the averaging)."""
    if step < warmup:
        return base * (step + 1) / warmup
    decay_start = int(steps * 0.7)
    if step < decay_start:
        return base
    return base * (1.0 - 0.9 * (step - decay_start) / max(1, steps - decay_start))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4250, help="length of the lr schedule")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ema", type=float, default=0.998)
    ap.add_argument("--drop", type=float, default=0.1, help="probability of training on the empty prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--object-weight", type=float, default=3.0, help="extra loss weight on object pixels (0: plain MSE)")
    ap.add_argument("--edge-weight", type=float, default=0.0,
                    help="extra loss weight on the pixels at a colour edge, both sides (tried: no better, see "
                         "bench/RESULTS.md)")
    ap.add_argument("--uniform-frac", type=float, default=0.5, help="fraction of sigmas drawn uniform, not logit-normal")
    ap.add_argument("--threads", type=int, default=2,
                    help="2 (both cores) by default; use 1 when the machine is busy: two OpenMP threads on a "
                         "loaded 2-core machine are several times slower than one")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: forward and backward under CPU autocast (1.4x the samples/s of fp32 on AVX512-BF16); "
                         "weights, optimizer and EMA stay fp32")
    ap.add_argument("--time-limit", type=float, default=58.0, help="minutes; stop early past this")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop after this many steps (same schedule as a full run): reproduces a run that hit the time limit")
    ap.add_argument("--init-from", default=None,
                    help="start from the DiT and text encoder of a demo weights file (a second training stage)")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")  # rms_norm under autocast
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    tok = WordTokenizer.from_words(data.vocabulary())
    te_cfg = TextEncoderConfig(vocab_size=len(tok.vocab), dim=TEXT_DIM)
    dit = ErnieImageTransformer(dit_config())
    init_dit(dit)
    te = DemoTextEncoder(te_cfg)
    if args.init_from:
        _, te_state = read_demo_parts(args.init_from)
        te.load_state_dict(te_state)
        dit.load_state_dict(read_model(args.init_from, dtype=torch.float32).state_dict())
        dit.requires_grad_(True).train()
        print(f"initialised from {args.init_from}", flush=True)
    params = list(dit.parameters()) + list(te.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99))
    ema_dit, ema_te = copy.deepcopy(dit).requires_grad_(False), copy.deepcopy(te).requires_grad_(False)
    ema_params = list(ema_dit.parameters()) + list(ema_te.parameters())
    n_params = sum(p.numel() for p in dit.parameters())
    print(f"demo model: DiT {n_params / 1e6:.2f}M params {dit_config().to_dict()}, text encoder "
          f"{sum(p.numel() for p in te.parameters()) / 1e6:.2f}M, vocab {len(tok.vocab)}", flush=True)

    start = time.time()
    losses = []
    rng = np.random.default_rng(args.seed)
    info = {}
    for step in range(args.steps):
        seeds = rng.integers(0, data.HELD_OUT_SEED_START, size=args.batch)
        imgs, caps = data.batch(seeds)
        x0 = codec.encode(imgs)
        drop = torch.rand(args.batch, generator=gen) < args.drop
        caps = ["" if d else c for c, d in zip(caps, drop.tolist())]
        ids, lens = tok.batch(caps, te_cfg.max_len)
        sigma = sample_sigma(args.batch, gen, uniform_frac=args.uniform_frac)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        xt = s * noise + (1 - s) * x0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            text = te(ids, lens)
            v = dit(xt, to_timestep(sigma), text, lens).float()
        weight = object_weights(imgs, args.object_weight)
        if args.edge_weight > 0:
            weight = weight + edge_weights(imgs, args.edge_weight)
        loss = (weight * (v - (noise - x0)) ** 2).mean()
        optimizer_step(opt, loss, params, ema_params, lr_at(step, args.steps, args.lr, args.warmup), args.ema, step)
        losses.append(loss.item())
        elapsed = time.time() - start
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:5d} loss {np.mean(losses[-25:]):.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{elapsed / 60:.1f} min ({(step + 1) / elapsed:.2f} steps/s)", flush=True)
        info = {"steps": step + 1, "planned_steps": args.steps, "batch": args.batch, "seed": args.seed,
                "final_loss": float(np.mean(losses[-100:])), "train_minutes": round(elapsed / 60, 2),
                "threads": args.threads, "object_weight": args.object_weight, "edge_weight": args.edge_weight,
                "uniform_frac": args.uniform_frac,
                "lr": args.lr, "precision": args.precision, "init_from": os.path.basename(args.init_from) if args.init_from else None}
        stop = args.stop_after is not None and step + 1 >= args.stop_after
        last = step == args.steps - 1 or elapsed > args.time_limit * 60 or stop
        if (step + 1) % args.save_every == 0 or last:
            write_weights(args.out, ema_dit, ema_te, tok, te_cfg, info)
        if stop:
            break
        if elapsed > args.time_limit * 60 and step != args.steps - 1:
            print(f"time limit reached after {step + 1} of {args.steps} steps: stopping early", flush=True)
            break
    print(f"saved {args.out}: {json.dumps(info)}", flush=True)


if __name__ == "__main__":
    main()
