"""LoRA files and a tiny engine for the LoRA tests (tests/lora/, tests/test_comfyui_lora_node.py): LoRA A/B pairs
for named modules, written in each key format the engine reads, a merge computed here without engine.lora, and
a hash of every weight (exact restore)."""
import hashlib

import torch
from safetensors.torch import save_file

from engine import Engine, EngineConfig
from engine.models.random_weights import SIZES, random_model

CFG = SIZES["tiny"]


H, FFN = CFG.hidden_size, CFG.ffn_hidden_size


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shape_of(name):
    if name.endswith("linear_fc2"):
        return (H, FFN)
    if name.endswith(("gate_proj", "up_proj")):
        return (FFN, H)
    if name == "x_embedder.proj":
        return (H, CFG.in_channels)
    if name == "adaLN_modulation.1":
        return (6 * H, H)
    if name == "text_proj":
        return (H, CFG.text_in_dim)
    return (H, H)


def make_pairs(modules, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        o, i = shape_of(m)
        out[m] = (torch.randn(rank, i, generator=g) * 0.1, torch.randn(o, rank, generator=g) * 0.1)  # (A, B)
    return out


MODULES = ["layers.0.self_attention.to_q", "layers.1.self_attention.to_out.0", "layers.0.mlp.gate_proj",
           "layers.1.mlp.linear_fc2", "adaLN_modulation.1", "text_proj", "x_embedder.proj"]


def kohya_name(m):
    return "lora_unet_" + m.replace(".", "_")


# format -> (key of A, key of B, key of alpha or None) for module m
FORMATS = {
    "diffusers": (lambda m: f"transformer.{m}.lora_A.weight", lambda m: f"transformer.{m}.lora_B.weight", None),
    "peft_base_model": (lambda m: f"base_model.model.{m}.lora_A.weight", lambda m: f"base_model.model.{m}.lora_B.weight", None),
    "ai_toolkit": (lambda m: f"diffusion_model.{m}.lora_A.weight", lambda m: f"diffusion_model.{m}.lora_B.weight", None),
    "kohya": (lambda m: kohya_name(m) + ".lora_down.weight", lambda m: kohya_name(m) + ".lora_up.weight",
              lambda m: kohya_name(m) + ".alpha"),
    "comfy_generic": (lambda m: f"diffusion_model.{m}.lora_down.weight", lambda m: f"diffusion_model.{m}.lora_up.weight",
                      lambda m: f"diffusion_model.{m}.alpha"),
    "peft_default": (lambda m: f"transformer.{m}.lora_A.default.weight", lambda m: f"transformer.{m}.lora_B.default.weight", None),
    "diffusers_v3": (lambda m: f"{m}.lora.down.weight", lambda m: f"{m}.lora.up.weight", None),
    "diffusers_old": (lambda m: f"{m}_lora.down.weight", lambda m: f"{m}_lora.up.weight", None),
    "mochi": (lambda m: f"diffusion_model.{m}.lora_A", lambda m: f"diffusion_model.{m}.lora_B", None),
    "onetrainer": (lambda m: "lora_transformer_" + m.replace(".", "_") + ".lora_down.weight",
                   lambda m: "lora_transformer_" + m.replace(".", "_") + ".lora_up.weight", None),
}


def write_lora(path, pairs, fmt, alpha=None, dtype=torch.bfloat16, extra=None):
    ka, kb, kalpha = FORMATS[fmt]
    sd = {}
    for m, (a, b) in pairs.items():
        if m == "x_embedder.proj":  # a conv: kohya/ComfyUI store 4-d conv LoRA weights
            a, b = a[:, :, None, None], b[:, :, None, None]
        sd[ka(m)] = a.to(dtype).contiguous()
        sd[kb(m)] = b.to(dtype).contiguous()
        if kalpha and alpha is not None:
            sd[kalpha(m)] = torch.tensor(float(alpha))
    sd.update(extra or {})
    save_file(sd, str(path))
    return str(path)


def reference_merge(w0, pairs_strengths):
    """W0 + sum s * scale * B @ A in float64, rounded once to W0's dtype (computed without engine.lora)."""
    acc = w0.double().reshape(w0.shape[0], -1)
    for (a, b), s in pairs_strengths:
        acc = acc + s * (b.to(torch.bfloat16).double() @ a.to(torch.bfloat16).double())
    return acc.reshape(w0.shape).to(w0.dtype)


def tiny_engine(dtype=torch.float32, **cfg):
    return Engine(random_model(CFG, seed=0, dtype=dtype), EngineConfig(**cfg))


def close_to_reference(got, ref):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:  # one rounding to bf16 from float32 vs float64: at most one ulp apart, almost always equal
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()
        assert (got == ref).float().mean() > 0.99


def inputs(seed=1, b=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, CFG.in_channels, 4, 4, generator=g)
    text = torch.randn(b, 5, CFG.text_in_dim, generator=g)
    return x, torch.tensor([500.0] * b), text, torch.tensor([5] * b)


BLOCK_LINEARS = [f"layers.{i}.{n}" for i in range(CFG.num_layers) for n in (
    "self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
    "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")]


def text_features(seed, tokens):
    import comfy_server as cs

    return cs.load_test_pack().text_features(seed, tokens, cs.text_dim())[0]


COMFY_LORA_TARGETS = ("layers.0.self_attention.to_q", "layers.1.mlp.linear_fc2", "layers.0.mlp.up_proj")


def write_comfy_lora(path, state_dict, names=COMFY_LORA_TARGETS, rank=2, seed=7) -> None:
    """A LoRA in ComfyUI's key format on the block linears ``names`` of the checkpoint whose tensors
    ``state_dict`` holds (their shapes), with alpha 1."""
    shapes = {name: tuple(state_dict[name + ".weight"].shape) for name in names}
    write_comfy_lora_shapes(path, shapes, rank=rank, seed=seed, scale=0.3, alpha=1.0)


def write_comfy_lora_shapes(path, shapes, rank=2, seed=7, scale=0.3, alpha=None) -> str:
    """A LoRA in ComfyUI's key format (``diffusion_model.`` prefix, lora_down / lora_up, an optional alpha) on
    the modules of ``shapes`` ({name: (out, in)}), random N(0, scale²) factors of ``rank``; its path."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (out_f, in_f) in shapes.items():
        sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * scale
        sd[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * scale
        if alpha is not None:
            sd[f"diffusion_model.{name}.alpha"] = torch.tensor(alpha)
    save_file(sd, str(path))
    return str(path)


def check_compiled_side_path(eng, ref, path, x, y0, counters, graphs_before) -> None:
    """``path`` applied at strengths 1, 0.5, 1 to a compiled engine ``eng`` equals the eager ``ref`` each time, with
    one more block graph for the side path (strengths reuse it), and its removal gives ``y0`` back exactly."""
    ys = {}
    for s in (1.0, 0.5, 1.0):
        eng.set_loras([(path, s)])
        ref.set_loras([(path, s)])
        with torch.no_grad():
            ys[s] = eng.model(*x)
            torch.testing.assert_close(ys[s], ref.model(*x), rtol=1e-4, atol=1e-5)
    assert counters.graph_count() == graphs_before + 1
    assert not torch.equal(ys[1.0], y0) and not torch.equal(ys[0.5], ys[1.0])
    eng.set_loras([])
    with torch.no_grad():
        assert torch.equal(eng.model(*x), y0)
