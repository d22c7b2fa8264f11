"""`sgld serve` as a real server process on 127.0.0.1: the `openai` SDK makes demo pictures the judge passes,
concurrent requests each get their own image (equal to the same request alone and to `sgld generate`), every
refusal has its OpenAI status and body and leaves the server serving, LoRA files only from --lora-dir, and
SIGTERM in the middle of a batch exits 0. Two servers for the module (an open one and a strict one: an API key,
one image at a time, a short --request-timeout); the SIGTERM test starts its own."""
from __future__ import annotations

import base64
import io
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import psutil
import pytest
import requests
import torch
from lora_files import write_comfy_lora_shapes
from PIL import Image
from safetensors.torch import save

from engine.models.demo import EXAMPLE_PROMPT, load_demo
from tools.demo import judge

pytestmark = [pytest.mark.server]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
BODY_LIMIT = 64 * 1024
TIMEOUT_S = 8  # the strict server's --request-timeout
LONG = 10000  # steps (the most allowed): minutes of work, always cancelled
PROMPTS = ["a large red circle on the left, on a blue background",
           "a large green circle at the bottom, on a white background",
           "a small yellow square at the top, on a black background",
           "a large blue triangle on the right, on a white background"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limit(address_space: int):
    if not address_space:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))


class Server:
    """A `sgld serve` process on a free port; its output in a log file, shown when something fails."""

    def __init__(self, log_path, *flags, address_space: int = 0):
        """``address_space``: the process's RLIMIT_AS in bytes (0: none), so an attack run against old code fails
        an allocation instead of taking the shared machine's memory."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = self.url + "/v1"
        self.log_path = str(log_path)
        env = {**os.environ, "PYTHONPATH": ROOT}
        env.pop("SGLANG_CACHE_DIT_ENABLED", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(self.port),
                                          "--log-level", "warning", *flags], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=_limit(address_space))

    def log(self) -> str:
        return open(self.log_path).read()[-4000:]

    def wait_ready(self, timeout: float = 180) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"sgld serve exited with {self.proc.returncode}:\n{self.log()}"
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"sgld serve did not answer /health in {timeout} s:\n{self.log()}")

    def healthy(self) -> bool:
        return requests.get(self.url + "/health", timeout=10).json() == {"status": "ok"}

    def post(self, path: str, body=None, key=None, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.post(self.url + path, json=body, headers=headers, timeout=120, **kw)

    def metric(self, name: str, **labels) -> float:
        """The value of one sample of /metrics (0 when absent)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
            if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == want:
                return float(m.group(3))
        return 0.0

    def wait_metric(self, name: str, value: float, timeout: float = 60, **labels) -> None:
        deadline = time.time() + timeout
        while self.metric(name, **labels) != value:
            assert time.time() < deadline, f"{name}{labels} never became {value} (is {self.metric(name, **labels)})"
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def client(server: Server, **kw) -> openai.OpenAI:
    return openai.OpenAI(api_key=kw.pop("api_key", "unused"), base_url=server.base, max_retries=0, **kw)


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def demo_lora(path, scale: float = 0.5) -> str:
    """A LoRA in ComfyUI's key format on two of the demo DiT's linears (hidden 384, text features 128)."""
    return write_comfy_lora_shapes(path, {"layers.0.self_attention.to_q": (384, 384), "text_proj": (384, 128)}, seed=3,
                                   scale=scale)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve")
    loras = base / "loras"
    loras.mkdir()
    demo_lora(loras / "style.safetensors")
    outside = demo_lora(base / "outside.safetensors")
    os.symlink(outside, loras / "escape.safetensors")  # inside the folder, pointing out of it
    return base


@pytest.fixture(scope="module")
def servers(dirs):
    """Both module servers, started together (each loads the model: seconds on this machine)."""
    open_one = Server(dirs / "open.log", "--lora-dir", str(dirs / "loras"), "--max-body-bytes", str(BODY_LIMIT))
    strict = Server(dirs / "strict.log", "--api-key", KEY, "--max-running-steps", "1", "--max-queue", "0",
                    "--request-timeout", str(TIMEOUT_S))
    try:
        yield open_one.wait_ready(), strict.wait_ready()
    finally:
        for s in (open_one, strict):
            assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def strict(servers):
    return servers[1]


