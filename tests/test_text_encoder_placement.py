"""Issue 46 item 2, the parts around the DiT: ERNIE-Image's text encoder computes in bf16 where the device does
(float32 on a CPU without native bf16), waits in host memory while the DiT samples (``--text-encoder-device auto``),
computes on the CPU when asked (``cpu``); the features of recent prompts are kept, so a repeated prompt does not wake
it; the Flux2 VAE decodes in tiles above its trained size. On the tiny release of the real classes (tests/tiny_release)."""
from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest
import tiny_release
import torch

from engine.cli import main as sgld
from engine.image_parts import FileParts
from engine.models import get as get_family
from engine.models.external import Flux2VAE, TextEncoder, text_encoder_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "memory"))
import rehearse  # noqa: E402

PROMPT = "a red cat on the mat"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return tiny_release.write_release(tmp_path_factory.mktemp("release") / "ERNIE-Image")


def load(release, **kw) -> TextEncoder:
    return TextEncoder.load(os.path.join(release, "text_encoder"), tokenizer=os.path.join(release, "tokenizer"), **kw)


def test_the_text_encoder_takes_bf16_where_the_device_computes_it(release, monkeypatch):
    monkeypatch.setenv("SGLD_CPU_BF16", "0")  # this machine: AVX2, no native bf16
    assert text_encoder_dtype("cpu") == torch.float32
    f32 = load(release)
    assert f32.dtype == torch.float32
    monkeypatch.setenv("SGLD_CPU_BF16", "1")
    assert text_encoder_dtype("cpu") == torch.bfloat16
    bf16 = load(release)
    assert bf16.dtype == torch.bfloat16
    monkeypatch.delenv("SGLD_CPU_BF16")
    assert text_encoder_dtype("cuda") == torch.bfloat16  # no driver here: a card of the release's dtype (sm80+)
    a, b = f32.encode(PROMPT), bf16.encode(PROMPT)
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    rel = float((b - a).norm() / a.norm())
    print(f"\ntext encoder bf16 against float32 (tiny Ministral3, 2 layers): relative error {rel:.4f}")
    assert 0 < rel < 0.03, rel


def test_auto_keeps_the_weights_in_host_memory_between_prompts(release):
    """Placement auto on a GPU (the fake CUDA device of the memory rehearsal): the weights wait on the host, are on the
    GPU while a prompt is encoded, and are gone from it after."""
    import transformers

    loaded = load(release, device="cuda")
    assert loaded.home.type == "cpu" and loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16
    assert all(p.device.type == "cpu" for p in loaded.model.parameters())
    with rehearse.Rehearsal() as r:
        with r.all_fake():  # its twin of fake host tensors (a real tensor cannot be swapped for a fake CUDA one)
            model = transformers.AutoModel.from_config(loaded.model.config, dtype=loaded.dtype).eval()
        te = TextEncoder(model, loaded.tokenizer, loaded.device, loaded.home, loaded.placement)
        assert r.tracker.live == 0
        weights = sum(p.numel() * p.element_size() for p in te.model.parameters())
        te.encode(PROMPT)
        gc.collect()
        assert r.tracker.peak.bytes >= weights, (r.tracker.peak, weights)  # on the GPU to encode
        assert r.tracker.live < weights / 4, r.tracker.live  # and back in host memory after (the host copies are
        # the rehearsal's zeros: it reads no device value)


