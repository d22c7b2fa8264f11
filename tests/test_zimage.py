"""Z-Image (engine/models/zimage/) as a registered family: numerical parity with diffusers 0.42.1's
``ZImageTransformer2DModel`` on random weights (the reference), its configuration read from a file's shapes, and the
engine's features attached through the family seam alone: load -> sample -> Cache-DiT -> a quantized format ->
layer-wise offload -> LoRA (diffusers' PEFT keys) -> served batching -> two gloo ranks (Ulysses and tensor parallel),
under ``torch.inference_mode()`` as ComfyUI runs nodes."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_second_family import assert_served_jobs_equal_solo_runs

from engine import EngineConfig, open_engine
from engine.features.cache import CacheConfig
from engine.features.quant import format_of
from engine.inputs import InputError, empty_latent_shape
from engine.models import detect, get
from engine.models.zimage import ZImageConfig, ZImageTransformer

diffusers = pytest.importorskip("diffusers")

FAMILY = get("z-image")
# a small Z-Image: 4 heads of 16 (RoPE axes 4/6/6 as the release's 32/48/48 split), 2 blocks and 1 refiner each
SHAPE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2, n_refiner_layers=1,
             n_heads=4, n_kv_heads=4, cap_feat_dim=24, axes_dims=[4, 6, 6], axes_lens=[1536, 512, 512])


def reference(seed: int = 0):
    torch.manual_seed(seed)
    ref = diffusers.ZImageTransformer2DModel(**SHAPE).eval()
    with torch.no_grad():
        for p in ref.parameters():  # the pad tokens and gates start at 0: random weights exercise every path
            p.normal_(0, 0.2)
    return ref


def diffusers_velocity(ref, x, sigma, text, lens):
    """diffusers' model as its pipeline calls it (t = 1 - sigma, lists of unpadded inputs), as a velocity."""
    out = ref([xi[:, None] for xi in x], 1 - sigma, [text[i, :n] for i, n in enumerate(lens)], return_dict=False)[0]
    return torch.stack([-o[:, 0] for o in out])


@pytest.mark.parametrize("lens", [(5, 40), (33, 40), (40, 40), (7, 7)],
                         ids=["padded-runs-differ", "same-run", "no-padding", "one-run"])
def test_parity_with_diffusers(lens):
    """Image tokens off a multiple of 32 (6x5 tokens), captions of several lengths in one batch: the pad tokens'
    attention, the batch's mask, the positions and the interleaved RoPE as diffusers computes them."""
    ref = reference()
    ours = ZImageTransformer(ZImageConfig.from_shapes({k: v.shape for k, v in ref.state_dict().items()})).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(2, 16, 12, 10, generator=g), torch.randn(2, max(lens), 24, generator=g)
    sigma = torch.tensor([0.8, 0.35])
    with torch.inference_mode():
        want = diffusers_velocity(ref, x, sigma, text, lens)
        got = ours(x, sigma * 1000, text, torch.tensor(lens))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5 * want.abs().max().item())


