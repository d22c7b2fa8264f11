"""Checkpoint loading: file and folder layouts, dtypes, and every bad input with a clear error."""
import json
import os
import pickle
import struct

import pytest
import torch
from safetensors.torch import save_file

import engine
from engine import CheckpointError, load_model
from engine.models.random_weights import SIZES, random_model, random_state_dict, save_random_checkpoint

CFG = SIZES["tiny"]


def forward(model):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, CFG.in_channels, 4, 6, generator=g)
    text = torch.randn(2, 5, CFG.text_in_dim, generator=g)
    with torch.no_grad():
        return model(x, torch.tensor([900.0, 100.0]), text, torch.tensor([5, 3])).float()


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model.", "diffusion_model."])
def test_single_file_with_any_prefix(tmp_path, prefix):
    path = tmp_path / "m.safetensors"
    save_random_checkpoint(str(path), CFG, seed=2, prefix=prefix)
    model = load_model(path)
    assert model.config == CFG
    assert torch.equal(forward(model), forward(random_model(CFG, seed=2)))


def test_prefixed_file_ignores_other_components(tmp_path):
    sd = {"model.diffusion_model." + k: v for k, v in random_state_dict(CFG, 2).items()}
    sd["vae.decoder.conv_in.weight"] = torch.zeros(3, 3)
    sd["text_encoders.foo.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "full.safetensors"))
    assert torch.equal(forward(load_model(tmp_path / "full.safetensors")), forward(random_model(CFG, seed=2)))


def test_diffusers_folder_with_shards(tmp_path):
    sd = random_state_dict(CFG, 4)
    keys = sorted(sd)
    tdir = tmp_path / "pipe" / "transformer"
    tdir.mkdir(parents=True)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        name = f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(tdir / name))
        weight_map.update({k: name for k in part})
    (tdir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tdir / "config.json").write_text(json.dumps({"_class_name": "ErnieImageTransformer2DModel", "rope_axes_dim": list(CFG.rope_axes_dim),
                                                  "rope_theta": 256, "eps": 1e-6}))
    model = load_model(tmp_path / "pipe")
    assert torch.equal(forward(model), forward(random_model(CFG, seed=4)))
    # a shard named by the index but missing
    os.remove(tdir / "diffusion_pytorch_model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="00002-of-00002.safetensors.*missing"):
        load_model(tmp_path / "pipe")


@pytest.mark.parametrize("dtype,want", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32),
                                        (None, torch.bfloat16), ("default", torch.bfloat16)])
