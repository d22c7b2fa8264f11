"""Z-Image from a prompt: its text encoder (Qwen3 through transformers) and VAE (FLUX.1's AutoencoderKL through
diffusers), which its description names (``Family.companions``), in ``ErnieImagePipeline.from_pretrained`` and
``sgld generate``, against diffusers' own ``ZImagePipeline`` on a tiny random release that diffusers itself saved
(the real component classes at toy sizes; a word-level tokenizer with Qwen's chat markers stands in for Qwen's,
which is not available offline). ComfyUI's single files (``qwen_3_4b.safetensors``: the text tower under
``model.``; ``ae.safetensors``: the VAE in LDM names, written by ComfyUI's own converter) give the folder's picture."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import ErnieImagePipeline, InputError

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_zimage import SHAPE, reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFY = os.path.join(ROOT, ".cache", "ComfyUI")
WORDS = ["a", "red", "cat", "on", "the", "mat", "blue", "sky", "dog", "user", "assistant"]
MARKERS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
# Qwen3's chat template reduced to what ZImagePipeline asks of it (one user turn, the generation prompt)
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RELEASE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}  # Turbo's
CONVERT = """import sys
sys.path.insert(0, sys.argv[1])
from safetensors.torch import load_file, save_file
from comfy.diffusers_convert import convert_vae_state_dict
save_file({k: v.contiguous() for k, v in convert_vae_state_dict(load_file(sys.argv[2])).items()}, sys.argv[3])
"""


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{m: i + 1 for i, m in enumerate(MARKERS)}, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                               additional_special_tokens=MARKERS[:2])
    out.chat_template = CHAT
    return out


def text_encoder(vocab: int):
    """transformers' Qwen3ForCausalLM (the release's class): 2 layers as wide as the DiT's caption features."""
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=SHAPE["cap_feat_dim"], intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   pad_token_id=3, tie_word_embeddings=True)
    torch.manual_seed(2)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def vae():
    """FLUX.1's VAE class at toy widths, its 4 levels (8 pixels per latent cell) and its latent scale and shift."""
    torch.manual_seed(1)
    return diffusers.AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                                   up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
                                   latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159,
                                   use_quant_conv=False, use_post_quant_conv=False,
                                   sample_size=1024).eval()  # the release's: tiled decode above 1024 px only


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    tok = tokenizer()
    pipe = diffusers.ZImagePipeline(transformer=reference(), vae=vae(), text_encoder=text_encoder(len(tok)),
                                    tokenizer=tok, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**RELEASE_SCHEDULER))
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-Turbo"
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def pipes(release):
    ref = diffusers.ZImagePipeline.from_pretrained(release)
    ours = ErnieImagePipeline.from_pretrained(release, cache="off")
    for p in (ref, ours):
        p.set_progress_bar_config(disable=True)
    return ref, ours


def call(pipe, output_type="np", **kw):
    kw = {"height": 64, "width": 48, "num_inference_steps": 4, "negative_prompt": ["dog", "cat"], **kw}
    return pipe(["a red cat on the mat", "blue sky"], generator=torch.Generator().manual_seed(3),
                output_type=output_type, **kw).images


@pytest.mark.parametrize("guidance", [0.0, 3.0], ids=["turbo-no-cfg", "cfg"])
def test_pictures_equal_diffusers_z_image_pipeline(pipes, guidance):
    """diffusers' guidance_scale means the same in ours (Z-Image guides as cond + g (cond - uncond): cfg g + 1)."""
    ref, ours = pipes
    a, b = (call(p, guidance_scale=guidance, output_type="latent") for p in pipes)
    assert a.shape == b.shape == (2, 16, 8, 6)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    a, b = call(ref, guidance_scale=guidance), call(ours, guidance_scale=guidance)
    assert a.shape == (2, 64, 48, 3) and a.std() > 0.01
    assert np.abs(a - b).max() <= 1e-5


def test_its_defaults_and_size_rule_are_its_own(pipes):
    ours = pipes[1]
    assert ours.defaults == {"steps": 9, "cfg": 1.0} and ours.shift == 3.0  # Turbo's; the release's static shift
    assert ours.parts.default_size == 1024
    with pytest.raises(InputError, match="multiple of 16"):  # the VAE's 8 pixels a cell, the DiT's 2x2 patches
        ours("a red cat", height=64, width=40)


def test_a_prompt_enhancer_is_refused_by_name(release, pipes, tmp_path, sgld_in_process):
    """Z-Image's release ships no prompt enhancer (its family names none): --pe and use_pe say so, nothing written."""
    code, _, err = sgld_in_process("generate", "--prompt", "a red cat", "--model-path", release, "--pe", release,
                                   "--width", "48", "--height", "32", "--out", tmp_path / "pe.png")
    assert code != 0 and "--pe: a Z-Image model has no prompt enhancer (its release ships none)" in err, err
    assert not (tmp_path / "pe.png").exists()
    with pytest.raises(InputError, match="use_pe: a Z-Image release has no prompt enhancer"):
        pipes[1]("a red cat", height=32, width=48, use_pe=True)


