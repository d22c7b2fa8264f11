"""Rules every entry point shares (issue 33, points 6-9 and 12), through the real commands and the real pipeline:
the CPU threads a run takes (the demo 1, any other model torch's own, --threads overrides), the release's sigma
shift, the demo's GGUF copy end to end, the order of the errors about missing files, and the words the demo does
not know. The commands run in this process (``cli.main``, its thread setting undone after each; a subprocess costs
seconds of interpreter start per run); for `sgld serve`, ``served_model``: what cmd_serve runs before its batcher
takes the process's thread count. The ERNIE-Image model is tests/tiny_release.py's (diffusers-saved, toy sizes)."""
from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch

from engine import ErnieImagePipeline
from engine.cli import build_parser, main
from tests.test_cli_errors import png_pixels

pytest.importorskip("diffusers")
PROMPT = "a large red circle on the left, on a blue background"
SMALL = ["--width", "64", "--height", "64", "--steps", "3"]  # the tiny VAE's stride is 4: 16x16 latents


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from tests.tiny_release import RELEASE_SCHEDULER, write_release

    assert RELEASE_SCHEDULER["shift"] == 4.0  # ComfyUI's default is 3.0: the release's must be seen to win
    root = tmp_path_factory.mktemp("tiny") / "ERNIE-Image-Tiny"
    write_release(root)
    return str(root)


TORCH_THREADS = 2  # "torch's choice" in this process: set before each run (a 2-core machine's default)


@pytest.fixture(autouse=True)
def threads():
    """Each test starts on TORCH_THREADS and gives the process its own count back (the commands set it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def sgld(capsys):
    """``sgld ARGV`` in this process -> (exit code, stdout, stderr); the thread count back to TORCH_THREADS."""
    def run(*argv):
        torch.set_num_threads(TORCH_THREADS)
        try:
            code = main(list(argv))
        except SystemExit as e:  # --help
            code = e.code
        finally:
            torch.set_num_threads(TORCH_THREADS)
        out, err = capsys.readouterr()
        return code, out, err
    return run


@pytest.fixture
def generate_json(sgld):
    def run(*argv):
        code, out, err = sgld("generate", "--prompt", PROMPT, "--json", *argv)
        assert code == 0, err
        return json.loads(out.strip().splitlines()[-1]), err
    return run


@pytest.fixture(scope="module")
def demo_q4k(tmp_path_factory):
    """`sgld quantize demo demo-q4k.gguf --format q4_k`: 'demo' names the embedded model here too."""
    out = str(tmp_path_factory.mktemp("gguf") / "demo-q4k.gguf")
    assert main(["quantize", "demo", out, "--format", "q4_k"]) == 0  # was "demo: file not found"
    return out


def served_threads(*argv) -> int:
    """`sgld serve`'s model set up as cmd_serve does it (flags parsed, defaults checked, parts loaded): the
    process's CPU threads its batcher then runs on."""
    from engine.cli.serve import served_model

    args = build_parser().parse_args(["serve", *argv])
    args.loras = []
    torch.set_num_threads(TORCH_THREADS)
    served = served_model(args)
    served.engine.release()
    return torch.get_num_threads()


# -- 6: threads ------------------------------------------------------------------------------------------------------
def test_generate_runs_the_demo_on_one_thread_and_a_real_model_on_torchs(release, tmp_path, sgld, generate_json):
    demo, _ = generate_json("--out", str(tmp_path / "demo.png"), "--steps", "2")
    assert demo["threads"] == 1
    real, _ = generate_json("--model-path", release, *SMALL, "--out", str(tmp_path / "real.png"))
    assert real["threads"] == TORCH_THREADS  # was 1 for every model on a CPU
    forced, _ = generate_json("--out", str(tmp_path / "forced.png"), "--steps", "2", "--threads", "3")
    assert forced["threads"] == 3
    code, out, _ = sgld("generate", "--prompt", PROMPT, "--out", str(tmp_path / "t.png"), "--steps", "2")
    assert code == 0 and "on 1 CPU thread," in out and out.rstrip().endswith("shift 3"), out  # threads, shift said
    help_text = " ".join(sgld("generate", "--help")[1].split())
    assert "1 for the demo model" in help_text and "torch's choice, one per core, for any other model" in help_text


def test_serve_takes_the_demo_s_one_thread_and_torchs_for_a_real_model(release):
    assert served_threads() == 1
    assert served_threads("--model-path", release) == TORCH_THREADS  # was set to 1 before it loaded
    assert served_threads("--threads", "3") == 3


