"""Fused projections (engine/features/fuse.py): q/k/v and gate/up as one GEMM each, with the checkpoint's names
kept wherever they are seen from outside (state_dict, load_state_dict, LoRA targets, quantized layers)."""
import pytest
import torch
from safetensors.torch import save_file

from engine import Engine, EngineConfig
from engine.features import patching
from engine.features import quant as Q
from engine.features.fuse import RowView, fuse_projections, fused_groups, linear_parts
from engine.features.lora import target_modules
from engine.models.random_weights import SIZES, random_model

CFG = SIZES["tiny"]


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, CFG.in_channels, 4, 6, generator=g)
    return x, torch.tensor([700.0, 300.0]), torch.randn(2, 5, CFG.text_in_dim, generator=g), torch.tensor([5, 2])


def forward(model):
    with torch.no_grad():
        return model(*inputs()).float()


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("quant", [None, "fp8", "int4-g64"])
def test_fused_model_computes_what_the_release_layout_computes(quant):
    ref = random_model(CFG, seed=0)
    if quant:
        Q.apply_quant(ref, quant)
    want = forward(ref)
    assert fuse_projections(ref) == 2 * CFG.num_layers and fused_groups(ref) == (4, 4)
    block = ref.layers[0]
    assert set(block.self_attention._modules) == {"qkv", "norm_q", "norm_k", "to_out"}
    assert set(block.mlp._modules) == {"gate_up", "linear_fc2"}
    assert type(block.self_attention.qkv) is (nn_linear() if quant is None else Q.FP8Linear if quant == "fp8" else Q.Int4Linear)
    assert rel(forward(ref), want) < 1e-6  # the same rows, one GEMM: float32 rounding only
    assert fuse_projections(ref) == 0  # idempotent


def nn_linear():
    return torch.nn.Linear


@pytest.mark.parametrize("quant", [None, "fp8", "int4-g64"])
def test_state_dict_keeps_the_checkpoint_names_order_and_values(quant):
    ref = random_model(CFG, seed=0)
    if quant:
        Q.apply_quant(ref, quant)
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    fuse_projections(ref)
    got = ref.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    # parts are views of the fused tensors, not copies
    qkv = ref.layers[0].self_attention.qkv.weight
    assert got["layers.0.self_attention.to_k.weight"].untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()


@pytest.mark.parametrize("quant", ["fp8", "int4", "int4-g64"])
def test_fuse_then_quantize_equals_the_engines_order_and_keeps_state_dict(quant):
    """Issue 29, point 7: the engine quantizes, then fuses (engine/local.py). The reverse order (apply_quant on a
    fused model) used to give plain quantized modules at qkv / gate_up without the fuse record, and state_dict()
    raised. Quantization is per output row (fp8 scale, int4 groups along the input), so both orders give the same
    tensors; removing the quantization keeps the model fused and its state_dict working too."""
    engine_order = random_model(CFG, seed=0)
    Q.apply_quant(engine_order, quant)
    fuse_projections(engine_order)
    reverse = random_model(CFG, seed=0)
    fuse_projections(reverse)
    Q.apply_quant(reverse, quant)
    assert type(reverse.layers[0].self_attention.qkv) is (Q.FP8Linear if quant == "fp8" else Q.Int4Linear)
    want, got = engine_order.state_dict(), reverse.state_dict()
    assert list(got) == list(want) and "layers.0.self_attention.to_q.weight" in got
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    assert torch.equal(forward(reverse), forward(engine_order))
    assert Q.remove_quant(reverse)
    dense = reverse.state_dict()  # dequantized, still fused, still the checkpoint's names
    assert list(dense) == list(random_model(CFG, seed=0).state_dict())
    assert type(reverse.layers[0].self_attention.qkv) is torch.nn.Linear and fused_groups(reverse) == (4, 4)