def test_the_configuration_comes_from_the_file():
    sd = reference().state_dict()
    shapes = {k: v.shape for k, v in sd.items()}
    cfg = ZImageConfig.from_shapes(shapes, {"dim": 64, "axes_dims": [4, 6, 6], "n_kv_heads": 4})
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_refiner_layers, cfg.num_attention_heads, cfg.in_channels,
            cfg.text_in_dim, cfg.ffn_hidden_size, cfg.rope_axes_dim) == (64, 2, 1, 4, 16, 24, 170, (4, 6, 6))
    assert detect(["transformer." + k for k in sd]) == (FAMILY, "transformer.")
    with pytest.raises(ValueError, match="field 'dim' = 96 disagrees with the tensors, which give 64"):
        ZImageConfig.from_shapes(shapes, {"dim": 96})
    with pytest.raises(ValueError, match="'siglip_feat_dim' = 32 is not supported"):
        ZImageConfig.from_shapes(shapes, {"siglip_feat_dim": 32})
    del shapes["context_refiner.0.feed_forward.w1.weight"]
    shapes.update({"noise_refiner.1." + k.split(".", 2)[2]: v for k, v in shapes.items() if k.startswith("noise_refiner.0.")})
    with pytest.raises(ValueError, match="refiners must have as many blocks"):
        ZImageConfig.from_shapes(shapes)
    with pytest.raises(InputError, match="multiple of 16 pixels .* a token covers 16x16"):
        empty_latent_shape(FAMILY, 1000, 1024, 1)
    assert empty_latent_shape(FAMILY, 1024, 768, 1) == (1, 16, 96, 128)


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    """A small Z-Image file in diffusers' layout (prefixed as a single-file checkpoint), its inputs and plain run."""
    folder = tmp_path_factory.mktemp("zimage")
    ref = reference(seed=2)
    path = str(folder / "z_image_small.safetensors")
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    g = torch.Generator().manual_seed(3)
    inputs = dict(latent=torch.zeros(empty_latent_shape(FAMILY, 80, 96, 1)),
                  cond=[torch.randn(9, 24, generator=g)], uncond=[torch.randn(4, 24, generator=g)])
    plain = open_engine(path, EngineConfig())
    with torch.inference_mode():
        ref_out = _sample(plain, inputs, CacheConfig(enabled=False))
    try:
        yield dict(path=path, folder=folder, inputs=inputs, ref=ref_out, engine=plain, reference=ref)
    finally:
        from engine.parallel import shutdown_pools

        shutdown_pools()


def _sample(eng, inputs, cache, steps=6):
    return eng.sample(inputs["latent"], inputs["cond"], inputs["uncond"], seed=3, steps=steps, cfg=3.0, cache=cache)


def _close(out, ref, tol):
    return (out - ref).abs().max().item() <= tol * ref.abs().max().item()


def _forward_matches_diffusers(eng, ref, sigma=0.6):
    g = torch.Generator().manual_seed(4)
    x, text = torch.randn(1, 16, 12, 10, generator=g), torch.randn(1, 9, 24, generator=g)
    with torch.inference_mode():
        got = eng.dit_forward(x, torch.tensor([sigma * 1000]), text, torch.tensor([9]))
        want = diffusers_velocity(ref, x, torch.tensor([sigma]), text, [9])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5 * want.abs().max().item())


def test_load_and_sample(zimage):
    from engine.sampling_options import MODEL_DEFAULTS, model_defaults

    # its own release's sampling (Turbo: 9 steps at cfg 1), not the first family's Base
    assert model_defaults(zimage["path"]) == {"steps": 9, "cfg": 1.0} != MODEL_DEFAULTS["base"]
    eng = zimage["engine"]
    assert type(eng.model) is ZImageTransformer and eng.model_config.num_refiner_layers == 1
    assert zimage["ref"].shape == (1, 16, 12, 10) and torch.isfinite(zimage["ref"]).all()
    _forward_matches_diffusers(eng, zimage["reference"])  # the loaded engine (its fused q/k/v and w1/w3) is diffusers'


def test_cache_dit(zimage):
    eng = zimage["engine"]
    with torch.inference_mode():
        assert torch.equal(_sample(eng, zimage["inputs"], CacheConfig(warmup=1, rdt=0.0)), zimage["ref"])
        # random weights change the residual a lot between steps: a loose threshold lets some steps reuse it
        out = _sample(eng, zimage["inputs"], CacheConfig(warmup=1, rdt=3.0))
    stats = eng.last_run.to_dict()
    assert stats["calls_computed"] < stats["model_calls"], stats
    assert torch.isfinite(out).all() and not torch.equal(out, zimage["ref"])


