"""A LoRA held in memory (engine.features.lora.LoRATensors, issue 25 item 1): the engine applies it exactly as the
same tensors read from a file, keeps it active while it is the same object, names it and the user's keys in its
messages, and restores the base bit-exactly. In this process, under inference mode as ComfyUI runs nodes."""
from __future__ import annotations

import pytest
import torch
from lora_files import MODULES, make_pairs, tiny_engine, weights_hash, write_lora
from safetensors.torch import load_file

from engine.features.lora import LoRAError, LoRAState, LoRATensors, files


def as_tensors(path: str, name: str, origin=None) -> LoRATensors:
    return LoRATensors(name, load_file(path), dict(origin or {}))


def test_in_memory_equals_the_file_and_restores_exactly(tmp_path, monkeypatch):
    path = write_lora(tmp_path / "a.safetensors", make_pairs(MODULES), "comfy_generic", alpha=2.0)
    eng = tiny_engine()
    base = weights_hash(eng.model)
    with torch.inference_mode():
        eng.set_loras([(path, 0.7)])
        from_file = weights_hash(eng.model)
        eng.set_loras([])
        assert weights_hash(eng.model) == base
        lora = as_tensors(path, "a.safetensors (LoraLoaderModelOnly, node 21)")
        eng.set_loras([(lora, 0.7)])
        assert weights_hash(eng.model) == from_file != base
        assert eng.loras == [("a.safetensors (LoraLoaderModelOnly, node 21)", 0.7)]
        calls = []
        for name in ("read_lora",):
            orig = getattr(files, name)
            monkeypatch.setattr(files, name, lambda *a, _o=orig, **k: calls.append(a) or _o(*a, **k))
        orig_apply = LoRAState.apply
        monkeypatch.setattr(LoRAState, "apply", lambda self, loras: calls.append(loras) or orig_apply(self, loras))
        eng.set_loras([(lora, 0.7)])  # the same object: nothing re-read, nothing re-merged
        assert calls == [] and weights_hash(eng.model) == from_file
        eng.set_loras([])
        assert weights_hash(eng.model) == base


def test_messages_name_the_users_file_and_keys(tmp_path):
    path = write_lora(tmp_path / "b.safetensors", make_pairs(MODULES[:1]), "comfy_generic", alpha=2.0,
                      dtype=torch.float32)
    weights = load_file(path)
    ours = "diffusion_model.layers.0.self_attention.to_q.lora_up.weight"
    weights[ours][0, 0] = float("nan")
    user = "lora_unet_layers_0_self_attention_to_q.lora_up.weight"
    lora = LoRATensors("b.safetensors (LoraLoaderModelOnly, node 3)", weights, {ours: user})
    eng = tiny_engine()
    base = weights_hash(eng.model)
    with torch.inference_mode(), pytest.raises(LoRAError) as e:
        eng.set_loras([(lora, 1.0)])
    assert str(e.value).startswith(f"b.safetensors (LoraLoaderModelOnly, node 3): '{user}' holds NaN"), str(e.value)
    assert weights_hash(eng.model) == base and eng.loras == []
