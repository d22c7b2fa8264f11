"""Distil the demo into a Turbo-like demo: ``python -m tools.demo.distill_turbo [--minutes 90] [--out PATH]``.

ERNIE-Image-Turbo is its Base distilled to 8 steps at cfg 1; the demo-turbo is the demo distilled the same way, into
a student of the release's depth (36 blocks, narrow), so that skipping or reusing blocks costs and saves what it does
at the release (issue 45). Trajectory distillation: the teacher (the shipped demo, 30-step quality at cfg 3) runs
each prompt from noise along the student's own 8-step grid (ComfyUI's "simple" schedule, shift 3), 3 Euler sub-steps
of cfg 3 between two grid points (24 teacher steps); the student learns the one velocity that lands an Euler step of
cfg 1 exactly on the teacher's next point: v* = (x_{i+1} - x_i) / (sigma_{i+1} - sigma_i). Trajectories are made in
rounds beside the training (a buffer that keeps the most recent ones), so the student sees fresh prompts throughout.

The student shares the teacher's text encoder and vocabulary (frozen, copied into its file); the file has the demo's
layout and its sampling defaults in its own metadata (``demo_config.sampling``: 8 steps, cfg 1). Deterministic for a
seed and thread count; an EMA of the weights is saved every ``--save-every`` steps and at the time limit.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import numpy as np
import torch

from engine.models.demo import DEMO_WEIGHTS, load_demo
from engine.models.demo.weights_io import save_demo
from engine.models.ernie_image import ErnieImageConfig, ErnieImageTransformer
from engine.sampling import sigma_schedule, to_timestep

from . import data
from .train import init_dit, lr_at

TURBO_OUT = DEMO_WEIGHTS.replace("demo.safetensors", "demo-turbo.safetensors")
STEPS, CFG, TEACHER_CFG, SUB_STEPS = 8, 1.0, 3.0, 3
SAMPLING = {"steps": STEPS, "cfg": CFG, "sampler": "euler", "scheduler": "simple"}
HIDDEN, LAYERS, HEAD_DIM, FFN = 128, 36, 64, 384  # about the demo's parameters (7.7M), 9x its depth


def student_config(teacher: ErnieImageConfig) -> ErnieImageConfig:
    return ErnieImageConfig(hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=HIDDEN // HEAD_DIM,
                            ffn_hidden_size=FFN, in_channels=teacher.in_channels, out_channels=teacher.out_channels,
                            text_in_dim=teacher.text_in_dim, patch_size=teacher.patch_size,
                            rope_axes_dim=ErnieImageConfig.default_rope_axes(HEAD_DIM))


@torch.no_grad()
def trajectories(teacher, demo, captions, gen: torch.Generator, sigmas: torch.Tensor):
    """(points [N, STEPS + 1, C, h, w] on the student's grid, text [N, T, D], lens [N]) of the teacher's runs."""
    ids, lens = demo.tokenizer.batch(list(captions), demo.text_encoder.config.max_len)
    text = demo.text_encoder(ids, lens).float()
    empty_ids, empty_lens = demo.tokenizer.batch([""] * len(captions), demo.text_encoder.config.max_len)
    empty = demo.text_encoder(empty_ids, empty_lens).float()
    n = len(captions)
    x = torch.randn(n, *demo.empty_latent(1).shape[1:], generator=gen)
    both_text, both_lens = _pad_cat(text, lens, empty, empty_lens)
    points = [x]
    for i in range(STEPS):
        for s_from, s_to in zip(*_sub_grid(sigmas[i], sigmas[i + 1])):
            t = to_timestep(torch.full((2 * n,), float(s_from)))
            v = teacher(torch.cat([x, x]), t, both_text, both_lens).float()
            v_cond, v_uncond = v[:n], v[n:]
            x = x + (v_uncond + TEACHER_CFG * (v_cond - v_uncond)) * (s_to - s_from)
        points.append(x)
    return torch.stack(points, 1), text, lens


def _sub_grid(a: torch.Tensor, b: torch.Tensor):
    edges = torch.linspace(float(a), float(b), SUB_STEPS + 1)
    return edges[:-1], edges[1:]


def _pad_cat(a, a_lens, b, b_lens):
    t = max(a.shape[1], b.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, t - x.shape[1]))  # noqa: E731
    return torch.cat([pad(a), pad(b)]), torch.cat([a_lens, b_lens])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=120.0, help="wall-clock budget of the whole run")
    ap.add_argument("--round", type=int, default=32, help="prompts whose teacher trajectories one round makes")
    ap.add_argument("--buffer", type=int, default=4096, help="trajectories kept (the most recent)")
    ap.add_argument("--train-per-round", type=int, default=16, help="optimizer steps between two rounds")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ema", type=float, default=0.998)
    ap.add_argument("--planned-steps", type=int, default=4000, help="length of the lr schedule")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--out", default=TURBO_OUT)
    ap.add_argument("--init", default=None, help="a demo-turbo file to go on from (its weights; a fresh optimizer)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    demo = load_demo(cached=False)
    teacher = demo.dit.eval()
    student = ErnieImageTransformer(student_config(teacher.config))
    init_dit(student)
    if args.init:
        student.load_state_dict(load_demo(args.init, cached=False).dit.state_dict())
    student.train()
    ema = copy.deepcopy(student).requires_grad_(False)
    params = list(student.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99))
    sigmas = sigma_schedule(STEPS, SAMPLING["scheduler"])
    print(f"demo-turbo: student {sum(p.numel() for p in params) / 1e6:.2f}M params {student.config.to_dict()}; "
          f"grid {[round(float(s), 4) for s in sigmas]}", flush=True)
    buffer = {"points": [], "text": [], "lens": []}
    start, step, losses, info = time.time(), 0, [], {}
    while True:
        seeds = rng.integers(0, data.HELD_OUT_SEED_START, size=args.round)
        points, text, lens = trajectories(teacher, demo, data.batch(seeds)[1], gen, sigmas)
        for key, value in (("points", points), ("text", text), ("lens", lens)):
            buffer[key] = (buffer[key] + list(value))[-args.buffer:]
        n = len(buffer["points"])
        for _ in range(args.train_per_round):
            pick = torch.randint(0, n, (args.batch,), generator=gen)
            i = torch.randint(0, STEPS, (args.batch,), generator=gen)
            pts = torch.stack([buffer["points"][int(j)] for j in pick])  # [B, STEPS + 1, C, h, w]
            x_i, x_next = pts[torch.arange(args.batch), i], pts[torch.arange(args.batch), i + 1]
            s_i, s_next = sigmas[i], sigmas[i + 1]
            target = (x_next - x_i) / (s_next - s_i).view(-1, 1, 1, 1)
            tl = [buffer["text"][int(j)] for j in pick]
            lens_b = torch.stack([buffer["lens"][int(j)] for j in pick])
            width = max(int(t.shape[0]) for t in tl)
            text_b = torch.stack([torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[0])) for t in tl])
            v = student(x_i, to_timestep(s_i), text_b, lens_b).float()
            loss = ((v - target) ** 2).mean()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.planned_steps, args.lr, args.warmup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            d = min(args.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), params, 1 - d)
            losses.append(loss.item())
            step += 1
            elapsed = time.time() - start
            if step % 25 == 0:
                print(f"step {step:5d} loss {np.mean(losses[-25:]):.4f} buffer {n} {elapsed / 60:.1f} min", flush=True)
            info = {"steps": step, "planned_steps": args.planned_steps, "batch": args.batch, "seed": args.seed,
                    "final_loss": float(np.mean(losses[-100:])), "train_minutes": round(elapsed / 60, 2),
                    "threads": args.threads, "teacher": "demo.safetensors", "teacher_cfg": TEACHER_CFG,
                    "teacher_steps": STEPS * SUB_STEPS, "method": "trajectory distillation",
                    "train_per_round": args.train_per_round, "lr": args.lr, "init_from": args.init}
            done = elapsed > args.minutes * 60 or step >= args.planned_steps
            if step % args.save_every == 0 or done:
                save_demo(args.out, ema, demo.text_encoder, demo.tokenizer, demo.text_encoder.config, info,
                          sampling=SAMPLING)
            if done:
                print(f"saved {args.out}: {json.dumps(info)}", flush=True)
                return


if __name__ == "__main__":
    main()