def test_quantized_format_and_offload(zimage):
    with torch.inference_mode():
        eng = open_engine(zimage["path"], EngineConfig(quant="int8-weight"))
        assert eng.describe()["quant"] == "int8-weight"
        # the refiners' linears too (issue 47): every list of blocks is the family's, not the main one alone
        for blocks in (eng.model.noise_refiner, eng.model.context_refiner, eng.model.layers):
            assert format_of(blocks[0].feed_forward.w2).name == "int8-weight", type(blocks[0].feed_forward.w2)
        out = _sample(eng, zimage["inputs"], CacheConfig(enabled=False))
        assert _close(out, zimage["ref"], 5e-2) and not torch.equal(out, zimage["ref"])
        eng = open_engine(zimage["path"], EngineConfig(offload="layerwise", resident_layers=1))
        # the refiners stream too (issue 47): 2 main blocks, then a noise and a context refiner, in a forward's order
        assert eng.offload is not None and eng.describe()["offload"]["blocks"] == 4
        assert torch.equal(_sample(eng, zimage["inputs"], CacheConfig(enabled=False)), zimage["ref"])
        eng.offload.reset_stats()
        eng.dit_forward(torch.randn(1, 16, 8, 6), torch.tensor([400.0]), torch.randn(1, 7, 24), torch.tensor([7]))
        assert list(eng.offload.record) == [2, 3, 0, 1]
        eng = open_engine(zimage["path"], EngineConfig(offload="layerwise", resident_layers=2))
        x = (torch.randn(1, 16, 8, 6), torch.tensor([400.0]), torch.randn(1, 7, 24), torch.tensor([7]))
        eng.dit_forward(*x)
        eng.offload.reset_stats()
        eng.dit_forward(*x)  # each list's end prefetches the next list's first block: no block waits for its load
        assert eng.offload.stats()["stalls"] == 0 and list(eng.offload.record) == [3, 0, 1, 2]  # 2: the next forward's


def test_lora_in_diffusers_keys(zimage):
    """A PEFT LoRA as diffusers' Z-Image trainers save it (``transformer.layers.N.attention.to_q.lora_A``): the
    engine's forward equals diffusers' model with W + B A merged; removal restores the plain run bit-exactly."""
    eng, ref = zimage["engine"], zimage["reference"]
    g = torch.Generator().manual_seed(5)
    sd, merged = {}, {k: v.clone() for k, v in ref.state_dict().items()}
    for i in range(2):
        for target in ("attention.to_q", "attention.to_out.0", "feed_forward.w1"):
            w = merged[f"layers.{i}.{target}.weight"]
            a, b = 0.1 * torch.randn(2, w.shape[1], generator=g), 0.1 * torch.randn(w.shape[0], 2, generator=g)
            sd[f"transformer.layers.{i}.{target}.lora_A.weight"] = a
            sd[f"transformer.layers.{i}.{target}.lora_B.weight"] = b
            merged[f"layers.{i}.{target}.weight"] = w + b @ a
    path = str(zimage["folder"] / "z_lora.safetensors")
    save_file(sd, path)
    with_lora = diffusers.ZImageTransformer2DModel(**SHAPE).eval()
    with_lora.load_state_dict(merged)
    try:
        with torch.inference_mode():
            assert eng.set_loras([(path, 1.0)]) == [] and eng.lora_report == []
        _forward_matches_diffusers(eng, with_lora)
    finally:
        with torch.inference_mode():
            eng.set_loras([])
    with torch.inference_mode():
        assert torch.equal(_sample(eng, zimage["inputs"], CacheConfig(enabled=False)), zimage["ref"])


def test_served_jobs_equal_their_solo_runs(zimage):
    """Two jobs of different caption runs (9 and 40 tokens: one and two runs of 32), one with its own Cache-DiT."""
    g = torch.Generator().manual_seed(9)
    assert_served_jobs_equal_solo_runs(zimage["engine"], torch.zeros(16, 12, 10),
                                       [torch.randn(tokens, 24, generator=g) for tokens in (9, 40)],
                                       zimage["inputs"]["uncond"][0], CacheConfig(warmup=1, rdt=3.0))


