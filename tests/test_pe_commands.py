"""The article's command spellings and the prompt enhancer through the real commands: `sgld generate` (its main, in
this process) and `sgld serve` as a real server process (test_serve's ``Server``) read with the ``openai`` SDK, on a
tiny random release folder (tests/tiny_release.py's diffusers-saved components plus tests/tiny_pe.py's pe/ and
pe_tokenizer/; built from configs, no downloads)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time

import openai
import pytest
import requests

from engine.models.prompt_enhancer import MAX_PROMPT_TOKENS, PromptEnhancer
from tests.test_cli_errors import ENV, SGLD, png_pixels
from tests.test_serve import Server, client
from tests.tiny_pe import write_tiny_pe

pytest.importorskip("diffusers")
ARTICLE_PROMPT = "A black-and-white Chinese rural dog running on grass"
# The tiny VAE has a stride of 4, so the commands' default 1024x1024 would be 65536 tokens per DiT call: the runs
# below add a small size (and few steps) after the article's own arguments, which are passed exactly as typed.
SMALL = ["--width", "64", "--height", "64"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from tests.tiny_release import write_release

    root = tmp_path_factory.mktemp("tiny") / "ERNIE-Image-Tiny"
    write_release(root)
    write_tiny_pe(str(root))
    return str(root)


@pytest.fixture(scope="module")
def bare_release(tmp_path_factory):
    """The same release without pe/ and pe_tokenizer/."""
    from tests.tiny_release import write_release

    root = tmp_path_factory.mktemp("bare") / "release"
    write_release(root)
    return str(root)


@pytest.fixture(scope="module")
def hub_cache(release, tmp_path_factory):
    """A Hugging Face cache (HF_HUB_CACHE) holding the tiny release as baidu/ERNIE-Image-Turbo's snapshot, so the
    article's own repo id resolves (engine/release.py reads the cache; nothing is downloaded)."""
    hub = tmp_path_factory.mktemp("hub")
    repo = hub / "models--baidu--ERNIE-Image-Turbo"
    (repo / "snapshots").mkdir(parents=True)
    (repo / "refs").mkdir()
    revision = "0" * 40
    (repo / "refs" / "main").write_text(revision)
    os.symlink(release, repo / "snapshots" / revision)
    return str(hub)


def expected_revision(release, prompt, width, height, seed):
    pe = PromptEnhancer.from_pretrained(os.path.join(release, "pe"))
    return pe.enhance([prompt], width, height, seed=seed)[0]


@pytest.mark.subprocess
def test_article_generate_command(release, tmp_path, sgld_in_process, monkeypatch):
    """SGLANG_CACHE_DIT_ENABLED=true SGLANG_CACHE_DIT_SCM_PRESET=fast sglang generate --model-path=... --prompt=...
    --save-output, with sgld for sglang: the transformer, text encoder and VAE come from the release folder."""
    monkeypatch.setenv("SGLANG_CACHE_DIT_ENABLED", "true")
    monkeypatch.setenv("SGLANG_CACHE_DIT_SCM_PRESET", "fast")
    monkeypatch.chdir(tmp_path)
    code, out, err = sgld_in_process("generate", f"--model-path={release}", f"--prompt={ARTICLE_PROMPT}",
                                     "--save-output", *SMALL, "--steps", "8")
    assert code == 0, err
    names = os.listdir(tmp_path / "outputs")  # SGLang's folder and naming: <prompt>_<time>_<settings hash>.png
    assert len(names) == 1 and re.fullmatch(
        r"A_black-and-white_Chinese_rural_dog_running_on_grass_\d{8}-\d{6}_[0-9a-f]{8}\.png", names[0]), names
    pixels, info = png_pixels(tmp_path / "outputs" / names[0])
    assert pixels.shape == (64, 64, 3)
    assert json.loads(info["prompt"])["prompt"] == ARTICLE_PROMPT
    computed, total = map(int, re.search(r"(\d+)/(\d+) steps computed", out).groups())
    assert total == 8 and computed < total, out  # the environment's Cache-DiT preset ran

    # the same picture as naming the three parts one by one (the same environment's cache on both sides)
    code, _, err = sgld_in_process("generate", "--model", os.path.join(release, "transformer"), "--text-encoder",
                                   os.path.join(release, "text_encoder"), "--vae", os.path.join(release, "vae"),
                                   f"--prompt={ARTICLE_PROMPT}", *SMALL, "--steps", "8", "--out",
                                   str(tmp_path / "b.png"))
    assert code == 0, err
    assert (pixels == png_pixels(tmp_path / "b.png")[0]).all()


