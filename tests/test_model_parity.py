"""Numerical parity of our ERNIE-Image DiT with diffusers' ErnieImageTransformer2DModel (0.42.1)."""
import pytest
import torch

from engine.features.fuse import fuse_projections
from engine.models.ernie_image import ErnieImageConfig
from engine.models.random_weights import random_model, random_state_dict

diffusers = pytest.importorskip("diffusers")

CONFIGS = {
    # name: (config, latent H, W, text lengths)
    "tiny-square": (ErnieImageConfig(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=192,
                                     in_channels=16, out_channels=16, text_in_dim=48, rope_axes_dim=(4, 6, 6)), 6, 6, [7, 3]),
    "odd-nonsquare": (ErnieImageConfig(hidden_size=96, num_layers=3, num_attention_heads=3, ffn_hidden_size=256,
                                       in_channels=8, out_channels=8, text_in_dim=40, rope_axes_dim=(8, 12, 12)), 5, 9, [11, 1, 6]),
    "release-head": (ErnieImageConfig(hidden_size=256, num_layers=2, num_attention_heads=2, ffn_hidden_size=512,
                                      in_channels=128, out_channels=128, text_in_dim=64), 4, 7, [20, 13]),
    "patch2-no-textproj": (ErnieImageConfig(hidden_size=64, num_layers=2, num_attention_heads=2, ffn_hidden_size=128,
                                            in_channels=4, out_channels=4, text_in_dim=64, patch_size=2,
                                            rope_axes_dim=(8, 12, 12)), 6, 10, [5, 2]),
}


def diffusers_model(cfg: ErnieImageConfig, sd, dtype):
    ref = diffusers.ErnieImageTransformer2DModel(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, num_layers=cfg.num_layers,
        ffn_hidden_size=cfg.ffn_hidden_size, in_channels=cfg.in_channels, out_channels=cfg.out_channels,
        patch_size=cfg.patch_size, text_in_dim=cfg.text_in_dim, rope_axes_dim=tuple(cfg.rope_axes_dim),
        rope_theta=int(cfg.rope_theta), eps=cfg.eps)
    ref.load_state_dict(sd)
    return ref.to(dtype).eval()


def inputs(cfg, h, w, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    x = torch.randn(b, cfg.in_channels, h, w, generator=g).to(dtype)
    t = torch.rand(b, generator=g) * 1000
    text = torch.randn(b, max(lens), cfg.text_in_dim, generator=g)
    for i, n in enumerate(lens):
        text[i, n:] = 0
    return x, t, text.to(dtype), torch.tensor(lens)


@pytest.mark.parametrize("fused", [False, True], ids=["release-layout", "fused"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_diffusers(name, dtype, tol, fused):
    """Both layouts: the release's (as loaded) and q/k/v + gate/up fused (engine/features/fuse.py, what an Engine runs)."""
    cfg, h, w, lens = CONFIGS[name]
    sd = random_state_dict(cfg, seed=3)
    ours = random_model(cfg, seed=3, dtype=dtype)
    if fused:
        assert fuse_projections(ours) == 2 * cfg.num_layers
    ref = diffusers_model(cfg, sd, dtype)
    x, t, text, text_lens = inputs(cfg, h, w, lens, dtype)
    with torch.no_grad():
        got = ours(x, t, text, text_lens).float()
        want = ref(x, t, text, text_lens, return_dict=False)[0].float()
    assert got.shape == want.shape == (len(lens), cfg.out_channels, h, w)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= tol, f"{name} {dtype}: max abs error {err:.3g} x max|ref| > {tol}"


def test_padding_does_not_change_a_sample():
    """A sample's output must not depend on how much padding its batch neighbours force on it."""
    cfg, h, w, _ = CONFIGS["tiny-square"]
    model = random_model(cfg, seed=1)
    x, t, text, lens = inputs(cfg, h, w, [9, 4], torch.float32)
    with torch.no_grad():
        batched = model(x, t, text, lens)
        alone = model(x[1:], t[1:], text[1:, :4], lens[1:])
    torch.testing.assert_close(batched[1:], alone, rtol=1e-5, atol=1e-5)


def test_rope_is_the_non_orthogonal_ernie_variant():
    """The quirk: dims j and j+half use different angles, so norms are not preserved exactly."""
    from engine.models.ernie_image import apply_rope, rope_angles

    pos = torch.tensor([[[5.0, 3.0, 2.0]]])
    angles = rope_angles(pos, (4, 6, 6), 256.0)
    assert torch.equal(angles[..., 0::2], angles[..., 1::2])  # [θ0, θ0, θ1, θ1, ...]
    half = angles.shape[-1] // 2
    sin = torch.sin(angles)
    rope = (torch.cos(angles)[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], -1)[:, :, None])
    x = torch.randn(1, 1, 1, 16, dtype=torch.float64).float()
    y = apply_rope(x, rope)
    # explicit formula from the reference
    a = angles[0, 0]
    for j in range(half):
        assert torch.isclose(y[0, 0, 0, j], x[0, 0, 0, j] * torch.cos(a[j]) - x[0, 0, 0, j + half] * torch.sin(a[j]), atol=1e-6)
        assert torch.isclose(y[0, 0, 0, j + half], x[0, 0, 0, j + half] * torch.cos(a[j + half]) + x[0, 0, 0, j] * torch.sin(a[j + half]), atol=1e-6)
    assert not torch.isclose(y.norm(), x.norm(), rtol=1e-4)


def test_config_from_release_shapes():
    """The released 8B shapes give the released configuration (reference §1.1)."""
    from engine.models.ernie_image import ErnieImageTransformer

    with torch.device("meta"):
        model = ErnieImageTransformer(ErnieImageConfig())
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert len(shapes) == 409
    assert sum(v.numel() for v in model.state_dict().values()) == 8_033_490_048
    cfg = ErnieImageConfig.from_shapes(shapes)
    assert cfg == ErnieImageConfig()
    assert cfg.head_dim == 128 and cfg.rope_axes_dim == (32, 48, 48)