def test_load_state_dict_takes_the_checkpoint_names(tmp_path):
    src = random_model(CFG, seed=1)
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    model = random_model(CFG, seed=0)
    fuse_projections(model)
    model.load_state_dict(sd, strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    assert rel(forward(model), forward(src)) < 1e-6


def test_per_tensor_fp8_scales_become_row_scales_exactly():
    """ComfyUI's fp8 files carry one scale per tensor: q, k and v each keep theirs, on their rows."""
    model = random_model(CFG, seed=0)
    Q.apply_quant(model, "fp8")
    for name in ("to_q", "to_k", "to_v"):
        lin = getattr(model.layers[0].self_attention, name)
        w = lin.dequantize()
        scale = w.abs().max() / Q.FP8_MAX
        lin.weight.data = (w / scale).to(Q.FP8_DTYPE)
        lin.weight_scale.data = scale.reshape(())
    want = forward(model)
    fuse_projections(model)
    scales = model.layers[0].self_attention.qkv.weight_scale
    h = CFG.hidden_size
    assert scales.shape == (3 * h,) and all(len(set(scales[i * h:(i + 1) * h].tolist())) == 1 for i in range(3))
    assert rel(forward(model), want) < 1e-6


def test_groups_of_different_kinds_stay_unfused():
    model = random_model(CFG, seed=0)
    att = model.layers[0].self_attention
    att.to_k = Q.FP8Linear.from_dense(att.to_k.weight.detach())
    want = forward(model)
    fuse_projections(model)
    assert "to_k" in model.layers[0].self_attention._modules and "qkv" in model.layers[1].self_attention._modules
    assert fused_groups(model) == (3, 4)
    assert rel(forward(model), want) < 1e-6


def test_linear_parts_name_every_checkpoint_linear():
    model = random_model(CFG, seed=0)
    before = {n: tuple(m.weight.shape) for n, m in target_modules(model).items()}
    fuse_projections(model)
    after = target_modules(model)
    assert sorted(after) == sorted(before)
    assert {n: tuple(m.weight.shape) for n, m in after.items()} == before
    part = linear_parts(model)["layers.1.self_attention.to_v"]
    assert isinstance(part, RowView) and (part.start, part.stop) == (2 * CFG.hidden_size, 3 * CFG.hidden_size)


def lora_file(path, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, f = CFG.hidden_size, CFG.ffn_hidden_size
    sd = {}
    for name, (out, inp) in {"layers.0.self_attention.to_q": (h, h), "layers.0.self_attention.to_v": (h, h),
                             "layers.1.mlp.up_proj": (f, h), "layers.1.self_attention.to_out.0": (h, h)}.items():
        sd[f"transformer.{name}.lora_A.weight"] = torch.randn(4, inp, generator=g) * 0.2
        sd[f"transformer.{name}.lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.2
    save_file(sd, str(path), metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_merged_into_fused_parts_equals_the_release_layout(tmp_path, dtype):
    """Merging into a part's rows of the fused weight is the same arithmetic: bit-equal weights, and the
    restore is bit-exact."""
    path = lora_file(tmp_path / "l.safetensors")
    release = random_model(CFG, seed=0, dtype=dtype)
    base = {k: v.clone() for k, v in release.state_dict().items()}
    from engine.features.lora import apply_loras, read_lora

    apply_loras(release, [(read_lora(path, release), 0.8)])  # the LoRA machinery on the unfused model
    want = {k: v.clone() for k, v in release.state_dict().items()}
    eng = Engine(random_model(CFG, seed=0, dtype=dtype))  # an Engine fuses
    assert fused_groups(eng.model) == (4, 4)
    eng.set_loras([(path, 0.8)])
    got = eng.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    eng.set_loras([])
    assert all(torch.equal(eng.model.state_dict()[k], base[k]) for k in base)


@pytest.mark.parametrize("quant", ["fp8", "int4-g64"])
def test_lora_side_path_on_fused_quantized_parts(tmp_path, quant):
    """Quantized fused modules get one side path with each part's LoRA in its own output rows."""
    path = lora_file(tmp_path / "l.safetensors")
    release = Engine(random_model(CFG, seed=0), EngineConfig(quant=quant))
    unfused = random_model(CFG, seed=0)
    Q.apply_quant(unfused, quant)
    from engine.features.lora import apply_loras, read_lora

    base = forward(unfused)
    apply_loras(unfused, [(read_lora(path, unfused), 0.8)])
    want = forward(unfused)
    release.set_loras([(path, 0.8)])
    assert rel(forward(release.model), want) < 1e-5 and rel(want, base) > 1e-3
    release.set_loras([])
    assert rel(forward(release.model), base) < 1e-6
    assert not any(patching.feature_state(m, "lora") for m in release.model.modules())


def test_engine_under_inference_mode_fuses_into_normal_tensors():
    with torch.inference_mode():
        eng = Engine(random_model(CFG, seed=0))
    w = eng.model.layers[0].self_attention.qkv.weight
    assert not w.is_inference()
    with torch.no_grad():  # outside inference mode the fused weights can still be changed in place
        w.mul_(1.0)