def test_dtypes(tmp_path, dtype, want):
    path = tmp_path / "m.safetensors"
    save_random_checkpoint(str(path), CFG, dtype=torch.bfloat16)
    model = load_model(path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    assert not any(p.requires_grad for p in model.parameters())
    assert torch.isfinite(forward(model)).all()


def test_bad_dtype_is_named(tiny_checkpoint):
    with pytest.raises(ValueError, match="dtype 'int3'.*bf16, fp16, fp32"):
        load_model(tiny_checkpoint, dtype="int3")


def test_built_on_meta_and_assigned(tiny_checkpoint):
    """The load assigns the tensors it read; it never materialises a second, randomly initialised copy."""
    model = load_model(tiny_checkpoint)
    assert all(p.device.type == "cpu" for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    # tensors are views of the read buffers: their storages are exactly the parameter sizes
    assert sum(p.untyped_storage().nbytes() for p in model.parameters()) == total * 4


# -- bad inputs -----------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope\.safetensors: file not found"):
        load_model(tmp_path / "nope.safetensors")


def test_not_safetensors(tmp_path):
    p = tmp_path / "notes.safetensors"
    p.write_text("hello, this is just text and certainly not a checkpoint")
    with pytest.raises(CheckpointError, match="notes.safetensors: not a safetensors file"):
        load_model(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.safetensors: not a safetensors file"):
        load_model(p)


def test_truncated_file(tiny_checkpoint, tmp_path):
    data = tiny_checkpoint.read_bytes()
    p = tmp_path / "cut.safetensors"
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="cut.safetensors: file is truncated: tensor '.*' ends at byte"):
        load_model(p)


def test_truncated_header(tiny_checkpoint, tmp_path):
    p = tmp_path / "cut.safetensors"
    p.write_bytes(tiny_checkpoint.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cut.safetensors: not a safetensors file, or a truncated one"):
        load_model(p)


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/sgld-pickle-was-executed",))


@pytest.mark.parametrize("name", ["model.ckpt", "model.pt", "model.bin", "model.pth"])
def test_pickle_by_name_is_refused(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(pickle.dumps({"w": Boom()}))
    with pytest.raises(CheckpointError, match="pickle-based checkpoints.*Only .safetensors"):
        load_model(p)
    assert not os.path.exists("/tmp/sgld-pickle-was-executed")


def test_pickle_in_disguise_is_refused(tmp_path):
    """A pickle renamed to .safetensors is recognised by its content and never unpickled."""
    p = tmp_path / "sneaky.safetensors"
    p.write_bytes(pickle.dumps({"w": Boom()}, protocol=4))
    with pytest.raises(CheckpointError, match="sneaky.safetensors: this file is a pickle"):
        load_model(p)
    zp = tmp_path / "zip.safetensors"
    torch.save({"w": torch.zeros(2)}, str(zp))  # a PyTorch zip archive
    with pytest.raises(CheckpointError, match="zip.safetensors: this file is a pickle / PyTorch zip archive"):
        load_model(zp)
    assert not os.path.exists("/tmp/sgld-pickle-was-executed")


def test_folder_with_only_pickles_is_refused(tmp_path):
    d = tmp_path / "pipe"
    d.mkdir()
    (d / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(d)


def test_other_architecture_names_missing_key(tmp_path):
    p = tmp_path / "flux.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(12, 4), "img_in.weight": torch.zeros(4, 4)}, str(p))
    with pytest.raises(CheckpointError, match=r"flux.safetensors: not an ERNIE-Image diffusion model: key 'layers.0.mlp.linear_fc2.weight' is missing.*img_in.weight"):
        load_model(p)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    sd = random_state_dict(CFG, 0)
    for i in range(CFG.num_layers):  # the same in every layer (one odd layer is refused earlier, see test_checkpoint_validation)
        del sd[f"layers.{i}.self_attention.to_k.weight"]
        sd[f"layers.{i}.self_attention.to_qkv.weight"] = torch.zeros(3, 3)
    p = tmp_path / "odd.safetensors"
    save_file(sd, str(p))
    with pytest.raises(CheckpointError, match=r"odd.safetensors: .*2 missing \(first: layers.0.self_attention.to_k.weight, layers.1.self_attention.to_k.weight\); 2 unexpected \(first: layers.0.self_attention.to_qkv.weight"):
        load_model(p)


def test_shape_mismatch_is_named(tmp_path):
    sd = random_state_dict(CFG, 0)
    sd["layers.0.mlp.up_proj.weight"] = torch.zeros(100, CFG.hidden_size)
    p = tmp_path / "shape.safetensors"
    save_file(sd, str(p))
    with pytest.raises(CheckpointError, match=r"shape.safetensors: .*tensor 'layers.1.mlp.up_proj.weight' has shape \(192, 64\), but 'layers.0.mlp.up_proj.weight' has \(100, 64\)"):
        load_model(p)
    for i in range(CFG.num_layers):  # the same odd shape in every layer: refused against the configuration
        sd[f"layers.{i}.mlp.up_proj.weight"] = torch.zeros(100, CFG.hidden_size)
    save_file(sd, str(p))
    with pytest.raises(CheckpointError, match=r"shape.safetensors: tensor 'layers.0.mlp.up_proj.weight' has shape \(100, 64\).*needs \(192, 64\)"):
        load_model(p)


def test_header_lies_about_sizes(tmp_path):
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    p = tmp_path / "lie.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match="lie.safetensors: corrupt header: tensor 'a'"):
        load_model(p)


def test_errors_are_value_errors_not_torch_tracebacks(tmp_path):
    assert issubclass(engine.CheckpointError, ValueError)
