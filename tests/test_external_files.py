"""`sgld generate --model --text-encoder --vae`: ERNIE-Image files instead of the demo, with tiny random
checkpoints of the real architectures (the 16 GB release cannot be downloaded here): a Ministral3
text encoder through transformers, diffusers' AutoencoderKLFlux2, the tiny ERNIE-Image DiT."""
import base64
import io
import json
import os
import pickle
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import requests
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from engine.models.random_weights import SIZES, save_random_checkpoint  # noqa: E402

WORDS = ["a", "red", "cat", "on", "the", "mat", "blue", "sky"]


def write_text_encoder(folder, hidden: int):
    """A 2-layer Ministral3 with a word-level tokenizer (the real Tekken tokenizer is not available offline)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")
    cfg = transformers.Ministral3Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=hidden // 4, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    transformers.Ministral3Model(cfg).save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder.parent / "tokenizer")  # the HF release's layout: text_encoder/ and tokenizer/
    return folder


def write_vae(folder, dit_channels: int):
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLFlux2(block_out_channels=(16, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                       up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                       norm_num_groups=8, latent_channels=dit_channels // 4)
    vae.bn.running_mean.normal_()  # non-trivial statistics, so the de-normalisation matters
    vae.bn.running_var.uniform_(0.5, 2.0)
    vae.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def ernie_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ernie")
    cfg = SIZES["tiny"]
    save_random_checkpoint(str(d / "dit.safetensors"), cfg, seed=0)
    return {"model": str(d / "dit.safetensors"), "te": str(write_text_encoder(d / "text_encoder", cfg.text_in_dim)),
            "vae": str(write_vae(d / "vae", cfg.in_channels)), "dir": d}


SGLD = os.path.join(os.path.dirname(sys.executable), "sgld")


def test_generate_from_ernie_files_writes_png_and_json(ernie_files, tmp_path, sgld_in_process):
    from PIL import Image

    out = tmp_path / "ernie.png"
    code, stdout, err = sgld_in_process(
        "generate", "--prompt", "a red cat on the mat", "--model", ernie_files["model"], "--text-encoder",
        ernie_files["te"], "--vae", ernie_files["vae"], "--width", "32", "--height", "48", "--steps", "3", "--cfg",
        "2.0", "--out", str(out), "--json")
    assert code == 0, err
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["model"] == "dit.safetensors" and result["model_calls"] == 3 and result["calls_computed"] == 3
    assert result["load_seconds"] > 0 and result["sampling_seconds"] > 0
    img = Image.open(out)
    assert img.size == (32, 48)
    assert json.loads(img.text["prompt"])["prompt"] == "a red cat on the mat"
    assert np.asarray(img).std() > 0  # a decoded picture, not a constant


def test_text_features_are_the_input_of_the_last_layer_with_bos(ernie_files):
    import transformers

    from engine.models.external import TextEncoder

    te = TextEncoder.load(ernie_files["te"])
    ids = te.token_ids("a blue sky")
    assert ids[0, 0].item() == 1 and ids.shape[1] == 4  # BOS + three words
    assert te.token_ids("").tolist() == [[1]]  # the empty prompt is BOS alone
    model = transformers.Ministral3Model.from_pretrained(ernie_files["te"])
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = te.encode("a blue sky")
    assert torch.equal(feats, states[-2][0])
    assert not torch.allclose(feats, states[-1][0])  # not the final (normed) output


def test_vae_decode_inverts_the_patchify_and_normalisation(ernie_files):
    """Encode an image the reference way (VAE encode, patchify 2x2, BN-normalise), decode with ours:
    the result matches decoding the raw VAE latent directly."""
    from engine.models.external import BN_EPS, Flux2VAE

    vae = Flux2VAE.load(ernie_files["vae"])
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        z = vae.vae.encode(x).latent_dist.mean
        b, c, h, w = z.shape
        p = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
        bn = vae.vae.bn
        p = (p - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(bn.running_var.view(1, -1, 1, 1) + BN_EPS)
        direct = ((vae.vae.decode(z).sample.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    ours = vae.decode(p)
    assert ours.shape == (1, 32, 32, 3)
    assert (ours.int() - direct.int()).abs().max() <= 1
    assert vae.stride == 4  # 2 VAE blocks (one 2x downsample) x patch 2; the release: 8 x 2 = 16
    assert vae.empty_latent(64, 32).shape == (1, 16, 8, 16)


def test_bad_external_inputs_get_clear_errors(ernie_files, tmp_path, sgld_in_process):
    base = ["generate", "--prompt", "a cat", "--out", str(tmp_path / "x.png"), "--model", ernie_files["model"]]
    te, vae = ["--text-encoder", ernie_files["te"]], ["--vae", ernie_files["vae"]]

    code, _, err = sgld_in_process(*base)
    assert code == 2 and "missing --text-encoder, --vae" in err

    pickled = tmp_path / "pickled_te"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    with open(pickled / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": 1}, f)
    code, _, err = sgld_in_process(*base, "--text-encoder", str(pickled), *vae)
    assert code == 2 and "pickled_te" in err and "pytorch_model.bin" in err and "refus" in err  # refused / refusing

    code, _, err = sgld_in_process(*base, *te, *vae, "--width", "30")
    assert code == 2 and "30x1024 is not a positive multiple of 4" in err

    code, _, err = sgld_in_process(*base, "--text-encoder", ernie_files["model"], *vae)
    assert code == 2 and "dit.safetensors': a single file needs its config" in err
    assert "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_a_size_over_the_limit_is_refused_before_anything_loads(ernie_files, tmp_path, sgld_in_process):
    """--width 100000 used to allocate about 40 GB at the first step; now one line before loading."""
    code, _, err = sgld_in_process("generate", "--prompt", "a cat", "--model", ernie_files["model"], "--text-encoder",
                                   ernie_files["te"], "--vae", ernie_files["vae"], "--width", "100000", "--out",
                                   str(tmp_path / "x.png"))
    assert code == 2
    assert err.strip() == ("sgld generate: error: --width must be from 1 to 4096 pixels (got 100000; ERNIE-Image's "
                           "largest documented size is 2048x2048)")


def test_a_damaged_model_stops_the_run_with_a_clear_error_and_writes_nothing(ernie_files, tmp_path, sgld_in_process):
    """A DiT with one NaN weight used to write a blank picture (exit 0) whose metadata held NaN."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(ernie_files["model"], "pt") as f:
        meta = f.metadata()
    sd = load_file(ernie_files["model"])
    sd["layers.0.self_attention.to_v.weight"][0, 0] = float("nan")
    save_file(sd, str(tmp_path / "nan.safetensors"), metadata=meta)
    out = tmp_path / "x.png"
    code, _, err = sgld_in_process("generate", "--prompt", "a red cat", "--model", str(tmp_path / "nan.safetensors"),
                                   "--text-encoder", ernie_files["te"], "--vae", ernie_files["vae"], "--width", "32",
                                   "--height", "32", "--steps", "3", "--out", str(out))
    assert code == 2, err
    assert ("sgld generate: error: the model produced NaN/inf at step 1 of 3 (model call 1 of 3): the weights may be "
            "damaged") in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.server
def test_serve_from_ernie_files(ernie_files, tmp_path):
    """`sgld serve` with ERNIE-Image files: the file's name is the model's id, a *turbo* file defaults to Turbo's
    8 steps and cfg 1, other sizes than the demo's are made, and a size the VAE cannot make is a 400."""
    from PIL import Image

    turbo = tmp_path / "ernie-image-turbo.safetensors"
    os.symlink(ernie_files["model"], turbo)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([SGLD, "serve", "--port", str(port), "--model", str(turbo), "--text-encoder",
                             ernie_files["te"], "--vae", ernie_files["vae"], "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stdout.read()
            try:
                if requests.get(url + "/health", timeout=2).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.2)
        card = requests.get(url + "/v1/models", timeout=10).json()["data"][0]
        assert (card["id"], card["default_steps"], card["default_guidance_scale"]) == ("ernie-image-turbo", 8, 1.0)
        r = requests.post(url + "/v1/images/generations", json={"prompt": "a red cat", "size": "32x48", "seed": 1,
                                                                 "num_inference_steps": 2}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model_calls"] == 2 and r.json()["guidance_scale"] == 1.0
        assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size == (32, 48)
        r = requests.post(url + "/v1/images/generations", json={"prompt": "a red cat", "size": "30x30"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