@pytest.mark.subprocess
def test_two_gloo_ranks(zimage):
    """Ulysses (the family's chunk_context) and tensor parallel (its shard_dims; the attention's and the SwiGLU's
    partial sums are reduced before the norms that follow them) on two gloo ranks."""
    engines = []
    try:
        for mode in (dict(ulysses_degree=2), dict(tp=2)):
            engines.append(open_engine(zimage["path"], EngineConfig(**mode)))
            assert engines[-1].runner.plan.world_size == 2
            with torch.inference_mode():
                out = _sample(engines[-1], zimage["inputs"], CacheConfig(enabled=False))
            assert _close(out, zimage["ref"], 1e-4), (mode, (out - zimage["ref"]).abs().max())
    finally:
        for eng in engines:
            eng.release()


# ComfyUI 0.3.75's own Z-Image DiT (comfy/ldm/lumina/model.py, NextDiT as model_detection configures it for Z-Image)
# on random weights, saved in its own names (the original layout of ComfyUI's repack), with its output
def test_lora_in_its_trainers_layouts(zimage):
    """The layouts Z-Image's trainers write land on the same layers: ai-toolkit's (diffusers' names under
    ``diffusion_model.``, A/B) and musubi-tuner's (kohya's flat ``lora_unet_`` names, down/up and alpha) give the
    PEFT file's forward; a LoRA of another model is named as not Z-Image's."""
    from engine.errors import LoRAError

    eng = zimage["engine"]
    g = torch.Generator().manual_seed(6)
    pairs = {f"layers.{i}.{t}": (0.1 * torch.randn(2, 64, generator=g), 0.1 * torch.randn(out, 2, generator=g))
             for i in range(2) for t, out in (("attention.to_q", 64), ("feed_forward.w1", 170))}
    layouts = {
        "peft": {f"transformer.{m}.lora_{s}.weight": t for m, (a, b) in pairs.items() for s, t in (("A", a), ("B", b))},
        "ai-toolkit": {f"diffusion_model.{m}.lora_{s}.weight": t for m, (a, b) in pairs.items()
                       for s, t in (("A", a), ("B", b))},
        "musubi-tuner": {**{f"lora_unet_{m.replace('.', '_')}.lora_{s}.weight": t for m, (a, b) in pairs.items()
                            for s, t in (("down", a), ("up", b))},
                         **{f"lora_unet_{m.replace('.', '_')}.alpha": torch.tensor(2.0) for m in pairs}}}
    outs = _forwards_with_loras(zimage, layouts, g)
    other = str(zimage["folder"] / "ernie_lora.safetensors")
    save_file({"transformer.layers.0.self_attention.to_q.lora_A.weight": torch.zeros(2, 64),
               "transformer.layers.0.self_attention.to_q.lora_B.weight": torch.zeros(64, 2)}, other)
    with torch.inference_mode(), pytest.raises(LoRAError, match="not a LoRA for Z-Image"):
        eng.set_loras([(other, 1.0)])
    for name in ("ai-toolkit", "musubi-tuner"):
        torch.testing.assert_close(outs[name], outs["peft"], rtol=0, atol=1e-6)


