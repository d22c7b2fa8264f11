"""A real ComfyUI server for tests and benchmarks, with this pack and tests/comfy_test_pack loaded.

ComfyUI 0.3.75 comes from ``scripts/comfyui.sh`` (cached in ``.cache/ComfyUI``). Each server gets
its own ``--base-directory`` (custom_nodes with symlinks to this repository and the test pack,
models/, input/, output/, temp/, user/), a free port on 127.0.0.1 and its own process group, so
nothing outside the temporary folder changes and teardown kills everything it started.
Every wait is bounded. Standard library + ``requests`` + ``websocket-client`` only.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Optional

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFY_DIR = os.environ.get("SGLD_COMFYUI_DIR", os.path.join(ROOT, ".cache", "ComfyUI"))
TEST_PACK = os.path.join(ROOT, "tests", "comfy_test_pack")
PACK_NAME = "ComfyUI-SGLDiffusion-under-test"  # any folder name must work
TEST_PACK_NAME = "sgld_comfy_test_pack"


def python() -> str:
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable


def server_threads() -> int:
    """The CPU threads torch takes in a process started as start_server starts one (no PYTHONPATH, this
    process's environment: OMP_NUM_THREADS under the test workers): what an in-process run compared bit for
    bit with a server's must use."""
    key = os.environ.get("OMP_NUM_THREADS", "")
    if key not in _SERVER_THREADS:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, check=True, env=env, timeout=120)
        _SERVER_THREADS[key] = int(out.stdout.strip())
    return _SERVER_THREADS[key]


_SERVER_THREADS: dict = {}


