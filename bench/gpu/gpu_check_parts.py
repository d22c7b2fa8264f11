"""The GPU check's ``parts`` row (issue 46): the parts around the DiT that ``sgld generate`` / ``sgld serve`` / the
pipeline hold, measured beside bench/memory/parts.py's prediction (bench/RESULTS.md, "The whole pipeline on the
card"). The text encoder is the Ministral 3 3B text tower at its real shape with random bf16 weights (the 8B run;
the CPU rehearsal builds a 2-layer one), placed as ``--text-encoder-device auto`` places it: weights in host memory,
on the GPU only while a 256-token prompt is encoded; the Flux2 VAE (diffusers' own sizes, float32) decodes 1024²."""
import os
import re
import time

import torch

from bench.ministral import MINISTRAL_3B, CountOnly
from engine.models.external import Flux2VAE, TextEncoder

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "RESULTS.md")
TOKENS = 256  # bench/memory/predict.py PROMPT_TOKENS
TINY = dict(MINISTRAL_3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def predicted(path: str = RESULTS) -> dict:
    """bench/RESULTS.md's parts table: {"text encoder auto": GiB at its peak, "vae 1024": GiB decoding}."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\| text encoder \(.*\), `auto` \| [0-9.]+ \| ([0-9.]+) \|", line)
            if m:
                out["text encoder auto"] = float(m.group(1))
            m = re.match(r"\| Flux2 VAE decode 1024², tiled \(the default\) \| [0-9.]+ \| ([0-9.]+) \|", line)
            if m:
                out["vae 1024"] = float(m.group(1))
    return out


def row_parts(ctx):
    import diffusers
    import transformers
    from transformers.initialization import no_init_weights

    ctx.release()
    real = ctx.args.size == "8b"
    with no_init_weights():
        model = transformers.AutoModel.from_config(transformers.Ministral3Config(**(MINISTRAL_3B if real else TINY)),
                                                   dtype=torch.bfloat16).eval()
    with torch.no_grad():  # the values play no part in the memory (zeros: no seconds spent drawing 3.4B numbers)
        for p in model.parameters():
            p.zero_()
    te = TextEncoder(model, CountOnly(TOKENS), ctx.dev, "cpu", "auto")
    start = ctx.start_window()  # the row's memory above what is allocated now (GiB; None on a CPU)
    s = time.perf_counter()
    te.encode("a prompt")
    ctx.sync()
    encode_s, te_gib = time.perf_counter() - s, None if start is None else ctx.peak() - start
    del te, model
    vae_cfg = {} if real else dict(block_out_channels=(16, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=8)
    pixels = 1024 if real else 64
    with torch.device(ctx.dev):
        vae = diffusers.AutoencoderKLFlux2(**vae_cfg).eval()
    vae.enable_tiling()  # as Flux2VAE.load
    v = Flux2VAE(vae, ctx.dev)
    latent = torch.zeros(v.latent_shape(pixels, pixels), device=ctx.dev)
    start = ctx.start_window()
    s = time.perf_counter()
    v.decode(latent)
    ctx.sync()
    decode_s, vae_gib = time.perf_counter() - s, None if start is None else ctx.peak() - start
    del v, vae, latent
    ctx.release()
    pred = predicted()
    if te_gib is None:
        said = "no memory figure on a CPU"
    elif real:
        said = (f"text encoder peak {te_gib:.2f} GiB (predicted {pred.get('text encoder auto', float('nan')):.2f}), "
                f"VAE decode {vae_gib:.2f} GiB above its weights (predicted peak with them "
                f"{pred.get('vae 1024', float('nan')):.2f})")
    else:
        said = f"text encoder {te_gib:.2f} GiB, VAE {vae_gib:.2f} GiB (a small shape: no prediction to compare)"
    ctx.report.row("parts", "measured", f"text encoder ({'3B' if real else 'tiny'}, auto) + VAE decode {pixels}²",
                   None, encode_s + decode_s, te_gib, None,  # s per image: the parts' share of one
                   f"encode {encode_s:.2f} s (weights to the GPU and back), decode {decode_s:.2f} s; {said}",
                   te_peak_gib=te_gib, vae_peak_gib=vae_gib)