@pytest.mark.subprocess
def test_sgld_generate_on_the_release_and_on_comfyuis_single_files(release, pipes, tmp_path, sgld_in_process):
    from PIL import Image
    from safetensors.torch import load_file, save_file

    if not os.path.isfile(os.path.join(COMFY, "comfy", "diffusers_convert.py")):
        pytest.skip("the installed ComfyUI (.cache/ComfyUI) is needed for its VAE converter")
    comfy = tmp_path / "models"
    for d in ("text_encoders", "vae"):
        (comfy / d).mkdir(parents=True)
    te = load_file(os.path.join(release, "text_encoder", "model.safetensors"))
    save_file({k: v for k, v in te.items() if k.startswith("model.")}, str(comfy / "text_encoders" / "qwen_3_4b.safetensors"))
    for folder, into in (("text_encoder", "text_encoders"), ("tokenizer", "text_encoders"), ("vae", "vae")):
        for name in os.listdir(os.path.join(release, folder)):
            if not name.endswith(".safetensors"):  # the config and tokenizer beside the single files
                shutil.copy(os.path.join(release, folder, name), comfy / into)
    subprocess.run([sys.executable, "-c", CONVERT, COMFY, os.path.join(release, "vae", "diffusion_pytorch_model.safetensors"),
                    str(comfy / "vae" / "ae.safetensors")], check=True, capture_output=True, timeout=120)
    dit = os.path.join(release, "transformer")
    runs = {"release": ["--model-path", release],
            "single files": ["--model", dit, "--text-encoder", str(comfy / "text_encoders" / "qwen_3_4b.safetensors"),
                             "--vae", str(comfy / "vae" / "ae.safetensors")]}
    pictures = {}
    for name, model in runs.items():
        out = tmp_path / f"{name}.png"
        code, printed, err = sgld_in_process("generate", "--prompt", "a red cat", *model, "--width", "48",
                                             "--height", "32", "--seed", "5", "--out", out)
        assert code == 0, err
        assert "9/9 steps" in printed  # Turbo's defaults: 9 steps at cfg 1
        pictures[name] = np.asarray(Image.open(out))
    want = pipes[1]("a red cat", height=32, width=48, seed=5, output_type="np", scheduler="simple").images[0]
    assert pictures["release"].shape == (32, 48, 3) and pictures["release"].std() > 0
    assert np.abs(pictures["release"].astype(int) - np.round(want * 255)).max() <= 1
    assert np.abs(pictures["release"].astype(int) - pictures["single files"]).max() <= 1


@pytest.mark.server
def test_sgld_serve_answers_the_openai_sdk_with_the_pipelines_picture(release, pipes, tmp_path):
    """A real `sgld serve` process on the release folder, asked through the openai SDK: Turbo's defaults (9 steps at
    cfg 1), the picture the pipeline makes with the same seed, and a size off the 16-pixel rule a 400 naming size."""
    import openai
    from test_serve import Server, client, pixels

    server = Server(tmp_path / "serve.log", "--model-path", release).wait_ready()
    try:
        api = client(server)
        card = api.models.list().data[0]
        assert card.id == "Z-Image-Turbo" and (card.default_steps, card.default_guidance_scale) == (9, 1.0)
        r = api.images.generate(model=card.id, prompt="a red cat", size="48x32", response_format="b64_json",
                                extra_body={"seed": 5})
        got = pixels(r.data[0].b64_json)
        want = pipes[1]("a red cat", height=32, width=48, seed=5, output_type="np", scheduler="simple").images[0]
        assert got.shape == (32, 48, 3) and np.abs(got.astype(int) - np.round(want * 255)).max() <= 1
        with pytest.raises(openai.BadRequestError, match="multiple of 16"):
            api.images.generate(model=card.id, prompt="a red cat", size="40x32", response_format="b64_json")
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def dynamic(release, tmp_path_factory):
    """The release with diffusers' resolution-dependent shift (``use_dynamic_shifting``, Flux's line of mu)."""
    import json

    folder = tmp_path_factory.mktemp("zimage_dynamic") / "Z-Image-dynamic"
    shutil.copytree(release, folder)
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "use_dynamic_shifting": True, "base_shift": 0.5,
                                "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}))
    return str(folder)


def flux_shift(width: int, height: int) -> float:
    """exp(mu), mu on the line from (256 tokens, 0.5) to (4096, 1.15); a token is 16 x 16 pixels."""
    import math

    tokens = (width // 16) * (height // 16)
    return math.exp(0.5 + (tokens - 256) * (1.15 - 0.5) / (4096 - 256))


def test_a_dynamic_shift_is_each_sizes_own(dynamic, tmp_path, sgld_in_process):
    """Issue 47: the shift of a release with use_dynamic_shifting follows the picture's size as diffusers' ZImagePipeline
    computes it (its latents at two sizes, within the tolerance of the static release's test); sgld generate and the
    server take the same shift at each size."""
    import json

    from engine.cli.serve import _parsed, served_model
    from engine.serve.protocol import parse_generation

    ref = diffusers.ZImagePipeline.from_pretrained(dynamic)
    ours = ErnieImagePipeline.from_pretrained(dynamic, cache="off")
    for p in (ref, ours):
        p.set_progress_bar_config(disable=True)
    for height, width in ((64, 48), (128, 96)):
        a, b = (call(p, height=height, width=width, guidance_scale=0.0, output_type="latent") for p in (ref, ours))
        assert (a - b).abs().max() <= 1e-4 * a.abs().max(), (height, width)
    out = tmp_path / "dynamic.png"
    code, printed, err = sgld_in_process("generate", "--prompt", "a red cat", "--model-path", dynamic, "--width", "48",
                                         "--height", "32", "--seed", "5", "--out", out, "--json")
    assert code == 0, err
    assert json.loads(printed.strip().splitlines()[-1])["shift"] == pytest.approx(flux_shift(48, 32))
    served = served_model(_parsed(["serve", "--model-path", dynamic]))
    try:
        for size in ((48, 32), (128, 96)):
            gen = parse_generation({"prompt": "a red cat", "size": f"{size[0]}x{size[1]}"}, served)
            assert gen.options.shift == pytest.approx(flux_shift(*size)), size
    finally:
        served.engine.release()