def ensure_comfyui(timeout: float = 1200) -> str:
    """Install ComfyUI 0.3.75 into COMFY_DIR unless it is there already; returns COMFY_DIR."""
    if not os.path.exists(os.path.join(COMFY_DIR, ".sgld-ready")):
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "comfyui.sh")], check=True, timeout=timeout)
    return COMFY_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_base_dir(base: str) -> str:
    """base/custom_nodes/{this pack, test pack} (symlinks) and the model folders."""
    cn = os.path.join(base, "custom_nodes")
    os.makedirs(cn, exist_ok=True)
    for name, target in ((PACK_NAME, ROOT), (TEST_PACK_NAME, TEST_PACK)):
        link = os.path.join(cn, name)
        if not os.path.lexists(link):
            os.symlink(target, link, target_is_directory=True)
    for sub in ("models/diffusion_models", "models/unet", "models/text_encoders", "models/vae", "input", "output", "temp", "user"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    return base


class ComfyServer:
    def __init__(self, base: str, port: int, proc: subprocess.Popen, log_path: str):
        self.base, self.port, self.proc, self.log_path = base, port, proc, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.client_id = uuid.uuid4().hex

    # -- process ---------------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    # -- HTTP ------------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 30, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout, **kw)

    def post(self, path: str, payload=None, timeout: float = 30) -> requests.Response:
        # json.dumps, not requests' json=: a test may send NaN, which a browser's graph can hold and
        # ComfyUI's parser accepts, but requests refuses to encode
        return requests.post(self.url + path, data=json.dumps(payload if payload is not None else {}), timeout=timeout,
                             headers={"Content-Type": "application/json"})

    def queue(self, prompt: dict) -> str:
        r = self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})
        if r.status_code != 200:
            raise AssertionError(f"POST /prompt -> {r.status_code}: {r.text[:2000]}")
        return r.json()["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 120) -> dict:
        """The /history entry of ``prompt_id`` once it is finished (success or error)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(f"ComfyUI exited (rc={self.proc.returncode}); log tail:\n{self.log()[-4000:]}")
            r = self.get(f"/history/{prompt_id}")
            if r.status_code == 200:
                entry = r.json().get(prompt_id)
                if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                    return entry
            time.sleep(0.05)
        raise AssertionError(f"prompt {prompt_id} did not finish within {timeout} s; log tail:\n{self.log()[-4000:]}")

    def run(self, prompt: dict, timeout: float = 120) -> dict:
        return self.wait(self.queue(prompt), timeout)

    def output_path(self, item: dict) -> str:
        return os.path.join(self.base, item.get("type", "output"), item.get("subfolder", ""), item["filename"])

    def reset(self, timeout: float = 60) -> None:
        """What one test module left in a server another module shares goes: the queue, a running prompt,
        ComfyUI's cached node outputs, the loaded models (the pack's engines with them) and the history.
        The files the module wrote in input/ and output/ stay (tests name their own)."""
        self.post("/queue", {"clear": True})
        if self.get("/queue").json().get("queue_running"):
            self.post("/interrupt")
        self.post("/free", {"unload_models": True, "free_memory": True})
        # the worker handles /free after the prompt it is running and before it takes the next one, so once a
        # prompt queued now has finished, the next one meets fresh caches
        marker = {"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 16, "height": 16, "batch_size": 1}},
                  "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "reset/marker"}}}
        self.run(marker, timeout)
        deadline = time.monotonic() + timeout
        while self.get("/sgldiffusion/models").json()["loaded"]:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.url} still holds models {timeout} s after POST /free")
            time.sleep(0.1)
        self.post("/history", {"clear": True})

    def websocket(self, timeout: float = 10):
        import websocket

        ws = websocket.WebSocket()
        ws.connect(f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}", timeout=timeout)
        return ws


def pids_gone(pids, timeout: float = 15.0) -> bool:
    """Every process of ``pids`` has exited and been reaped (a zombie still counts as there)."""
    import psutil

    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


TINY = "tiny-ernie.safetensors"


def shared_base(base: str) -> str:
    """The base folder of the server most test modules share (tests/conftest.py's default profile): the
    folders, the tiny checkpoint as TINY in diffusion_models, an empty models/loras, and user settings that
    spare the frontend's first-run dialogs (the browser tests)."""
    base_with_tiny_model(base, TINY)
    settings = os.path.join(base, "user", "default")
    os.makedirs(settings, exist_ok=True)
    with open(os.path.join(settings, "comfy.settings.json"), "w") as f:
        json.dump({"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False}, f)
    return base


def base_with_tiny_model(base: str, name: str = "tiny.safetensors") -> str:
    """``base`` laid out for a server (make_base_dir) with a tiny random checkpoint in diffusion_models and
    an empty models/loras; returns the checkpoint's path."""
    make_base_dir(base)
    os.makedirs(os.path.join(base, "models", "loras"), exist_ok=True)
    return write_tiny_checkpoint(os.path.join(base, "models", "diffusion_models", name))


def error_message(entry: dict) -> Optional[dict]:
    """The ``execution_error`` / ``execution_interrupted`` payload of a history entry, if any."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind in ("execution_error", "execution_interrupted"):
            return dict(data, kind=kind)
    return None


def _die_with_parent() -> None:
    """In the child (Linux): get SIGKILL if the test process dies without tearing down."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def start_server(base: str, extra_args=(), boot_timeout: float = 120, extra_env=None) -> ComfyServer:
    """A ComfyUI server on ``base`` (``extra_env``: variables the server process gets besides this one's)."""
    ensure_comfyui()
    make_base_dir(base)
    port = free_port()
    log_path = os.path.join(base, "comfyui.log")
    cmd = [python(), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--base-directory", base, "--disable-auto-launch", *extra_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", DO_NOT_TRACK="1", **(extra_env or {}))
    env.pop("PYTHONPATH", None)
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=COMFY_DIR, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    logf.close()
    server = ComfyServer(base, port, proc, log_path)
    deadline = time.monotonic() + boot_timeout
    try:
        while True:
            if not server.alive():
                raise RuntimeError(f"ComfyUI exited during start-up (rc={proc.returncode}):\n{server.log()[-4000:]}")
            try:
                if server.get("/system_stats", timeout=2).status_code == 200:
                    return server
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"ComfyUI did not answer within {boot_timeout} s:\n{server.log()[-4000:]}")
            time.sleep(0.2)
    except BaseException:
        server.stop()
        raise


# -- graphs ----------------------------------------------------------------------------------------

def tiny_graph(model: str, *, seed: int = 0, steps: int = 4, cfg: float = 1.0, sampler: str = "euler",
               scheduler: str = "simple", denoise: float = 1.0, width: int = 128, height: int = 128, batch: int = 1,
               pos=None, neg=None, weight_dtype: str = "default", latent_node: Optional[dict] = None,
               prefix: str = "sgld/tiny", loader_options: Optional[dict] = None) -> dict:
    """API-format graph: test text features + EmptyFlux2LatentImage -> our loader + KSampler -> SaveLatent.
    ``pos``/``neg`` = (seed, tokens, dim) of the test text features; dim defaults to the tiny model's."""
    pos = pos or (1, 7, text_dim())
    neg = neg or (2, 5, text_dim())
    return {
        "1": {"class_type": "SGLDiffusionModelLoader",
              "inputs": {"unet_name": model, "weight_dtype": weight_dtype, **(loader_options or {})}},
        "2": {"class_type": "SGLDTestTextFeatures", "inputs": {"seed": pos[0], "tokens": pos[1], "dim": pos[2]}},
        "3": {"class_type": "SGLDTestTextFeatures", "inputs": {"seed": neg[0], "tokens": neg[1], "dim": neg[2]}},
        "4": latent_node or {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": width, "height": height, "batch_size": batch}},
        "5": {"class_type": "SGLDiffusionKSampler", "inputs": {
            "model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler,
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": denoise}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": prefix}},
    }


def saved_latent(server: ComfyServer, entry: dict, node: str = "6"):
    from safetensors.torch import load_file

    item = entry["outputs"][node]["latents"][0]
    return load_file(server.output_path(item))["latent_tensor"]


def load_test_pack():
    """The test pack's module (text_features etc.), loaded from its file under a name of its own: it imports
    only torch, so tests use it outside ComfyUI to rebuild what its nodes make."""
    spec = importlib.util.spec_from_file_location("sgld_comfy_test_pack_in_tests", os.path.join(TEST_PACK, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config():
    """The engine's tiny test size, with ERNIE-Image's 128 latent channels (ComfyUI's Flux2 latent)."""
    import dataclasses

    from engine.models.random_weights import SIZES

    return dataclasses.replace(SIZES["tiny"], in_channels=128, out_channels=128)


def text_dim() -> int:
    return tiny_config().text_in_dim


def write_tiny_checkpoint(path: str, seed: int = 0) -> str:
    from engine.models.random_weights import save_random_checkpoint

    save_random_checkpoint(path, tiny_config(), seed=seed)
    return path


if __name__ == "__main__":  # manual use: start a server with a tiny model and wait
    import tempfile

    sys.path.insert(0, ROOT)
    base = tempfile.mkdtemp(prefix="sgld-comfy-")
    make_base_dir(base)
    write_tiny_checkpoint(os.path.join(base, "models", "diffusion_models", "tiny-ernie.safetensors"))
    srv = start_server(base, ["--preview-method", "auto"])
    print(json.dumps({"url": srv.url, "base": base, "pid": srv.proc.pid}))
    try:
        srv.proc.wait()
    except KeyboardInterrupt:
        srv.stop()