def test_generate_with_pe_prints_and_stores_the_revised_prompt(release, tmp_path, sgld_in_process):
    out = tmp_path / "pe.png"
    code, stdout, err = sgld_in_process("generate", "--model-path", release, "--pe", "--prompt", "a red cat", *SMALL,
                                        "--steps", "2", "--seed", "3", "--out", str(out))
    assert code == 0, err
    revised = expected_revision(release, "a red cat", 64, 64, seed=3)
    assert f"): {revised}\n" in stdout
    _, info = png_pixels(out)
    assert info["revised_prompt"] == revised  # its own chunk, beside the settings that carry it too
    settings = json.loads(info["prompt"])
    assert settings["prompt"] == "a red cat" and settings["revised_prompt"] == revised

    code, stdout, err = sgld_in_process("generate", "--model-path", release, "--pe", os.path.join(release, "pe"),
                                        "--prompt", "a red cat", *SMALL, "--steps", "2", "--seed", "3", "--out",
                                        str(tmp_path / "again.png"), "--json")
    assert code == 0, err
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["revised_prompt"] == revised  # --pe PATH: the same PE, the same seed
    assert result["pe_seconds"] > 0 and result["pe_new_tokens"] >= 1


def test_pe_flags_refused_before_anything_loads(sgld_in_process, release, bare_release, tmp_path):
    out = ["--out", str(tmp_path / "x.png")]
    cases = [
        (["--pe"], "--pe without a PATH uses the --model-path release's pe/, but no --model-path"),
        (["--model-path", bare_release, "--pe", *SMALL], f"the release '{bare_release}' has no pe/ folder"),
        (["--pe-tokenizer", str(tmp_path)], "give --pe [PATH] too"),
        (["--pe", "--pe-max-new-tokens", "0"], "--pe-max-new-tokens must be from 1 to 8192 (got 0)"),
        (["--pe", os.path.join(bare_release, "transformer"), *SMALL, "--model-path", bare_release],
         "no prompt enhancer tokenizer"),
        (["--model-path", release, "--model", os.path.join(release, "transformer")], "--model-path and --model"),
        (["--model-path", str(tmp_path / "nowhere")], "no such file or folder"),
    ]
    for flags, message in cases:
        code, _, err = sgld_in_process("generate", "--prompt", "a cat", *out, *flags)
        assert code == 2 and message in err, (flags, err)
    code, _, err = sgld_in_process("serve", "--model-path", bare_release, "--pe", "--port", "0")
    assert code == 2 and "has no pe/ folder" in err, err
    assert not os.path.exists(tmp_path / "x.png")


def test_save_output_names_stay_in_the_output_folder():
    """--save-output's generated name (SGLang's scheme) cannot leave --output-path, whatever the prompt holds."""
    import argparse

    from engine.cli.generate import output_name
    run = {"seed": 0, "steps": 8}
    for prompt, start in (("../../etc/passwd x", "etc_passwd_x_"), ("一只狗 on grass", "on_grass_"), ("", ""),
                          ("a" * 300, "a" * 100 + "_")):
        args = argparse.Namespace(prompt=prompt, negative="", width=None, height=None, model_path="r", model=None,
                                  output_path="outputs")
        path = output_name(args, run)
        folder, name = os.path.split(path)
        assert folder == "outputs" and re.fullmatch(r"[A-Za-z0-9._-]+\.png", name) and name.startswith(start), path
        assert re.search(r"\d{8}-\d{6}_[0-9a-f]{8}\.png$", name)
    other = argparse.Namespace(**{**vars(args), "prompt": "a"})
    assert output_name(other, {**run, "seed": 1})[-12:] != output_name(other, run)[-12:]  # the settings' hash


def test_help_spells_sglangs_flags(sgld_in_process):
    for command in ("generate", "serve"):
        code, text, _ = sgld_in_process(command, "--help")
        assert code == 0 and "--model-path" in text and "--enable-mix-parallel" in text and "--pe [PATH]" in text
        assert "already mixes tensor and sequence" in " ".join(text.split())


class ArticleServer(Server):
    """`sgld serve --model-path <release> --tp 1 --sp 1 --port N --max-running-steps 64` as the article types it
    (its "production with Cache-DiT" environment), plus ``extra`` flags; test_serve's ``Server`` otherwise."""

    def __init__(self, log_path, release, *extra, env=None):
        from tests.test_serve import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = self.url + "/v1"
        self.log_path = str(log_path)
        env = {**ENV, "SGLANG_CACHE_DIT_ENABLED": "true", "SGLANG_CACHE_DIT_SCM_PRESET": "balanced", **(env or {})}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [SGLD, "serve", "--model-path", release, "--tp", "1", "--sp", "1", "--port", str(self.port),
                 "--max-running-steps", "64", *extra], env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.server
