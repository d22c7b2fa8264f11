"""ComfyUI's single files for ERNIE-Image's text encoder and VAE (engine/models/external.py), from a tiny random
release that diffusers itself saved (tests/tiny_release.py).

The files are written in ComfyUI's layouts: the text encoder as ComfyUI's ``ministral-3-3b.safetensors`` holds it
(the Ministral-3 text tower under ``model.``, no vision tower, the Tekken vocabulary as a ``tekken_model`` byte
tensor; shared/reference/ernie_image.md §3.1), the VAE converted from diffusers' names to the LDM names of
``flux2-vae.safetensors`` by ComfyUI's own converter (comfy/diffusers_convert.py ``convert_vae_state_dict`` of the
installed ComfyUI, run in its own process), so the test's files do not come from the code under test. That
converter assumes the 4 resolution levels of the SD / Flux.2 VAE, so the release's VAE is replaced here by a tiny
4-level one (diffusers' save_pretrained, as the rest of the release)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import CheckpointError, ErnieImagePipeline
from engine.errors import InputError
from engine.models.random_weights import SIZES

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_release  # noqa: E402

pytestmark = [pytest.mark.subprocess]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFY = os.path.join(ROOT, ".cache", "ComfyUI")
CONVERT = """import sys
sys.path.insert(0, sys.argv[1])
from safetensors.torch import load_file, save_file
from comfy.diffusers_convert import convert_vae_state_dict
save_file({k: v.contiguous() for k, v in convert_vae_state_dict(load_file(sys.argv[2])).items()}, sys.argv[3])
"""


def four_levels(latent_channels):
    import diffusers

    torch.manual_seed(1)
    v = diffusers.AutoencoderKLFlux2(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                                     up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
                                     latent_channels=latent_channels)
    v.bn.running_mean.normal_()
    v.bn.running_var.uniform_(0.5, 2.0)
    return v.eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    if not os.path.isfile(os.path.join(COMFY, "comfy", "diffusers_convert.py")):
        pytest.skip("the installed ComfyUI (.cache/ComfyUI) is needed for its VAE converter")
    tmp = tmp_path_factory.mktemp("single")
    release = tiny_release.write_release(tmp / "ERNIE-Image")
    shutil.rmtree(os.path.join(release, "vae"))
    four_levels(SIZES["tiny"].in_channels // 4).save_pretrained(os.path.join(release, "vae"))
    comfy = tmp / "ComfyUI" / "models"
    for d in ("diffusion_models", "text_encoders", "vae"):
        (comfy / d).mkdir(parents=True)
    dit = comfy / "diffusion_models" / "ernie-image.safetensors"
    shutil.copy(os.path.join(release, "transformer", "diffusion_pytorch_model.safetensors"), dit)
    hf = load_file(os.path.join(release, "text_encoder", "model.safetensors"))
    tower = "language_model.model."  # transformers' saved name of Mistral3Model's text tower
    te = {"model." + k[len(tower):]: v for k, v in hf.items() if k.startswith(tower)}
    te["tekken_model"] = torch.frombuffer(bytearray(b'{"vocab": []}'), dtype=torch.uint8)
    te_file = comfy / "text_encoders" / "ministral-3-3b.safetensors"
    save_file(te, str(te_file))
    vae_file = comfy / "vae" / "flux2-vae.safetensors"
    subprocess.run([sys.executable, "-c", CONVERT, COMFY, os.path.join(release, "vae", "diffusion_pytorch_model.safetensors"),
                    str(vae_file)], check=True, capture_output=True, timeout=120)
    return {"release": release, "dit": str(dit), "te": str(te_file), "vae": str(vae_file), "comfy": comfy}


def image(pipe, **kw):
    pipe.set_progress_bar_config(disable=True)
    return pipe("a red cat on the mat", height=64, width=96, num_inference_steps=3, guidance_scale=4.0,
                negative_prompt="dog", generator=torch.Generator().manual_seed(3), output_type="np", **kw).images


def test_files_are_in_comfyuis_layouts(files):
    from safetensors import safe_open

    with safe_open(files["vae"], "pt") as f:
        assert {"encoder.down.0.block.0.conv1.weight", "decoder.up.0.block.0.conv1.weight", "bn.running_mean",
                "quant_conv.weight"} <= set(f.keys()) and f.get_tensor("decoder.mid.attn_1.q.weight").ndim == 4
    with safe_open(files["te"], "pt") as f:
        assert "model.layers.0.post_attention_layernorm.weight" in f.keys() and not any("vision" in k for k in f.keys())


def test_single_files_give_the_release_folders_image(files):
    release = files["release"]
    folder = image(ErnieImagePipeline.from_pretrained(release, cache="off"))
    single = image(ErnieImagePipeline.from_pretrained(
        files["dit"], text_encoder=files["te"], vae=files["vae"], cache="off",
        text_encoder_config=os.path.join(release, "text_encoder"), vae_config=os.path.join(release, "vae")),
        shift=4.0)  # no scheduler config beside a single DiT file: the release's shift given
    # the same weights; the text tower runs as Ministral3Model instead of inside Mistral3Model, which can move a
    # float32 rounding (measured: features of the 1-token empty prompt 7e-9 apart; this image bit-equal)
    assert np.abs(single - folder).max() <= 1e-5


def test_bfl_layout_and_prefixed_vae_files_load_the_same_weights(files, tmp_path):
    """BFL's own Flux.2 ``ae.safetensors`` keeps the quant convs inside encoder/decoder (ComfyUI's comfy/sd.py
    renames them the same way); a checkpoint-embedded VAE carries ``vae.``; the BatchNorm's step counter may be
    absent."""
    import diffusers
    from safetensors.torch import load_file, save_file

    from engine.models.external import Flux2VAE

    renames = {"quant_conv.": "encoder.quant_conv.", "post_quant_conv.": "decoder.post_quant_conv."}
    sd = {"vae." + next((new + k[len(old):] for old, new in renames.items() if k.startswith(old)), k): v
          for k, v in load_file(files["vae"]).items() if k != "bn.num_batches_tracked"}
    assert "vae.encoder.quant_conv.weight" in sd
    save_file(sd, str(tmp_path / "ae.safetensors"))
    ours = Flux2VAE.load(str(tmp_path / "ae.safetensors"), config=os.path.join(files["release"], "vae")).vae.state_dict()
    ref = diffusers.AutoencoderKLFlux2.from_pretrained(os.path.join(files["release"], "vae")).state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


def test_wrong_or_configless_single_files_are_named(files, tmp_path):
    from engine.models.external import Flux2VAE

    release = files["release"]
    lone = tmp_path / "flux2-vae.safetensors"  # no config beside it: AutoencoderKLFlux2's defaults (Flux.2's sizes)
    shutil.copy(files["vae"], lone)
    with pytest.raises(CheckpointError, match=r"VAE '.*flux2-vae\.safetensors'.*key '.*' is .* but the config "
                                              r"makes it \[512, 512, 3, 3\]"):  # the largest misshapen key
        Flux2VAE.load(str(lone))
    with pytest.raises(CheckpointError, match=r"ministral-3-3b\.safetensors.*needs its config.*text_encoder_config="):
        ErnieImagePipeline.from_pretrained(files["dit"], text_encoder=files["te"], vae=files["vae"])
    with pytest.raises(CheckpointError, match=r"VAE '.*ernie-image\.safetensors'.*key '.*' is "):
        ErnieImagePipeline.from_pretrained(files["dit"], text_encoder=files["te"], vae=files["dit"],
                                           text_encoder_config=os.path.join(release, "text_encoder"),
                                           vae_config=os.path.join(release, "vae"))
    with pytest.raises(CheckpointError, match=r"text encoder '.*flux2-vae\.safetensors'.*key '"):
        ErnieImagePipeline.from_pretrained(files["dit"], text_encoder=files["vae"], vae=files["vae"],
                                           text_encoder_config=os.path.join(release, "text_encoder"),
                                           vae_config=os.path.join(release, "vae"))
    # a config is for single files: with a folder (which has its own config.json) it is refused, not ignored
    with pytest.raises(InputError, match=r"text encoder '.*text_encoder' is a folder with its own config.json"):
        ErnieImagePipeline.from_pretrained(files["dit"], text_encoder=os.path.join(release, "text_encoder"),
                                           vae=files["vae"], text_encoder_config=os.path.join(release, "text_encoder"))
    with pytest.raises(InputError, match=r"VAE '.*vae' is a folder with its own config.json"):
        Flux2VAE.load(os.path.join(release, "vae"), config=os.path.join(release, "vae"))


def test_sgld_generate_takes_the_single_files(files, tmp_path, sgld_in_process):
    from PIL import Image

    release, comfy = files["release"], files["comfy"]
    for name in os.listdir(os.path.join(release, "tokenizer")):  # the config and tokenizer beside the files
        shutil.copy(os.path.join(release, "tokenizer", name), comfy / "text_encoders")
    shutil.copy(os.path.join(release, "text_encoder", "config.json"), comfy / "text_encoders")
    shutil.copy(os.path.join(release, "vae", "config.json"), comfy / "vae")
    outs = []
    for i, model in enumerate((["--model", files["dit"], "--text-encoder", files["te"], "--vae", files["vae"]],
                               ["--model", files["dit"], "--text-encoder", os.path.join(release, "text_encoder"),
                                "--vae", os.path.join(release, "vae")])):  # the same run from the release's folders
        out = tmp_path / f"{i}.png"
        code, _, err = sgld_in_process("generate", "--prompt", "a red cat", *model, "--width", "32", "--height",
                                       "48", "--steps", "2", "--seed", "1", "--out", str(out))
        assert code == 0, err
        outs.append(np.asarray(Image.open(out)))
    # as above: measured 1 level of 255 at one pixel, from the 7e-9 of the empty negative prompt's features
    assert outs[0].std() > 0 and np.abs(outs[0].astype(int) - outs[1]).max() <= 1
