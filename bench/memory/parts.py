"""The parts around the DiT on the fake GPU, and the whole pipeline's peak (issue 46).

``sgld generate``, ``sgld serve`` and ``ErnieImagePipeline`` hold more than the DiT: ERNIE-Image's text encoder (the
Ministral 3 3B text tower) and the Flux2 VAE. Each part is traced here at its real shape through its own code
(``TextEncoder.encode`` with the placement the entry point gives it, ``Flux2VAE.decode`` whole and tiled), and the
whole pipeline's peak is composed from the three phases of a run, as those entry points order them:

1. encode: the DiT and the VAE are loaded; the text encoder computes (on the GPU, ``auto`` / ``resident``);
2. sample: the DiT's own predicted peak (predict.py), beside the VAE and, when ``resident``, the text encoder;
3. decode: the DiT's weights stay; the VAE decodes.

Not traced: the tokenizer (a stand-in gives the prompt's token count: the Tekken files are not available offline)
and the Pixtral vision tower a release folder also loads (unused; ComfyUI's single file has none).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Optional

import torch
from predict import PROMPT_TOKENS, Setup, predict_cached
from rehearse import GiB, Rehearsal

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # bench/ as a package
from bench.ministral import MINISTRAL_3B, CountOnly  # noqa: E402
from bench.results_md import write_section  # noqa: E402
from engine.models.external import Flux2VAE, TextEncoder, move_weights  # noqa: E402
from engine.models.prompt_enhancer import DEFAULT_MAX_NEW_TOKENS  # noqa: E402

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


@dataclasses.dataclass
class PartPeak:
    weights_bytes: int  # on the GPU between uses (0: on the host)
    peak_bytes: int  # while it works


@functools.lru_cache(maxsize=None)
def text_encoder(placement: str = "auto", tokens: int = PROMPT_TOKENS) -> PartPeak:
    """The text encoder encoding one prompt of ``tokens`` on the GPU, placed as ``--text-encoder-device`` says:
    ``auto`` traced (the weights come from the host, compute, go back); ``resident`` holds the same weights between
    prompts and peaks as high; ``cpu`` holds nothing on the GPU."""
    if placement == "cpu":
        return PartPeak(0, 0)
    if placement == "resident":
        return PartPeak(_text_encoder_weights(), text_encoder("auto", tokens).peak_bytes)
    import transformers
    from transformers.initialization import no_init_weights

    with Rehearsal() as r:
        with r.all_fake(), no_init_weights():  # shapes only, on the host: the loader's way, without the file
            model = transformers.AutoModel.from_config(transformers.Ministral3Config(**MINISTRAL_3B),
                                                       dtype=torch.bfloat16).eval()
        r.name_modules(model, "text_encoder.")
        te = TextEncoder(model, CountOnly(tokens), "cuda", "cpu", placement)
        resting = r.tracker.live
        r.tracker.reset_peak()
        with torch.inference_mode():
            te.encode("a prompt")
        return PartPeak(resting, r.tracker.peak.bytes)


PE_PROMPT_TOKENS = 512  # the PE's chat template (its system prompt) and the user's prompt


@functools.lru_cache(maxsize=None)
def prompt_enhancer(new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> PartPeak:
    """The prompt enhancer (a causal LM on the same 3B backbone, bf16) writing on the GPU, as ``enhance`` places it
    (the weights come from the host for its prompts). Generation reads each token back on the host, which a trace
    cannot; its peak is bounded by one forward over the whole text, ``PE_PROMPT_TOKENS`` + ``new_tokens`` (the KV
    cache of its last step, the MLP's work over every position) keeping the last token's logits, as generate does."""
    import transformers
    from transformers.initialization import no_init_weights

    with Rehearsal() as r:
        with r.all_fake(), no_init_weights():
            model = transformers.AutoModelForCausalLM.from_config(transformers.Ministral3Config(**MINISTRAL_3B),
                                                                  dtype=torch.bfloat16).eval()
        r.name_modules(model, "pe.")
        r.tracker.reset_peak()
        with torch.inference_mode():
            move_weights(model, "cuda")
            ids = torch.ones(1, PE_PROMPT_TOKENS + new_tokens, dtype=torch.long, device="cuda")
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return PartPeak(0, r.tracker.peak.bytes)


def _text_encoder_weights() -> int:
    """Bytes of the text tower's weights in bf16, counted on the meta device."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModel.from_config(transformers.Ministral3Config(**MINISTRAL_3B), dtype=torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@functools.lru_cache(maxsize=None)
def vae(pixels: int, tiled: bool = True) -> PartPeak:
    """The Flux2 VAE (diffusers' AutoencoderKLFlux2 at its own sizes, float32) decoding one ``pixels``² picture."""
    import diffusers

    with Rehearsal() as r:
        with r.all_fake(), torch.device("cuda"):
            model = diffusers.AutoencoderKLFlux2().eval()
        if tiled:
            model.enable_tiling()  # as Flux2VAE.load does
        r.name_modules(model, "vae.")
        v = Flux2VAE(model, "cuda")
        resting = r.tracker.live
        r.tracker.reset_peak()
        with torch.inference_mode():
            v.decode(torch.zeros(v.latent_shape(pixels, pixels), device="cuda"))
        return PartPeak(resting, r.tracker.peak.bytes)


@dataclasses.dataclass
class Whole:
    label: str
    peak_bytes: int
    phase: str  # the phase that sets the peak: "encode", "sample" or "decode"
    dit_peak_bytes: int


def whole(setup: Setup, pixels: int, placement: str = "auto", tiled: bool = True,
          layers: Optional[int] = None, dit: Optional[object] = None, pe: bool = False) -> Whole:
    """The whole pipeline's peak for ``setup`` at ``pixels``²: the largest of its phases. ``pe``: the prompt
    enhancer writes first, beside the loaded DiT and VAE as ``sgld serve`` and the pipeline hold them (``sgld
    generate`` runs it before the DiT loads: the PE's own peak, lower)."""
    p = dit or predict_cached(setup, pixels, layers=layers)
    te = text_encoder(placement)
    v = vae(pixels, tiled)
    # a server encodes (and enhances) a new request's prompt while the batch it has sampling goes on
    beside = p.peak_bytes if setup.served else p.weights_bytes
    phases = {"encode": beside + v.weights_bytes + te.peak_bytes,
              "sample": p.peak_bytes + v.weights_bytes + te.weights_bytes,
              "decode": p.weights_bytes + te.weights_bytes + v.peak_bytes}
    if pe:  # "cpu": the PE writes on the host too (--pe-device cpu, or no room beside the DiT)
        phases["enhance"] = beside + v.weights_bytes + te.weights_bytes + (
            0 if placement == "cpu" else prompt_enhancer().peak_bytes)
    phase = max(phases, key=phases.get)
    label = f"{setup.label}, text encoder {placement}" + (", with --pe" if pe else "")
    return Whole(label, phases[phase], phase, p.peak_bytes)


# (DiT setup, text encoder placement): the README's cards' rows (Turbo bf16 24 GB, fp8 16, fp8 + offload 12, bf16 +
# offload 2 buffers 8) with the placement that fits them, and the resident text encoder beside for comparison
WHOLE_ROWS = [
    (Setup("Turbo bf16", model="turbo"), "auto"),
    (Setup("Turbo bf16", model="turbo"), "resident"),
    (Setup("Turbo fp8", model="turbo", quant="fp8"), "auto"),
    (Setup("Turbo fp8, offload 2 buffers", model="turbo", quant="fp8", offload="layerwise"), "auto"),
    (Setup("Turbo bf16, offload 2 buffers", model="turbo", offload="layerwise"), "auto"),
    (Setup("Base bf16"), "auto"),
    (Setup("Turbo bf16, served batch of 8 jobs (sgld serve's --max-batch)", model="turbo", served=8), "auto"),
    (Setup("Turbo bf16, served, one job", model="turbo", served=1), "auto"),
]
PE_ROWS = [  # the same with the prompt enhancer (--pe)
    (Setup("Turbo bf16", model="turbo"), "auto"),
    (Setup("Turbo fp8", model="turbo", quant="fp8"), "auto"),
    (Setup("Turbo fp8, offload 2 buffers", model="turbo", quant="fp8", offload="layerwise"), "auto"),
    (Setup("Turbo bf16, served, one job", model="turbo", served=1), "auto"),
]


def parts_table() -> str:
    te_auto, te_res = text_encoder("auto"), text_encoder("resident")
    lines = ["| part | on the GPU between uses GiB | peak while it works GiB |", "|---|---|---|",
             f"| text encoder (Ministral 3 3B text tower, bf16, {PROMPT_TOKENS} tokens), `auto` | "
             f"{te_auto.weights_bytes / GiB:.2f} | {te_auto.peak_bytes / GiB:.2f} |",
             f"| text encoder, `resident` | {te_res.weights_bytes / GiB:.2f} | {te_res.peak_bytes / GiB:.2f} |",
             f"| prompt enhancer (3B causal LM, bf16, {PE_PROMPT_TOKENS} + {DEFAULT_MAX_NEW_TOKENS} tokens: its bound) | "
             f"0.00 | {prompt_enhancer().peak_bytes / GiB:.2f} |"]
    for px in (1024, 2048):
        for tiled in (False, True):
            v = vae(px, tiled)
            lines.append(f"| Flux2 VAE decode {px}², {'tiled (the default)' if tiled else 'whole'} | "
                         f"{v.weights_bytes / GiB:.2f} | {v.peak_bytes / GiB:.2f} |")
    return "\n".join(lines)


def whole_table(layers: Optional[int] = None, log=print) -> str:
    from table import CARDS, fits

    head = ("| DiT configuration, text encoder | image | whole pipeline peak GiB | set by | DiT alone GiB | "
            + " | ".join(f"{c} GB" for c in CARDS) + " |\n|---|---|---|---|---|" + "---|" * len(CARDS))
    lines = [head]
    for (setup, placement), pe in [(row, False) for row in WHOLE_ROWS] + [(row, True) for row in PE_ROWS]:
        for px in (1024, 2048):
            w = whole(setup, px, placement, layers=layers, pe=pe)
            # auto encodes (and the PE writes) on the CPU where the GPU has no room beside the DiT (room_on)
            on_host = whole(setup, px, "cpu", layers=layers, pe=pe) if placement == "auto" else w
            there = "yes, the PE and text encoder on the CPU" if pe else "yes, encoding on the CPU"
            marks = " | ".join("yes" if fits(w.peak_bytes, c) else (there if fits(on_host.peak_bytes, c) else "-")
                               for c in CARDS)
            lines.append(f"| {w.label} | {px}² | {w.peak_bytes / GiB:.2f} | {w.phase} | {w.dit_peak_bytes / GiB:.2f} "
                         f"| {marks} |")
            log(f"{w.label} {px}²: {w.peak_bytes / GiB:.2f} GiB ({w.phase})")
    return "\n".join(lines)


# The README's card table (issue 46, item 3): per card, what SGLDiffusion Model Loader and what ``sgld`` / the
# pipeline should be given, each traced; a row that stops fitting its card fails the table (the README drops it).
# (card GB, loader inputs, the loader's DiT (Base 1024²), sgld flags, the whole pipeline's DiT (Turbo 1024²), cost)
CARD_ROWS = [
    (8, "`quant` none (or a Q4_K `.gguf`), `offload` layerwise, `resident_layers` 2",
     Setup("Base bf16, offload 2 buffers", offload="layerwise", resident_layers=2),
     "`--offload layerwise` (the text encoder then encodes on the CPU: no room beside the DiT)",
     Setup("Turbo bf16, offload 2 buffers", model="turbo", offload="layerwise"),
     "the blocks stream from pinned host memory every step (slower; the loader pins as much, a Q4_K file a "
     "quarter of it)"),
    (12, "`quant` fp8, `offload` auto", Setup("Base fp8", quant="fp8"),
     "`--quant fp8 --offload layerwise`", Setup("Turbo fp8, offload 2 buffers", model="turbo", quant="fp8",
                                                offload="layerwise"),
     "fp8 within bf16 rounding (RTX 40xx/50xx compute it natively); the loader's auto streams at 2048²"),
    (16, "`quant` fp8, `offload` auto", Setup("Base fp8", quant="fp8"),
     "`--quant fp8`", Setup("Turbo fp8", model="turbo", quant="fp8"), "fp8 stays resident"),
    (24, "defaults (bf16); `compile` on for long sessions", Setup("Base bf16"),
     "defaults (bf16)", Setup("Turbo bf16", model="turbo"), "the reference picture at full speed"),
]


def card_table(layers: Optional[int] = None) -> str:
    """The README's GPU table from the traces: a row whose loader or ``sgld`` setting does not fit its card raises."""
    from table import fits

    plain = _text_encoder_weights()  # the text encoder waits in host memory between prompts (bf16 on a GPU)
    lines = ["| GPU memory | SGLDiffusion Model Loader | DiT peak GiB (Base 1024²) | `sgld generate` / `serve`, the "
             "pipeline | whole pipeline peak GiB (Turbo 1024²) | with `--pe` (serve, the pipeline) | its host memory GiB: pinned / plain | "
             "what it costs |", "|---|---|---|---|---|---|---|---|"]
    for card, loader, loader_setup, flags, setup, cost in CARD_ROWS:
        dit = predict_cached(loader_setup, 1024, layers=layers)
        run = whole(setup, 1024, "auto", layers=layers)
        if not fits(run.peak_bytes, card):  # auto encodes on the CPU where the GPU has no room for it
            run = whole(setup, 1024, "cpu", layers=layers)
        for what, peak in (("SGLDiffusion Model Loader with " + loader, dit.peak_bytes), ("sgld with " + flags,
                                                                                         run.peak_bytes)):
            if not fits(peak, card):
                raise AssertionError(f"{what}: {peak / GiB:.2f} GiB does not fit a {card} GB card: the README row "
                                     "must go")
        pinned = predict_cached(setup, 1024, layers=layers).pinned_host_bytes
        pe = whole(setup, 1024, "auto", layers=layers, pe=True)  # beside the loaded DiT, as serve and the pipeline
        pe_cell = f"{pe.peak_bytes / GiB:.1f}" + ("" if fits(pe.peak_bytes, card) else
                                                   ": over the card, so the PE writes on the CPU (slower)")
        lines.append(f"| {card} GB | {loader} | {dit.peak_bytes / GiB:.1f} | {flags} | {run.peak_bytes / GiB:.1f} | "
                     f"{pe_cell} | {pinned / GiB:.1f} / {plain / GiB:.1f} | {cost} |")
    lines += ["", "Traced on fake CUDA tensors at the 8B shape (`bench/memory/parts.py` writes this table), not yet "
              "measured on a card; a card fits a row with 1 GiB kept for the desktop and 0.5 for the CUDA context. The "
              "loader's DiT is ComfyUI's (ComfyUI loads and frees its own text encoder); `sgld` and the pipeline also "
              "hold the 3B text encoder (bf16, in plain host memory between prompts, on the GPU only while it "
              f"encodes) and the VAE (tiled above 1024 px); `--pe` adds another {plain / GiB:.1f} GiB of plain host "
              "memory, and the PE writes on the GPU only where it has room beside the loaded DiT (`sgld serve`, the "
              "pipeline; `sgld generate` runs it before the DiT loads). Every configuration: "
              "[docs/memory.md](docs/memory.md)."]
    return "\n".join(lines)


HEADING = """## The whole pipeline on the card: text encoder, DiT and VAE (predicted, fake CUDA)

`bench/memory/parts.py` (issue 46): the text encoder (`TextEncoder.encode`) and the Flux2 VAE (`Flux2VAE.decode`)
traced at their real shapes on the fake GPU, and the whole pipeline of `sgld generate` / `sgld serve` /
`ErnieImagePipeline` composed from its three phases (encode, sample, decode; docstring). A card fits a row when the
peak plus 1 GiB desktop and 0.5 GiB CUDA context is within it."""


def main() -> None:
    text = parts_table() + "\n\n" + whole_table(log=lambda m: print(m, file=sys.stderr))
    write_section("whole_pipeline", text, HEADING)
    print(text)
    cards = card_table()
    write_section("cards", cards, "", path=README)  # between README's markers
    print(cards)


if __name__ == "__main__":
    main()