def test_a_batcher_on_the_demo_runs_its_jobs_on_one_thread():
    """The server's batcher takes the engine's rule itself (not only the count sgld serve set for the process)."""
    from engine import open_demo, open_engine
    from engine.serve.batcher import Batcher, Job

    demo = open_demo()
    seen = []
    batcher = Batcher(open_engine("demo"), max_batch=2)
    try:
        job = Job(latent=demo.empty_latent(1)[0], cond=demo.encode([PROMPT])[0], uncond=None, seed=0, steps=2, cfg=1.0,
                  on_step=lambda step, total: seen.append(torch.get_num_threads()))
        batcher.submit(job).result(timeout=60)
    finally:
        batcher.close()
    assert seen == [1, 1]  # the process's TORCH_THREADS before


def test_pipeline_runs_the_demo_on_one_thread_and_a_real_model_on_the_callers(release):
    demo = ErnieImagePipeline.from_pretrained("demo")
    demo.set_progress_bar_config(disable=True)
    assert demo(PROMPT, seed=1, num_inference_steps=2).stats["threads"] == 1  # ran on the caller's 2 before
    assert torch.get_num_threads() == 2  # the caller's count is back
    real = ErnieImagePipeline.from_pretrained(release)
    real.set_progress_bar_config(disable=True)
    assert real("a red cat", seed=1, height=64, width=64, num_inference_steps=2).stats["threads"] == 2
    demo.engine.threads = 3  # the override
    assert demo(PROMPT, seed=1, num_inference_steps=2).stats["threads"] == 3


# -- 7: the release's shift --------------------------------------------------------------------------------------------
def test_generate_and_the_pipeline_sample_a_release_with_its_schedulers_shift(release, tmp_path, generate_json):
    settings = ["--seed", "11", "--steps", "4", "--cfg", "1", "--width", "64", "--height", "64"]
    cli, _ = generate_json("--model-path", release, *settings, "--out", str(tmp_path / "cli.png"))
    assert cli["shift"] == 4.0  # was 3.0 (ComfyUI's), while the pipeline took the release's 4.0
    from engine.cli.generate import check_generate_args

    parts = ["--model", os.path.join(release, "transformer"), "--text-encoder", os.path.join(release, "text_encoder"),
             "--vae", os.path.join(release, "vae")]  # its transformer/ folder: the release around it says the shift
    assert check_generate_args(build_parser().parse_args(["generate", "--prompt", PROMPT, *parts]))["shift"] == 4.0
    pipe = ErnieImagePipeline.from_pretrained(release)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPT, seed=11, num_inference_steps=4, guidance_scale=1.0, height=64, width=64, scheduler="simple",
               output_type="np")
    assert out.stats["shift"] == 4.0
    cli_pixels = png_pixels(tmp_path / "cli.png")[0].astype(int)
    assert np.abs(cli_pixels - np.round(out.images[0] * 255).astype(int)).max() <= 1  # one schedule, one picture
    three, _ = generate_json("--model-path", release, *settings, "--shift", "3", "--out", str(tmp_path / "three.png"))
    assert three["shift"] == 3.0 and np.abs(png_pixels(tmp_path / "three.png")[0].astype(int) - cli_pixels).max() > 1
    served = served_image(PROMPT, seed=11, steps=4, cfg=1.0, size=64, argv=["--model-path", release])
    assert np.abs(served.astype(int) - cli_pixels).max() <= 1  # sgld serve too: it sampled with 3.0 before


def served_image(prompt, *, seed, steps, cfg, size, argv):
    """One image from `sgld serve`'s request path (served_model, its batcher, ImageServer.generate) in this process."""
    import asyncio
    import base64
    import io

    from PIL import Image

    from engine.cli.serve import served_model
    from engine.serve.app import ImageServer, ServeSettings
    from engine.serve.batcher import Batcher
    from engine.serve.protocol import parse_generation

    args = build_parser().parse_args(["serve", *argv])
    args.loras = []
    served = served_model(args)
    batcher = Batcher(served.engine, max_batch=2)
    try:
        server = ImageServer(served, batcher, ServeSettings())
        body = {"prompt": prompt, "size": f"{size}x{size}", "seed": seed, "num_inference_steps": steps,
                "guidance_scale": cfg, "response_format": "b64_json"}
        answer = asyncio.run(server.generate(parse_generation(body, served)))
    finally:
        batcher.close()
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))).convert("RGB"))


def test_a_dynamic_or_bad_shift_names_the_file_and_field(release, tmp_path, sgld):
    import shutil

    from engine import CheckpointError

    for field, value, fragment in (("use_dynamic_shifting", True, "field 'use_dynamic_shifting' is true"),
                                   ("shift", "hot", "field 'shift' is 'hot'")):
        copy = tmp_path / field
        shutil.copytree(release, copy)
        path = copy / "scheduler" / "scheduler_config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, field: value}))
        with pytest.raises(CheckpointError, match=fragment) as err:
            ErnieImagePipeline.from_pretrained(str(copy))
        assert str(path) in str(err.value)
        code, _, err = sgld("generate", "--prompt", PROMPT, "--model-path", str(copy), "--out", str(tmp_path / "x.png"))
        assert code == 2 and fragment in err and str(path) in err, err


