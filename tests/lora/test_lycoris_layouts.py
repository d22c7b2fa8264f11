"""The LoRA layouts that trainers with ERNIE-Image support write (ai-toolkit, OneTrainer, musubi-tuner,
DiffSynth-Studio, SimpleTuner; docs/lora.md), our LoKr / LoHa merges against the vendored ComfyUI's own weight
adapters, and SGLDiffusion LoRA Loader in-process with a LoKr file; under torch.inference_mode()."""
import pytest
import torch
from lora_files import close_to_reference, shape_of, tiny_engine
from lycoris_files import CONV, KINDS, LINEARS, lycoris_file, merged_reference
from safetensors.torch import load_file, save_file

from engine.features.lora import target_modules


# -- the layouts trainers with ERNIE-Image support write (docs/lora.md, "Trainers") --------------------------
def _flat(prefix):
    return lambda m: prefix + m.replace(".", "_")


def _lora_pairs(sd, m, a, b, down_key, up_key, alpha_key=None, alpha=None):
    sd[down_key] = a.contiguous()
    sd[up_key] = b.contiguous()
    if alpha_key:
        sd[alpha_key] = torch.tensor(alpha)


TRAINERS = {
    # ostris/ai-toolkit: PEFT names with the ComfyUI prefix (lora_keys_use_comfy_prefix); LoKr keeps .alpha
    "ai-toolkit": ("lokr_decomposed", lambda m: "diffusion_model." + m,
                   lambda m: (f"diffusion_model.{m}.lora_A.weight", f"diffusion_model.{m}.lora_B.weight", None)),
    # ai-toolkit's old LoKr format: lycoris_ flat names
    "ai-toolkit-old-lokr": ("lokr_full", _flat("lycoris_"), None),
    # Nerogar/OneTrainer: legacy (kohya) keys under lora_unet_; LoHa / LoKr keys lose their dot in that conversion
    "onetrainer": ("loha", None, lambda m: (_flat("lora_unet_")(m) + ".lora_down.weight",
                                            _flat("lora_unet_")(m) + ".lora_up.weight", _flat("lora_unet_")(m) + ".alpha")),
    "onetrainer-lokr": ("lokr_decomposed", None, None),
    # kohya-ss/musubi-tuner: lora_unet_ (networks/lora_ernie_image.py), LoKr with a top-level lokr_factor buffer
    "musubi-tuner": ("lokr_decomposed", _flat("lora_unet_"),
                     lambda m: (_flat("lora_unet_")(m) + ".lora_down.weight", _flat("lora_unet_")(m) + ".lora_up.weight",
                                _flat("lora_unet_")(m) + ".alpha")),
    # modelscope/DiffSynth-Studio: PEFT's injected names, bare (its DiT has the diffusers module names)
    "diffsynth": (None, None, lambda m: (f"{m}.lora_A.default.weight", f"{m}.lora_B.default.weight", None)),
    # bghira/SimpleTuner: diffusers PEFT (transformer.), LyCORIS LoKr (its default) as lycoris_ flat names
    "simpletuner": ("lokr_full", _flat("lycoris_"),
                    lambda m: (f"transformer.{m}.lora_A.weight", f"transformer.{m}.lora_B.weight", None)),
}


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_trainer_layouts_load_every_key(tmp_path, trainer):
    kind, lyco_key, lora_keys = TRAINERS[trainer]
    eng = tiny_engine(torch.bfloat16)
    base = {k: v.clone() for k, v in eng.model.state_dict().items()}
    modules = LINEARS[:4]
    with torch.inference_mode():
        if kind is not None:
            extra = {"lokr_factor": torch.tensor(-1)} if trainer == "musubi-tuner" else None
            if trainer.startswith("onetrainer"):  # "lora_unet_layers_0_mlp_gate_proj_hada_w1_a"
                path, made = lycoris_file(tmp_path / "l.safetensors", kind, modules, key=_flat("lora_unet_"))
                sd = {k.replace(".hada_", "_hada_").replace(".lokr_", "_lokr_"): v for k, v in load_file(path).items()}
                assert all(k.count(".") == 0 for k in sd if "_hada_" in k or "_lokr_" in k)
                save_file(sd, path)
            else:
                path, made = lycoris_file(tmp_path / "l.safetensors", kind, modules, key=lyco_key, extra=extra)
            assert eng.set_loras([(path, 1.0)]) == [], trainer
            for m in modules:
                k = m + ".weight"
                close_to_reference(eng.model.state_dict()[k], merged_reference(base[k], [(made[m], 1.0)]))
            eng.set_loras([])
        if lora_keys is not None:
            g = torch.Generator().manual_seed(4)
            sd = {}
            pairs = {}
            for m in modules:
                o, i = shape_of(m)
                a, b = torch.randn(4, i, generator=g) * 0.1, torch.randn(o, 4, generator=g) * 0.1
                pairs[m] = (a, b)
                down, up, alpha = lora_keys(m)
                _lora_pairs(sd, m, a, b, down, up, alpha, 8.0)
            save_file(sd, str(tmp_path / "lora.safetensors"))
            assert eng.set_loras([(str(tmp_path / "lora.safetensors"), 1.0)]) == [], trainer
            for m in modules:
                k = m + ".weight"
                a, b = pairs[m]
                scale = 2.0 if lora_keys(m)[2] else 1.0
                ref = (base[k].double() + scale * b.double() @ a.double()).to(base[k].dtype)
                close_to_reference(eng.model.state_dict()[k], ref)
            eng.set_loras([])
    assert all(torch.equal(v, base[k]) for k, v in eng.model.state_dict().items())