def test_article_serve_command_with_enhance_prompt(release, hub_cache, tmp_path):
    """The article's repo id, found in the (test's) local Hugging Face cache; plus --pe and --enable-mix-parallel."""
    server = ArticleServer(tmp_path / "serve.log", "baidu/ERNIE-Image-Turbo", "--pe", "--enable-mix-parallel",
                           "--request-timeout", "10", env={"HF_HUB_CACHE": hub_cache}).wait_ready()
    try:
        sdk = client(server)
        model = sdk.models.list().data[0].id
        assert model == "baidu/ERNIE-Image-Turbo"  # the repo id, as SGLang names it
        plain = sdk.images.generate(model=model, prompt="a red cat", size="64x64", n=1,
                                    extra_body={"seed": 5, "num_inference_steps": 2})
        assert plain.data[0].revised_prompt is None  # off unless asked: it costs seconds
        asked = sdk.images.generate(model=model, prompt="a red cat", size="64x64", n=2,
                                    extra_body={"seed": 5, "num_inference_steps": 2, "enhance_prompt": True})
        revised = expected_revision(release, "a red cat", 64, 64, seed=5)
        assert [d.revised_prompt for d in asked.data] == [revised, revised]
        assert asked.data[0].b64_json != plain.data[0].b64_json  # the picture was made from the revised prompt
        raw = server.post("/v1/images/generations", {"prompt": "a red cat", "size": "64x64", "seed": 5,
                                                     "num_inference_steps": 2, "enhance_prompt": True}).json()
        assert raw["pe_time_s"] > 0 and raw["data"][0]["revised_prompt"] == revised
        assert "pe_time_s" not in server.post("/v1/images/generations", {"prompt": "a cat", "size": "64x64",
                                                                         "num_inference_steps": 1}).json()

        # a 150,000-character prompt: a 400 naming the field and the PE's limit at once (it ran for minutes, past
        # --request-timeout, holding the PE), and the next request's enhancement is not held up
        t0 = time.perf_counter()
        huge = server.post("/v1/images/generations", {"prompt": "a red cat " * 15000, "size": "64x64",
                                                      "num_inference_steps": 1, "enhance_prompt": True})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt", huge.text
        assert f"over its limit of {MAX_PROMPT_TOKENS} tokens" in huge.json()["error"]["message"]
        assert time.perf_counter() - t0 < 5
        t0 = time.perf_counter()
        after = server.post("/v1/images/generations", {"prompt": "a red cat", "size": "64x64", "seed": 5,
                                                       "num_inference_steps": 2, "enhance_prompt": True})
        assert after.status_code == 200 and after.json()["data"][0]["revised_prompt"] == revised, after.text
        assert time.perf_counter() - t0 < 8
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.server
def test_enhance_prompt_without_pe_is_400(release, tmp_path):
    """`sgld serve --model-path <release folder> --tp 1 --sp 1 --port N --max-running-steps 64`, exactly as typed
    (no --pe): pictures as usual, enhance_prompt refused with the flag named."""
    server = ArticleServer(tmp_path / "folder.log", release).wait_ready()
    try:
        sdk = client(server)
        assert sdk.models.list().data[0].id == "ERNIE-Image-Tiny"  # the release folder's name
        r = sdk.images.generate(prompt="a red cat", size="64x64", extra_body={"num_inference_steps": 2})
        assert r.data[0].b64_json and r.data[0].revised_prompt is None
        with pytest.raises(openai.BadRequestError, match="this server has no prompt enhancer; start it with --pe"):
            sdk.images.generate(prompt="a red cat", size="64x64", extra_body={"enhance_prompt": True})
        body = requests.post(server.base + "/images/generations", json={"prompt": "x", "enhance_prompt": "yes"},
                             timeout=30)
        assert body.status_code == 400 and body.json()["error"]["param"] == "enhance_prompt"
    finally:
        assert server.stop() == 0, server.log()


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) a process has used, from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.server
def test_request_timeout_stops_the_prompt_enhancer(tmp_path):
    """`sgld serve --pe <a PE that never ends> --request-timeout 2`: the request is a 503 after 2 s, and the PE
    stops writing then (it wrote on for minutes, holding the PE lock, for nobody): the server goes idle."""
    pe = write_tiny_pe(str(tmp_path), generation={"do_sample": False}, endless=True)[0]
    server = Server(tmp_path / "serve.log", "--pe", pe, "--pe-max-new-tokens", "8192", "--request-timeout", "2")
    server.wait_ready()
    try:
        t0 = time.perf_counter()
        slow = server.post("/v1/images/generations", {"prompt": "a red cat", "num_inference_steps": 1,
                                                      "enhance_prompt": True})
        assert slow.status_code == 503 and slow.json()["error"]["code"] == "timeout", slow.text
        assert time.perf_counter() - t0 < 6
        time.sleep(0.5)
        used = cpu_seconds(server.proc.pid)
        time.sleep(2)
        used = cpu_seconds(server.proc.pid) - used
        assert used < 0.3, f"the server still works for the timed-out request: {used:.2f} CPU s in 2 s"
        assert server.healthy()
    finally:
        assert server.stop() == 0, server.log()