# -- 8: the demo's GGUF, end to end --------------------------------------------------------------------------------------
def test_a_gguf_of_the_demo_generates_with_the_demos_own_text_encoder(demo_q4k, tmp_path, generate_json):
    from engine.cli.generate import check_generate_args

    args = build_parser().parse_args(["generate", "--prompt", PROMPT, "--model", demo_q4k])
    assert (check_generate_args(args)["steps"], args.out) == (30, "out.png")  # the demo's defaults, not Base's 50
    out, err = generate_json("--model", demo_q4k, "--steps", "3", "--out", str(tmp_path / "q4k.png"))  # needed TE, VAE
    assert out["model"] == "demo-q4k.gguf" and out["cfg"] == 3.0 and out["threads"] == 1
    assert png_pixels(tmp_path / "q4k.png")[0].shape == (64, 64, 3)
    assert "q4_k" in err  # the loader says what it read


def test_a_gguf_of_the_demo_serves_without_text_encoder_and_vae(demo_q4k):
    assert served_threads("--model", demo_q4k) == 1  # loads: its text encoder and codec are the demo's


def test_bench_names_a_gguf_files_format(demo_q4k, tmp_path, sgld):
    code, out, err = sgld("bench", "--model", demo_q4k, "--steps", "0", "--repeat", "1", "--json")
    assert code == 0, err
    quant = json.loads(out)["quant"]
    assert quant.startswith("gguf ") and "q4_k" in quant, quant  # was None
    q8 = str(tmp_path / "demo-q8.gguf")
    assert sgld("quantize", "demo", q8, "--format", "q8_0")[0] == 0
    code, out, err = sgld("bench", "--model", q8, "--steps", "0", "--repeat", "1", "--json")
    assert json.loads(out)["quant"] == "gguf q8_0"


# -- 9: the missing DiT first ----------------------------------------------------------------------------------------------
def test_missing_files_are_named_dit_first(sgld, tmp_path):
    out = ["--out", str(tmp_path / "x.png")]
    dit, te, vae = (str(tmp_path / name) for name in ("missing.safetensors", "te", "vae"))
    code, _, err = sgld("generate", "--prompt", PROMPT, "--model", dit, "--text-encoder", te, "--vae", vae, *out)
    assert code == 2 and err.startswith(f"sgld generate: error: '{dit}': no such file or folder"), err  # was the VAE
    demo_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "models", "demo",
                             "weights", "demo.safetensors")
    code, _, err = sgld("generate", "--prompt", PROMPT, "--model", demo_file, "--text-encoder", te, "--vae", vae, *out)
    assert code == 2 and err.startswith(f"sgld generate: error: text_encoder '{te}': no such file or folder"), err
    code, _, err = sgld("generate", "--prompt", PROMPT, "--model", str(tmp_path / "dit.safetensors"), *out)
    assert code == 2 and "dit.safetensors': no such file or folder" in err, err  # not "missing --text-encoder"


# -- 12: the demo's vocabulary ------------------------------------------------------------------------------------------
TOP_RIGHT = "a large red circle at the top right, on a blue background"


def test_generate_warns_about_positions_the_demo_does_not_know(sgld, tmp_path):
    code, _, err = sgld("generate", "--prompt", TOP_RIGHT, "--negative", "blurry", "--steps", "1",
                        "--out", str(tmp_path / "x.png"))
    assert code == 0
    assert "sgld: warning: the demo model does not know 'top right' in --prompt;" in err, err  # silent before
    assert "left right top bottom center (one position per shape; docs/demo.md)" in err
    assert "does not know 'blurry' in --negative" in err


def test_pipeline_warns_about_words_the_demo_does_not_know():
    pipe = ErnieImagePipeline.from_pretrained("demo")
    pipe.set_progress_bar_config(disable=True)
    with pytest.warns(UserWarning) as caught:
        out = pipe([TOP_RIGHT, "a purple circle on the left, on a blue background"], seed=0, num_inference_steps=1)
    messages = [str(w.message) for w in caught]
    assert any("does not know 'top right' in prompt" in m for m in messages), messages
    assert any("does not know 'purple' in prompt" in m for m in messages), messages
    assert any("'top right'" in w for w in out.stats["warnings"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # words it knows: no warning
        pipe(PROMPT, seed=0, num_inference_steps=1)