def test_lora_loader_node_applies_a_lokr_file(pack):
    path, made = lycoris_file(pack.loras / "lokr.safetensors", "lokr_decomposed", LINEARS[:2])
    node = pack.node.SGLDiffusionLoraLoader()
    base = pack.mc.SGLDModel(pack.path, pack.EngineConfig(), owner="1")
    with torch.inference_mode():
        eng = base.engine()
        w0 = {m: target_modules(eng.model)[m].weight.clone() for m in LINEARS[:2]}
        handle = node.load(base, "lokr.safetensors", 0.5)[0]
        assert handle.engine() is eng
        for m in LINEARS[:2]:
            close_to_reference(target_modules(eng.model)[m].weight, merged_reference(w0[m], [(made[m], 0.5)]))
        base.engine()
        assert all(torch.equal(target_modules(eng.model)[m].weight, w0[m]) for m in LINEARS[:2])


# -- against ComfyUI's own code ---------------------------------------------------------------------------------
COMFY_MERGE = """
import sys
base_file, jobs, sys.argv = sys.argv[1], sys.argv[2:], [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.lora
from safetensors.torch import load_file, save_file
base = load_file(base_file)
to_load = {"lycoris_" + k[: -len(".weight")].replace(".", "_"): k for k in base}
for lora_file, out_file in zip(jobs[::2], jobs[1::2]):
    patches = comfy.lora.load_lora(load_file(lora_file), to_load)
    save_file({k: comfy.lora.calculate_weight([(0.7, patches[k], 1.0, None, None)], base[k].clone(), k) for k in base},
              out_file)
"""


@pytest.mark.subprocess  # runs ComfyUI's weight_adapter code in its own Python process
def test_merge_equals_comfyuis_own_weight_adapters(tmp_path):
    """comfy.lora.load_lora + calculate_weight of the vendored ComfyUI (its LoKrAdapter / LoHaAdapter), in one
    subprocess, on the same float32 weights: our merge gives the same weights (float32 rounding apart). Where
    ComfyUI fails (torch.kron on the LoKr Tucker einsum's non-contiguous result: it logs an error and leaves the
    weight), ComfyUI's weight is the base and ours is the hand merge (docs/lora.md)."""
    import os
    import subprocess
    import sys

    import comfy_server as cs

    eng = tiny_engine(torch.float32)
    modules = LINEARS + [CONV]
    base = {m + ".weight": target_modules(eng.model)[m].weight.detach().clone().contiguous() for m in modules}
    save_file(base, str(tmp_path / "base.safetensors"))
    jobs, made = [], {}
    for kind in KINDS:
        path, made[kind] = lycoris_file(tmp_path / f"{kind}.safetensors", kind, modules)
        jobs += [path, str(tmp_path / f"{kind}-comfy.safetensors")]
    comfy_dir = cs.ensure_comfyui()
    subprocess.run([sys.executable, "-c", COMFY_MERGE, str(tmp_path / "base.safetensors")] + jobs, cwd=comfy_dir,
                   check=True, timeout=300, env=dict(os.environ, PYTHONPATH=comfy_dir), capture_output=True)
    with torch.inference_mode():
        for kind in KINDS:
            theirs = load_file(str(tmp_path / f"{kind}-comfy.safetensors"))
            assert eng.set_loras([(str(tmp_path / f"{kind}.safetensors"), 0.7)]) == []
            for m in modules:
                k, ours = m + ".weight", target_modules(eng.model)[m].weight
                if kind == "lokr_tucker" and m == CONV:
                    assert torch.equal(theirs[k], base[k])  # ComfyUI's failure, logged and skipped
                    close_to_reference(ours, merged_reference(base[k], [(made[kind][m], 0.7)]))
                    continue
                assert not torch.equal(theirs[k], base[k]), (kind, m)  # ComfyUI applied it
                torch.testing.assert_close(ours, theirs[k], rtol=1e-5, atol=1e-6)
        eng.set_loras([])