def generate(server, prompt, seed, steps=None, cfg=None, n=1, **kw):
    extra = {"seed": seed}
    if steps is not None:
        extra["num_inference_steps"] = steps
    if cfg is not None:
        extra["guidance_scale"] = cfg
    r = client(server, **kw).images.generate(model="sgld-demo", prompt=prompt, size="64x64", n=n,
                                             response_format="b64_json", extra_body=extra)
    return r, [pixels(d.b64_json) for d in r.data]


# -- the openai SDK, pictures, equality -----------------------------------------------------------------------------
def test_openai_sdk_makes_demo_pictures_the_judge_passes(server):
    r, images = generate(server, EXAMPLE_PROMPT, seed=3, n=2)  # seeds 3 and 4 (the demo passes 4 of its first 6)
    assert len(images) == 2 and images[0].shape == (64, 64, 3)
    assert r.model_extra["num_inference_steps"] == 30 and r.model_extra["guidance_scale"] == 3.0  # the demo's defaults
    assert r.model_extra["model_calls"] == 60 and r.model_extra["steps_computed"] == 60
    assert r.model_extra["inference_time_s"] > 0 and isinstance(r.created, int)
    assert [d.model_extra["seed"] for d in r.data] == [3, 4]
    for image in images:
        assert judge.passes(image, EXAMPLE_PROMPT), judge.judge(image, EXAMPLE_PROMPT)
    assert server.metric("sgld_images_total") >= 2


def test_the_counts_say_what_they_count(server):
    """Issue 33 item 11: with Cache-DiT on, each of n=2 images of 30 steps makes 30 model calls and computes fewer;
    the response says so per image and in total (``calls_computed``), and the old ``steps_computed`` (a total of
    computed model calls, not steps) stays as its deprecated alias."""
    r = client(server).images.generate(model="sgld-demo", prompt=PROMPTS[0], size="64x64", n=2,
                                       response_format="b64_json", extra_body={"seed": 1, "cache": "balanced"})
    extra, images = r.model_extra, [d.model_extra for d in r.data]
    assert extra["num_inference_steps"] == 30
    assert [i["model_calls"] for i in images] == [30, 30]  # euler: one model call a step, per image
    assert all(0 < i["calls_computed"] < 30 for i in images), images  # the rest reused by Cache-DiT
    assert extra["model_calls"] == 60 and extra["calls_computed"] == sum(i["calls_computed"] for i in images)
    assert extra["steps_computed"] == extra["calls_computed"]


def test_image_equals_sgld_generate(server, tmp_path):
    """The server's picture is the one `sgld generate` makes for the same prompt and seed (the same pixels);
    image i of a request of n is the request's seed + i."""
    out = tmp_path / "ref.png"
    subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--prompt", PROMPTS[1], "--seed", "7",
                    "--steps", "12", "--out", str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                   check=True, capture_output=True)
    _, images = generate(server, PROMPTS[1], seed=6, steps=12, n=2)
    assert np.array_equal(images[1], np.asarray(Image.open(out).convert("RGB")))
    assert not np.array_equal(images[0], images[1])


def test_concurrent_requests_each_get_their_own_image(server):
    """16 requests of different prompts, seeds, steps and cfg from 8 clients at once: each answer equals the
    same request sent alone afterwards (no mix-ups between requests running together)."""
    cases = [(PROMPTS[i % 4], 100 + i, 6 + i % 5, (1.0, 3.0, 4.5)[i % 3]) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda c: generate(server, *c)[1][0], cases))
    for case, image in zip(cases, together):
        assert np.array_equal(image, generate(server, *case)[1][0]), case
    assert server.healthy()


# -- refusals: status, OpenAI body, and the server goes on ---------------------------------------------------------
BAD = [('{"prompt": "x", "n": 9}', "n"), ('{"prompt": "x", "n": 0}', "n"), ('{"prompt": "x", "n": "2"}', "n"),
       ('{"prompt": "x", "size": "64"}', "size"), ('{"prompt": "x", "size": "128x128"}', "size"),
       ('{"prompt": "x", "num_inference_steps": 0}', "num_inference_steps"),
       ('{"prompt": "x", "guidance_scale": 1e999}', "guidance_scale"),
       ('{"prompt": "x", "guidance_scale": 1000}', "guidance_scale"), ('{"prompt": "x", "seed": -1}', "seed"),
       ('{"prompt": "x", "seed": 18446744073709551616}', "seed"), ('{"prompt": "x", "cache": "warp"}', "cache"),
       ('{"prompt": "x", "quality": "hd"}', "quality"), ('{"prompt": "x", "response_format": "url"}', "response_format"),
       ('{"n": 1}', "prompt"), ('{"prompt": 3}', "prompt")]