def test_lora_in_the_original_fused_layout(zimage):
    """A LoRA on Z-Image's original names (ComfyUI's repack: ``attention.qkv`` fused, ``attention.out``), as LoRAs
    trained against that layout write them, dotted or in kohya's flat names: the fused update is the to_q / to_k /
    to_v updates (B's rows, A shared), so the forward equals the PEFT file's in diffusers' names."""
    g = torch.Generator().manual_seed(7)
    fused, split = {}, {}
    for i in range(2):
        a, b = 0.1 * torch.randn(2, 64, generator=g), 0.1 * torch.randn(3 * 64, 2, generator=g)
        fused |= {f"diffusion_model.layers.{i}.attention.qkv.lora_A.weight": a,
                  f"diffusion_model.layers.{i}.attention.qkv.lora_B.weight": b}
        for j, part in enumerate(("to_q", "to_k", "to_v")):
            split |= {f"transformer.layers.{i}.attention.{part}.lora_A.weight": a,
                      f"transformer.layers.{i}.attention.{part}.lora_B.weight": b[64 * j: 64 * (j + 1)]}
        a, b = 0.1 * torch.randn(2, 64, generator=g), 0.1 * torch.randn(64, 2, generator=g)
        fused |= {f"diffusion_model.layers.{i}.attention.out.lora_A.weight": a,
                  f"diffusion_model.layers.{i}.attention.out.lora_B.weight": b}
        split |= {f"transformer.layers.{i}.attention.to_out.0.lora_A.weight": a,
                  f"transformer.layers.{i}.attention.to_out.0.lora_B.weight": b}
    flat = {}  # the same layers under kohya's flat names, as musubi-tuner writes them (down / up, alpha = rank)
    for k, v in fused.items():
        layer, _, part = k.removeprefix("diffusion_model.").rpartition(".lora_")
        flat[f"lora_unet_{layer.replace('.', '_')}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = v
        flat[f"lora_unet_{layer.replace('.', '_')}.alpha"] = torch.tensor(2.0)
    outs = _forwards_with_loras(zimage, {"split": split, "fused": fused, "kohya-flat": flat}, g)
    torch.testing.assert_close(outs["fused"], outs["split"], rtol=0, atol=1e-6)
    torch.testing.assert_close(outs["kohya-flat"], outs["split"], rtol=0, atol=1e-6)


def test_lycoris_on_the_fused_qkv(zimage):
    """LoKr and LoHa on the fused ``attention.qkv`` (LyCORIS trained against the original layout): each part is the
    rows of the whole update, so the forward equals full differences of the parts in diffusers' names, the update
    written here with torch.kron and products of its own. LoKr's blocks on the parts' boundaries (w2 of 64 rows) and
    across them (48 rows: that part stored whole); LoHa with alpha (scaled alpha / rank)."""
    g = torch.Generator().manual_seed(8)
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    adapters = {"lokr-aligned": ({"lokr_w1": r(3, 4), "lokr_w2": r(64, 16)}, lambda t: torch.kron(t["lokr_w1"], t["lokr_w2"])),
                "lokr-across": ({"lokr_w1": r(4, 4), "lokr_w2": r(48, 16)}, lambda t: torch.kron(t["lokr_w1"], t["lokr_w2"])),
                "loha": ({"hada_w1_a": r(192, 2), "hada_w1_b": r(2, 64), "hada_w2_a": r(192, 2), "hada_w2_b": r(2, 64),
                          "alpha": torch.tensor(1.0)},
                         lambda t: (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]) * 0.5)}
    files = {}
    for name, (factors, update) in adapters.items():
        files[name] = {f"diffusion_model.layers.0.attention.qkv.{k}": v for k, v in factors.items()}
        for j, part in enumerate(update(factors).chunk(3)):
            files[name + "-as-diff"] = {**files.get(name + "-as-diff", {}),
                                        f"transformer.layers.0.attention.{('to_q', 'to_k', 'to_v')[j]}.diff": part}
    outs = _forwards_with_loras(zimage, files, g)
    for name in adapters:
        torch.testing.assert_close(outs[name], outs[name + "-as-diff"], rtol=0, atol=1e-5)


def _forwards_with_loras(zimage, files: dict, g):
    """{name: the DiT's forward with ``files[name]`` (a state dict) saved and set as a LoRA}: each applies with
    nothing unmatched; removed at the end, the plain forward differs from the first LoRA's."""
    eng = zimage["engine"]
    x = (torch.randn(1, 16, 6, 4, generator=g), torch.tensor([600.0]), torch.randn(1, 7, 24, generator=g),
         torch.tensor([7]))
    outs = {}
    try:
        with torch.inference_mode():
            for name, sd in files.items():
                path = str(zimage["folder"] / f"z_{name}.safetensors")
                save_file({k: v.clone() for k, v in sd.items()}, path)  # a tensor shared by two keys: one copy each
                assert eng.set_loras([(path, 1.0)]) == [] and eng.lora_report == [], name
                outs[name] = eng.dit_forward(*x)
    finally:
        with torch.inference_mode():
            eng.set_loras([])
    with torch.inference_mode():
        assert not torch.equal(next(iter(outs.values())), eng.dit_forward(*x))
    return outs
