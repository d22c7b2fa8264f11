"""Every feature that attaches to a model goes through engine/features/patching.py: applied, it is in the
model's registry and describes itself as plain data; removed (in reverse order), the model is what it was:
no registry entry, no per-module state, the original classes, modules, slots and weights (bit for bit)."""
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from engine import load_model
from engine.errors import ParallelConfigError
from engine.features import attention as A
from engine.features import patching
from engine.features import quant as Q
from engine.features.cache import CacheConfig, remove_cache
from engine.features.compile import compile_blocks, uncompile_blocks
from engine.features.fuse import fuse_projections, remove_fused_projections
from engine.features.lora import active_loras, apply_loras, read_lora, remove_loras
from engine.features.offload import apply_layerwise_offload, remove_offload
from engine.io.load import read_model
from engine.local import LocalRunner
from engine.models.random_weights import SIZES, random_model, save_random_checkpoint

CFG = SIZES["tiny"]


def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, CFG.in_channels, 4, 4, generator=g)
    return x, torch.tensor([500.0]), torch.randn(1, 5, CFG.text_in_dim, generator=g), torch.tensor([5])


def forward(model):
    with torch.no_grad():
        return model(*inputs())


def layout(model):
    """Every module's name and class, and every parameter's name, dtype and shape."""
    return ([(n, type(m)) for n, m in model.named_modules()],
            [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()])


def weight_bits(model) -> dict:
    return {k: v.detach().clone().contiguous().view(torch.uint8) for k, v in model.state_dict().items()}


def write_lora(path, model) -> str:
    g = torch.Generator().manual_seed(1)
    h, f = CFG.hidden_size, CFG.ffn_hidden_size
    sd = {}
    for name, (out, inp) in {"layers.0.self_attention.to_q": (h, h), "layers.1.mlp.up_proj": (f, h),
                             "layers.1.self_attention.to_out.0": (h, h), "text_proj": (h, CFG.text_in_dim)}.items():
        sd[f"transformer.{name}.lora_A.weight"] = torch.randn(4, inp, generator=g) * 0.2
        sd[f"transformer.{name}.lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.2
    save_file(sd, str(path))
    return str(path)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_each_feature_is_registered_and_removing_them_leaves_the_original_model(tmp_path, quant):
    model = random_model(CFG, seed=0)
    if quant:
        Q.apply_quant(model, quant)
    before, bits, slots = layout(model), weight_bits(model), (model.block_runner, model.attention)
    y0 = forward(model)
    base = ["quant"] if quant else []  # quantizing is the model's starting point here; it stays
    assert patching.attached(model) == base

    assert fuse_projections(model) == 2 * CFG.num_layers
    A.apply_attention(model, A.select_backend("math", "cpu", log_choice=False))
    assert model.attention is A.math_attention
    apply_layerwise_offload(model, "cpu", 2)
    compile_blocks(model, "static", backend="aot_eager")
    lora = read_lora(write_lora(tmp_path / "l.safetensors", model), model)
    apply_loras(model, [(lora, 0.8)])
    assert patching.attached(model) == base + ["fuse", "attention", "offload", "compile", "lora"]
    assert not torch.equal(forward(model), y0)

    described = {p.name: p.describe() for p in patching.patches(model)}
    json.dumps(described)  # plain data
    assert described.get("quant", {}).get("format") == quant
    assert described["fuse"] == {"groups_fused": 2 * CFG.num_layers, "groups": 2 * CFG.num_layers}
    assert described["attention"]["backend"] == "math" and described["attention"]["requested"] == "math"
    assert described["attention"]["version"].startswith("torch ") and described["attention"]["reason"]
    assert described["offload"]["mode"] == "layerwise" and described["offload"]["blocks"] == CFG.num_layers
    assert (described["compile"]["mode"], described["compile"]["shapes"]) == ("default", "static")
    side = 3 if quant else 0  # the block linears of an fp8 model get side paths, text_proj is merged
    assert described["lora"] == {"files": [lora.path], "strengths": [0.8], "layers_merged": 4 - side,
                                 "side_paths": side, "bytes_kept": described["lora"]["bytes_kept"]}
    assert described["lora"]["bytes_kept"] > 0 and active_loras(model) == [(lora, 0.8)]
    with pytest.raises(ValueError, match="cannot be removed while offload, compile, lora is attached"):
        remove_fused_projections(model)  # refused, nothing changed
    assert patching.attached(model)[len(base)] == "fuse"

    assert remove_loras(model) and uncompile_blocks(model) and remove_offload(model)
    assert A.remove_attention(model) and remove_fused_projections(model)
    assert patching.attached(model) == base and not remove_loras(model)
    assert [n for n, m in model.named_modules() if patching.STATE in m.__dict__] == []
    assert layout(model) == before and (model.block_runner, model.attention) == slots
    assert all(b._compiled_call_impl is None for b in model.layers)
    after = weight_bits(model)
    assert list(after) == list(bits) and all(torch.equal(after[k], bits[k]) for k in bits)
    assert torch.equal(forward(model), y0)



def test_cache_dit_attaches_through_the_registry_for_one_run():
    """The Cache-DiT runner is the "cache" patch while a run lasts (LocalRun: apply_cache / remove_cache), not a
    slot written from outside; a run that never finished (an exception) is replaced by the next one."""
    model = random_model(replace(CFG, num_layers=4), seed=0)
    local = LocalRunner(model)
    own = model.block_runner
    plan = CacheConfig(preset="balanced").resolve(8, 4)
    run = local.run(plan, cfg_batched=False)
    assert "cache" in patching.attached(model) and model.block_runner is run.runner
    assert patching.get(model, "cache").describe() == {"runner": "DBCacheRunner", "calls_so_far": 0}
    abandoned = run.runner
    run = local.run(plan, cfg_batched=False)  # the first never finished
    assert model.block_runner is run.runner is not abandoned
    assert run.finish()["calls"] >= 0 and "cache" not in patching.attached(model) and model.block_runner is own
    assert not remove_cache(model)


def test_tensor_parallel_shapes_go_through_the_quant_transform(tmp_path):
    """The shard skeleton replaces the block linears through patching.replace_module (the load transform of
    engine/features); the plain io loop, which cannot, refuses a shard with an error saying where to go."""
    path = tmp_path / "m.safetensors"
    save_random_checkpoint(str(path), CFG, seed=0)
    m = load_model(path, shard=(2, 1))
    assert m.layers[0].mlp.gate_proj.weight.shape == (CFG.ffn_hidden_size // 2, CFG.hidden_size)
    assert m.layers[0].self_attention.to_out[0].weight.shape == (CFG.hidden_size, CFG.hidden_size // 2)
    with pytest.raises(ParallelConfigError, match="tensor parallel loads through engine.load_model"):
        read_model(path, shard=(2, 1))