@pytest.mark.parametrize("body,param", BAD, ids=[b for b, _ in BAD])
def test_bad_fields_are_400_naming_the_field(server, body, param):
    r = requests.post(server.base + "/images/generations", data=body, headers={"content-type": "application/json"},
                      timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert server.healthy()


def test_url_format_refused_through_the_sdk(server):
    with pytest.raises(openai.BadRequestError, match="b64_json") as e:
        client(server).images.generate(prompt="x", response_format="url")
    assert e.value.param == "response_format"


def test_other_refusals(server):
    assert server.post("/v1/images/generations", data=b"{not json").status_code == 400
    r = requests.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = server.post("/v1/images/generations", {"prompt": "x", "model": "dall-e-3"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    models = requests.get(server.base + "/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["sgld-demo"] and models["data"][0]["default_steps"] == 30
    assert server.healthy()


def test_oversized_bodies_are_413(server):
    big = json.dumps({"prompt": "x" * (2 * BODY_LIMIT)}).encode()
    r = requests.post(server.base + "/images/generations", data=big, headers={"content-type": "application/json"},
                      timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds on the bytes received
        yield b'{"prompt": "'
        for _ in range(2 * BODY_LIMIT // 4096):
            yield b"x" * 4096
        yield b'"}'
    r = requests.post(server.base + "/images/generations", data=chunks(), headers={"content-type": "application/json"},
                      timeout=60)
    assert r.status_code == 413
    assert server.healthy()


def test_health_generate_and_metrics(server):
    r = requests.get(server.url + "/health_generate", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    for name in ("sgld_queue_depth", "sgld_running_batch_size", "sgld_denoising_steps_total", "sgld_model_calls_total",
                 "sgld_model_calls_computed_total", "sgld_request_latency_seconds_bucket"):
        assert name in requests.get(server.url + "/metrics", timeout=10).text
    assert server.metric("sgld_requests_total", endpoint="/health_generate", status="200") >= 1
    assert server.metric("sgld_model_calls_total") >= server.metric("sgld_model_calls_computed_total") > 0


# -- LoRA --------------------------------------------------------------------------------------------------------
def test_lora_endpoints(server, dirs):
    plain = generate(server, PROMPTS[0], seed=1, steps=6)[1][0]
    r = server.post("/v1/set_lora", {"lora_nickname": "style", "lora_path": "style.safetensors", "strength": 1.0})
    assert r.status_code == 200, r.text
    listing = requests.get(server.base + "/list_loras", timeout=10).json()
    assert listing["active"]["transformer"] == [{"nickname": "style", "path": "style.safetensors", "merged": True,
                                                 "strength": 1.0}]
    with_lora = generate(server, PROMPTS[0], seed=1, steps=6)[1][0]
    assert not np.array_equal(plain, with_lora)
    assert server.post("/v1/unset_lora").status_code == 200
    assert requests.get(server.base + "/list_loras", timeout=10).json()["active"]["transformer"] == []
    assert np.array_equal(generate(server, PROMPTS[0], seed=1, steps=6)[1][0], plain)  # the weights restored
    assert server.post("/v1/set_lora", {"lora_nickname": "style", "strength": 0.5}).status_code == 200  # by nickname
    assert server.post("/v1/unset_lora", {"lora_nickname": "style"}).status_code == 200


@pytest.mark.parametrize("path,why", [("../outside.safetensors", ".."), ("sub/../../outside.safetensors", ".."),
                                      ("{base}/outside.safetensors", "outside"), ("escape.safetensors", "outside"),
                                      ("missing.safetensors", "no such file")])
def test_lora_paths_outside_the_folder_are_refused(server, dirs, path, why):
    before = requests.get(server.base + "/list_loras", timeout=10).json()
    r = server.post("/v1/set_lora", {"lora_nickname": "x", "lora_path": path.format(base=dirs)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path" and why in r.json()["error"]["message"]
    assert requests.get(server.base + "/list_loras", timeout=10).json() == before
    assert server.healthy()


def test_lora_refusals(server):
    r = server.post("/v1/set_lora", {"lora_nickname": "never-loaded"})
    assert r.status_code == 400 and "not loaded" in r.json()["error"]["message"]
    r = server.post("/v1/set_lora", {"lora_nickname": ["a", "b"], "lora_path": ["style.safetensors"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = server.post("/v1/unset_lora", {"lora_nickname": "nobody"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_nickname"
    assert server.healthy()


# -- the strict server: key, full queue, timeout, disconnect ---------------------------------------------------------
def test_api_key(strict):
    for key in (None, "wrong"):
        r = strict.post("/v1/images/generations", {"prompt": "x"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        client(strict, api_key="wrong").models.list()
    assert client(strict, api_key=KEY).models.list().data[0].id == "sgld-demo"
    assert strict.healthy()  # /health and /metrics need no key (load balancers, scrapers)
    assert strict.metric("sgld_requests_total", endpoint="/v1/images/generations", status="401") == 2


def test_full_queue_then_timeout_frees_the_place(strict):
    """One image at a time: a second request is 429 while the first runs; the first passes --request-timeout,
    gets 503 and its place is freed, so the next request is served."""
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(generate, strict, "x", 1, LONG, api_key=KEY)
        strict.wait_metric("sgld_images_in_flight", 1)
        with pytest.raises(openai.RateLimitError) as e:
            generate(strict, "x", 2, 4, api_key=KEY)
        assert e.value.code == "queue_full" and e.value.response.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError) as e:
            first.result()
    assert e.value.status_code == 503 and e.value.code == "timeout"
    assert strict.metric("sgld_images_in_flight") == 0
    assert len(generate(strict, PROMPTS[0], 3, 4, api_key=KEY)[1]) == 1


def test_a_client_that_leaves_has_its_work_cancelled(strict):
    with pytest.raises(openai.APITimeoutError):
        generate(strict, "x", 4, LONG, api_key=KEY, timeout=1.5)
    # cancelled on the disconnect (status 499 in the metrics), well before --request-timeout would (503)
    strict.wait_metric("sgld_requests_total", 1, timeout=TIMEOUT_S - 2, endpoint="/v1/images/generations",
                       status="499")
    assert strict.metric("sgld_images_in_flight") == 0
    assert len(generate(strict, PROMPTS[0], 5, 4, api_key=KEY)[1]) == 1


# -- SIGTERM -----------------------------------------------------------------------------------------------------
def test_sigterm_mid_batch_exits_cleanly(tmp_path):
    s = Server(tmp_path / "term.log", "--shutdown-grace", "1").wait_ready()
    children = psutil.Process(s.proc.pid).children(recursive=True)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, s, "x", 1, LONG)
        s.wait_metric("sgld_running_batch_size", 1)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.log()
        with pytest.raises(openai.APIStatusError) as e:
            running.result()
    assert e.value.status_code == 503 and e.value.code == "shutting_down"
    assert not [c for c in children if c.is_running()]
    with pytest.raises(requests.ConnectionError):
        requests.get(s.url + "/health", timeout=5)


def test_a_port_in_use_is_a_one_line_error(server):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--port", str(server.port)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"sgld serve: error: --host 127.0.0.1 --port {server.port}: "
                                                        "cannot listen there")
    assert server.healthy()


def test_sample_and_generations_share_one_admission(strict):
    """The server object's one bound (issue 26 item 5): while a POST /v1/sample run holds the strict server's only
    place, a generation is 429; closing the stream cancels the run and frees the place for the next request."""
    cond = load_demo().encode([PROMPTS[0]])[0]
    data = save({"latent": torch.zeros(48, 16, 16), "cond": cond},
                metadata={"sgld": json.dumps({"seed": 1, "steps": LONG, "cfg": 1.0})})
    stream = requests.post(strict.base + "/sample", data=data, headers={"Authorization": f"Bearer {KEY}"}, stream=True,
                           timeout=30)
    try:
        assert stream.status_code == 200
        strict.wait_metric("sgld_images_in_flight", 1)
        with pytest.raises(openai.RateLimitError) as e:
            generate(strict, "x", 2, 4, api_key=KEY)
        assert e.value.code == "queue_full"
        # the cheap check first (issue 44 item 6): a full server's 429 comes before any LoRA is named or read
        more = save({"latent": torch.zeros(48, 16, 16), "cond": cond}, metadata={"sgld": json.dumps(
            {"seed": 1, "steps": 2, "cfg": 1.0, "loras": [{"name": "style.safetensors"}]})})
        r = requests.post(strict.base + "/sample", data=more, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    finally:
        stream.close()
    strict.wait_metric("sgld_images_in_flight", 0, timeout=30)
    strict.wait_metric("sgld_running_batch_size", 0, timeout=30)
    assert len(generate(strict, PROMPTS[0], 3, 4, api_key=KEY)[1]) == 1