def test_auto_encodes_on_the_cpu_when_the_gpu_has_no_room_beside_the_dit(release, caplog):
    """A card too full for the text encoder beside the DiT (the fake card of the rehearsal, smaller than its
    weights): auto encodes where the weights are, on the host, and says so once; nothing lands on the GPU."""
    import transformers

    loaded = load(release, device="cuda")
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    with rehearse.Rehearsal(card_bytes=weights // 2) as r:
        with r.all_fake():
            model = transformers.AutoModel.from_config(loaded.model.config, dtype=loaded.dtype).eval()
        te = TextEncoder(model, loaded.tokenizer, loaded.device, loaded.home, loaded.placement)
        r.tracker.reset_peak()
        with caplog.at_level("WARNING", logger="sgld.parts"):
            assert te.computes_on().type == "cpu"
            te.encode(PROMPT), te.encode("a blue dog")
        assert r.tracker.peak.bytes == 0, r.tracker.peak
    said = [m for m in caplog.messages if "do not fit" in m]
    assert len(said) == 1 and "encoding on the CPU" in said[0] and "--text-encoder-device cpu" in said[0], said


def test_cpu_placement_computes_on_the_cpu_whatever_the_device(release):
    te = load(release, device="cuda", placement="cpu")
    assert te.device.type == te.home.type == "cpu" and te.dtype == torch.float32
    assert torch.equal(te.encode(PROMPT), load(release).encode(PROMPT))
    te.to("cuda")  # the pipeline's .to(): the CPU placement stays
    assert te.device.type == "cpu"
    with pytest.raises(Exception, match="placement 'gpu' is not one of auto, cpu, resident"):
        load(release, placement="gpu")


def test_the_cli_takes_the_placement_and_refuses_a_bad_one(release, tmp_path, capsys):
    out = tmp_path / "a.png"
    assert sgld(["generate", "--model-path", release, "--prompt", PROMPT, "--width", "64", "--height", "64",
                 "--steps", "2", "--text-encoder-device", "cpu", "--out", str(out)]) == 0
    assert out.exists()
    with pytest.raises(SystemExit) as e:
        sgld(["generate", "--model-path", release, "--prompt", PROMPT, "--text-encoder-device", "gpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--text-encoder-device" in err and "'auto', 'cpu', 'resident'" in err, err


class Counted:
    """The real text encoder, its forward calls counted by a forward hook."""

    def __init__(self, te):
        self.te, self.calls = te, 0
        te.model.register_forward_hook(lambda *a: setattr(self, "calls", self.calls + 1))


def test_recent_prompts_do_not_wake_the_text_encoder(release):
    c = Counted(load(release))
    one = c.te.encode(PROMPT)
    size = one.numel() * one.element_size()
    c.calls = 0
    parts = FileParts(c.te, None, get_family("ernie-image"))
    first = parts.encode(PROMPT)
    assert torch.equal(parts.encode(PROMPT), first) and c.calls == 1  # kept
    parts.encode("a blue dog")
    assert c.calls == 2
    room_for_one = FileParts(c.te, None, get_family("ernie-image"), prompt_cache_bytes=size + 1)  # least recently used out
    for p in (PROMPT, "a", PROMPT, "a", "a"):
        room_for_one.encode(p)
    assert c.calls == 2 + 4
    nothing = FileParts(c.te, None, get_family("ernie-image"), prompt_cache_bytes=0)
    nothing.encode(PROMPT), nothing.encode(PROMPT)
    assert c.calls == 2 + 4 + 2
    parts.forget_prompts()  # the encoder changed (the pipeline's .to()): computed again
    parts.encode(PROMPT)
    assert c.calls == 2 + 4 + 2 + 1


def test_the_vae_decodes_in_tiles_above_its_trained_size(release):
    """diffusers' tiled decode (overlapping tiles, blended) above the config's sample_size; below it, one piece. The
    tiled picture against the whole decode, on the tiny VAE with a 32-pixel trained size: a 64x64 picture in 4 tiles."""
    loaded = Flux2VAE.load(os.path.join(release, "vae"))
    assert loaded.vae.use_tiling and loaded.vae.tile_sample_min_size == 1024  # the release's VAE: 2048² tiled
    import diffusers

    torch.manual_seed(0)
    small = diffusers.AutoencoderKLFlux2(block_out_channels=(16, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                         up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                         norm_num_groups=8, latent_channels=loaded.vae.config.latent_channels,
                                         sample_size=32)
    small.load_state_dict(loaded.vae.state_dict())
    vae = Flux2VAE(small.eval())
    latent = torch.randn(vae.latent_shape(64, 64), generator=torch.Generator().manual_seed(1))
    whole = vae.decode(latent).numpy().astype(np.float64)
    small.enable_tiling()
    tiled = vae.decode(latent).numpy().astype(np.float64)
    mse = ((tiled - whole) ** 2).mean()
    psnr = 10 * np.log10(255.0 ** 2 / max(mse, 1e-12))
    print(f"\ntiled VAE decode against the whole (tiny Flux2 VAE, 64x64 in 32-px tiles): PSNR {psnr:.1f} dB, "
          f"max {np.abs(tiled - whole).max():.0f}/255")
    assert mse > 0 and psnr > 20, psnr
    small.enable_tiling()
    assert tiled.shape == whole.shape == (1, 64, 64, 3)


def test_the_prompt_enhancer_takes_the_same_rule(tmp_path, monkeypatch):
    """The PE is the same Ministral 3 3B: bf16 where the device computes it (it was float32 everywhere: 12.8 GB
    resident in a server), an asked --pe-dtype still wins."""
    from tiny_pe import write_tiny_pe

    from engine.models.prompt_enhancer import PromptEnhancer

    write_tiny_pe(str(tmp_path))
    pe = str(tmp_path / "pe")
    assert PromptEnhancer.from_pretrained(pe).dtype == torch.float32  # this CPU: no native bf16
    monkeypatch.setenv("SGLD_CPU_BF16", "1")
    assert PromptEnhancer.from_pretrained(pe).dtype == torch.bfloat16
    assert PromptEnhancer.from_pretrained(pe, dtype="fp32").dtype == torch.float32


def test_the_prompt_enhancer_is_on_the_gpu_only_while_it_writes(tmp_path):
    """Its weights wait in host memory (a server's PE is not held beside the DiT between requests): on the fake GPU
    of the rehearsal they arrive for the call and leave after it. (Generation's host reads of device values are
    answered by the rehearsal: the trace is of the memory, not of the text.)"""
    from tiny_pe import write_tiny_pe

    from engine.models.prompt_enhancer import PromptEnhancer

    write_tiny_pe(str(tmp_path))
    pe = PromptEnhancer.from_pretrained(str(tmp_path / "pe"), device="cuda")
    assert pe.dtype == torch.bfloat16 and {p.device.type for p in pe.model.parameters()} == {"cpu"}
    import transformers

    with rehearse.Rehearsal() as r:
        with r.all_fake():  # its twin of fake host tensors (a real tensor cannot become a fake CUDA one)
            pe.model = transformers.AutoModelForCausalLM.from_config(pe.model.config, dtype=pe.dtype).eval()
        weights = sum(p.numel() * p.element_size() for p in pe.model.parameters())
        r.tracker.reset_peak()
        with r.answering():
            pe.enhance("a red cat", 64, 64, max_new_tokens=2, greedy=True)  # no seed: no CUDA RNG to fork
        gc.collect()
        assert r.tracker.peak.bytes >= weights and r.tracker.live < weights / 4, (r.tracker.peak, r.tracker.live)
