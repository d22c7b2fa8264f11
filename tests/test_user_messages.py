"""What the pack tells a user in words (issue 49 item 6): the demo's one picture size, the comfy-kitchen install
hint, `sgld quantize --help` and the load log. Each message is read where a user reads it: an error, a node's
widgets, the help text, the log."""
from __future__ import annotations

import logging
import sys
import types

import pack_modules
import pytest
import torch

from engine.cli import build_parser
from engine.errors import InputError
from engine.features.quant.comfy import numerics
from engine.inputs import check_latent
from engine.loading import load_model
from engine.models.random_weights import SIZES, save_random_checkpoint


def test_a_wrong_latent_into_the_demo_names_its_one_size():
    """ComfyUI's Empty Latent (4 channels) into the demo: the message said "at 1/4 of its size", as if other sizes
    were a matter of the latent's size; the demo makes 64x64 pictures only."""
    demo = types.SimpleNamespace(in_channels=48, patch_size=1)
    with pytest.raises(InputError) as e:
        check_latent(demo, torch.zeros(1, 4, 8, 8))
    msg = str(e.value)
    assert "makes 64x64 pictures only" in msg and "SGLDiffusion Demo Empty Latent" in msg, msg
    assert "1/4" not in msg and "of its size" not in msg, msg


def test_demo_empty_latent_shows_the_size_it_makes():
    demo = pack_modules.node_module("demo")
    node = demo.SGLDiffusionDemoEmptyLatent
    choices, spec = node.INPUT_TYPES()["optional"]["size"]
    assert choices == ["64x64"] and spec["default"] == "64x64" and "64x64 pictures only" in spec["tooltip"]
    assert "64x64 pictures only" in node.DESCRIPTION
    # a graph saved before the widget existed runs as before
    assert node().generate(2)[0]["samples"].shape == (2, 48, 16, 16)


def test_without_comfy_kitchen_the_hint_works_for_a_cloned_pack(monkeypatch):
    """A user who cloned the pack into custom_nodes has no 'comfyui-sgldiffusion' package to add an extra to: the
    hint installs comfy-kitchen itself, with the Python that runs ComfyUI."""
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # its import fails
    monkeypatch.setattr(numerics, "_kitchen", None)
    msg = numerics.kitchen_missing()
    assert "python -m pip install comfy-kitchen" in msg and "the Python that runs ComfyUI" in msg, msg
    assert "[kitchen]" not in msg and "comfyui-sgldiffusion" not in msg, msg


def test_quantize_help_names_each_file_kind_once(capsys):
    """Two writers make .safetensors files (sgld's layout and ComfyUI's): the help read "(.safetensors or .gguf or
    .safetensors)"."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "write a file (.safetensors or .gguf) that the loader" in text, text
    assert "the file to write: .safetensors or .gguf, as --format says" in text, text
    assert ".gguf or .safetensors" not in text, text


def test_load_log_of_a_dense_file_quantized_at_load(tmp_path, caplog):
    """It read "0 no layers (plain), quantized to fp8 at load"."""
    path = tmp_path / "tiny.safetensors"
    save_random_checkpoint(str(path), SIZES["tiny"], seed=0)
    with caplog.at_level(logging.INFO, logger="sgld.quant"):
        load_model(str(path), quant="fp8")
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert loaded == [f"loaded {path}: dense weights, quantized to fp8 at load"], loaded


def test_a_comfyui_format_lora_is_not_called_kohya(tmp_path):
    """Issue 49 item 6: ComfyUI's keys (``diffusion_model.<module>.lora_up.weight``) are named as ComfyUI's in the
    log, kohya's flat ``lora_unet_<module>`` keys as kohya's."""
    from lora_files import make_pairs, tiny_engine, write_lora

    eng = tiny_engine()
    pairs = make_pairs(["layers.0.self_attention.to_q"], seed=1)
    comfy = write_lora(tmp_path / "comfy.safetensors", pairs, "comfy_generic", alpha=1.0)
    kohya = write_lora(tmp_path / "kohya.safetensors", pairs, "kohya", alpha=1.0)
    from engine.features.lora import read_lora

    assert "format comfyui" in read_lora(comfy, eng.model).describe()
    assert "format kohya" in read_lora(kohya, eng.model).describe()
