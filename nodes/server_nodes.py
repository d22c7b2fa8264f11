"""Nodes that use a remote ``sgld serve`` (docs/serve.md): SGLDiffusion Server -> an SGLD_MODEL that
SGLDiffusion KSampler runs on that server (POST /v1/sample: the latent and text features go there, the
progress and the latent come back), and SGLDiffusion Server Generate (prompt -> IMAGE through
/v1/images/generations). Both send their LoRA chain with each request (the model's, from SGLDiffusion LoRA
Loader nodes; Generate's ``loras`` lines): LoRAs of the server's --lora-dir applied to that request only. Only HTTP and type adaptation here (the standard library's http.client); closing
the connection on an interrupt cancels the server's work."""
from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import http.client
import io
import json
import operator
import socket
import urllib.parse
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
from PIL import Image

from ..engine import sample_wire
from ..engine.errors import LoRAError
from ..engine.features.lora import parse_spec
from ..engine.options import node_inputs
from ..engine.sampling import cfg_on
from ..engine.sampling_options import SampleRequest, SamplingOptions

SERVER_NODE = "SGLDiffusion Server"
GENERATE_NODE = "SGLDiffusion Server Generate"
DEFAULT_URL = "http://127.0.0.1:30000"
API_PATH = "/v1"  # a base_url may end in it (the openai SDK's spelling) or not
SERVER_DEFAULT = 0  # a Server Generate widget left at 0: the value the server's GET /v1/models reports
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0  # between two lines of a run's stream (the server sends one at least every second)
GENERATE_TIMEOUT_S = 600.0
POLL_S = 0.25  # how often a waiting Server Generate looks for ComfyUI's interrupt


@dataclass(frozen=True)
class RemoteModel:
    """An SGLD_MODEL served by ``sgld serve`` at ``base_url`` (what GET /v1/models says of it). ``loras``: its LoRA
    chain (SGLDiffusion LoRA Loader nodes), ((name in the server's --lora-dir, strength), ...), sent with each run
    as the request's own LoRAs; empty: the server's active set."""
    base_url: str
    api_key: str
    model_id: str
    latent_channels: int
    text_dim: int
    loras: Tuple[Tuple[str, float], ...] = ()

    def with_lora(self, name: str, strength: float) -> "RemoteModel":
        """This model with one more LoRA in its chain."""
        return dataclasses.replace(self, loras=_chained(self.loras, name, strength))


def _chained(chain: tuple, name: str, strength: float) -> tuple:
    """``chain`` and one more LoRA (the same name twice: the strengths add, as merging both would)."""
    out = dict(chain)
    out[name] = out.get(name, 0.0) + float(strength)
    return tuple(out.items())


def _split_url(node: str, base_url: str):
    url = urllib.parse.urlsplit(base_url.strip())
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"{node}: base_url must look like http://HOST:PORT (got {base_url!r:.100})")
    return url


def _connect(node: str, base_url: str, timeout: float) -> tuple:
    """(connection, path prefix) for ``base_url``; nothing is sent yet."""
    url = _split_url(node, base_url)
    kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    try:
        conn = kind(url.hostname, url.port, timeout=timeout)
    except ValueError as e:  # a bad port
        raise ValueError(f"{node}: base_url {base_url!r:.100}: {e}") from None
    prefix = url.path.rstrip("/")
    return conn, prefix[:-len(API_PATH)] if prefix.endswith(API_PATH) else prefix  # .../v1 as openai's base_url


def _request(node: str, base_url: str, api_key: str, method: str, path: str, body: Optional[bytes] = None,
             content_type: str = "application/json", timeout: float = CONNECT_TIMEOUT_S, opened: Optional[list] = None):
    """Send one request; (connection, response) once the answer is 200. Anything else is a ValueError of one
    line naming the node, the server and its OpenAI error message. ``opened`` gets the connection at once."""
    conn, prefix = _connect(node, base_url, timeout)
    if opened is not None:
        opened.append(conn)
    headers = {"Content-Type": content_type}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request(method, prefix + path, body=body, headers=headers)
        response = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        raise ValueError(f"{node}: cannot reach the sgld server at {base_url} ({type(e).__name__}: {e}); "
                         "is `sgld serve` running there?") from None
    if response.status != 200:
        text = response.read(64 * 1024)
        conn.close()
        raise ValueError(f"{node}: the sgld server at {base_url} answered {response.status}: {_error_message(text)}")
    return conn, response


def _error_message(text: bytes) -> str:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text.decode("utf-8", "replace")
    return " ".join(str(message).split())[:1000]


def _read_json(node: str, base_url: str, conn, response) -> dict:
    try:
        return json.loads(response.read())
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise ValueError(f"{node}: the sgld server at {base_url} sent a broken answer ({e})") from None
    finally:
        conn.close()


class SGLDiffusionServer:
    DESCRIPTION = ("A model served by a remote `sgld serve` (docs/serve.md): connect it to SGLDiffusion KSampler, which "
                   "then samples on that server (the latent and text features are sent; progress and the latent come "
                   "back; ComfyUI's cancel stops the server's run).")
    CATEGORY = "SGLDiffusion/remote"
    RETURN_TYPES = ("SGLD_MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "connect"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "base_url": ("STRING", {"default": DEFAULT_URL, "tooltip": "The server's address (sgld serve --host/--port)."}),
            "api_key": ("STRING", {"default": "", "tooltip": "The server's --api-key (empty: none)."}),
        }}

    @classmethod
    def IS_CHANGED(cls, base_url, api_key):
        return float("nan")  # ask the server each run: it may have restarted with another model

    def connect(self, base_url, api_key):
        card = _model_card(SERVER_NODE, base_url, api_key)
        try:
            model = RemoteModel(base_url.strip().rstrip("/"), api_key, str(card["id"]), int(card["latent_channels"]),
                                int(card["text_dim"]))
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError(f"{SERVER_NODE}: {base_url} is not an sgld server with POST /v1/sample (its /v1/models "
                             "has no latent_channels / text_dim); update it") from None
        return (model,)


def _model_card(node: str, base_url: str, api_key: str) -> dict:
    """The served model's entry of GET /v1/models (its id, defaults and tensor sizes)."""
    conn, response = _request(node, base_url, api_key, "GET", "/v1/models")
    listing = _read_json(node, base_url, conn, response)
    try:
        card = listing["data"][0]
        if isinstance(card, dict):
            return card
    except (KeyError, IndexError, TypeError):
        pass
    raise ValueError(f"{node}: {base_url} is not an sgld server (its /v1/models lists no model)")


def _one(node: str, name: str, features: Optional[list]) -> Optional[torch.Tensor]:
    if features is None:
        return None
    if len(features) != 1:
        raise ValueError(f"{node}: a remote model takes one {name} conditioning entry (got {len(features)}); "
                         "combine them before the KSampler or sample locally")
    t = features[0]
    return (t[0] if t.dim() == 3 and t.shape[0] == 1 else t).detach().to("cpu", torch.float32).contiguous()


def _mask_tensor(node: str, mask) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{node}: the latent's noise_mask is a {type(mask).__name__}, not a MASK tensor")
    return mask.detach().to("cpu", torch.float32).contiguous()


def sample_remote(node: str, model: RemoteModel, request: SampleRequest) -> tuple:
    """A KSampler's ``request`` run on ``model``'s server, with what the local engine takes (the LATENT's batch,
    noise_mask and batch_index, the caller's own sigmas), over the wire of engine/sample_wire.py: (the denoised
    samples [B, C, h, w], the run's stats). The server checks every input, as the local engine does."""
    import comfy.model_management
    import comfy.utils

    samples = request.latent
    if not isinstance(samples, torch.Tensor) or samples.dim() != 4 or samples.shape[1] != model.latent_channels:
        shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"{node}: a remote model takes latents [batch, {model.latent_channels}, height, width] "
                         f"(got {shape})")
    options = request.options
    body = sample_wire.encode(dataclasses.replace(
        request, cond=_one(node, "positive", request.cond),
        uncond=_one(node, "negative", request.uncond) if cfg_on(options.cfg, request.uncond) else None,
        noise_mask=None if request.noise_mask is None else _mask_tensor(node, request.noise_mask),
        batch_index=None if request.batch_index is None else _plain_list(node, request.batch_index),
        loras=model.loras or None))  # the LoRA chain: this run's own LoRAs on the server
    steps = options.steps
    conn, response = _request(node, model.base_url, model.api_key, "POST", sample_wire.PATH, body,
                              "application/octet-stream", READ_TIMEOUT_S)
    pbar = comfy.utils.ProgressBar(int(steps))
    try:  # leaving this block closes the connection: the server cancels the job (ComfyUI's interrupt, an error)
        while True:
            comfy.model_management.throw_exception_if_processing_interrupted()
            try:
                line = response.readline()
            except (OSError, http.client.HTTPException) as e:
                raise ValueError(f"{node}: lost the sgld server at {model.base_url} during the run ({e})") from None
            if not line:
                raise ValueError(f"{node}: the sgld server at {model.base_url} closed the run before its end")
            if not line.strip():
                continue  # keepalive
            event = json.loads(line)
            if "step" in event:
                pbar.update_absolute(event["step"], event["total"])
            elif "error" in event:
                raise ValueError(f"{node}: the sgld server at {model.base_url}: {event['error']['message']}")
            else:
                out = sample_wire.decode_latent(event["latent"])
                computed = event.get("calls_computed") or 0
                return out, {"remote": model.base_url, "model": model.model_id, "steps": int(steps),
                             "model_calls": event.get("model_calls"), "calls_computed": computed,
                             "calls_cached": (event.get("model_calls") or 0) - computed,
                             "timeline": event.get("timeline", []), "warnings": list(event.get("warnings", []))}
    finally:
        conn.close()


def _plain_list(node: str, values) -> list:
    """A LATENT's batch_index as JSON integers (the server checks their count and range, naming the field)."""
    try:
        return [None if isinstance(v, bool) else operator.index(v) for v in values]
    except TypeError:
        raise ValueError(f"{node}: the latent's batch_index must be a list of integers (got {values!r:.80})") from None


class SGLDiffusionServerGenerate:
    DESCRIPTION = ("A picture from a remote `sgld serve` (its OpenAI Images API, /v1/images/generations): prompt in, "
                   "IMAGE out. ComfyUI's cancel closes the request, which cancels the server's work.")
    CATEGORY = "SGLDiffusion/remote"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "generate"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "base_url": ("STRING", {"default": DEFAULT_URL, "tooltip": "The server's address (sgld serve --host/--port); may end in /v1."}),
            "api_key": ("STRING", {"default": "", "tooltip": "The server's --api-key (empty: none)."}),
            "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "What the picture should show."}),
            "width": ("INT", {"default": SERVER_DEFAULT, "min": 0, "max": 8192,
                              "tooltip": "Pixels; 0: the server model's default size (the demo model: 64)."}),
            "height": ("INT", {"default": SERVER_DEFAULT, "min": 0, "max": 8192,
                               "tooltip": "Pixels; 0: the server model's default size."}),
            **server_sampling_widgets(),
        }, "optional": {"negative_prompt": ("STRING", {"multiline": True, "default": "",
                                                       "tooltip": "What the picture should not show (unused at cfg 1)."}),
                        "loras": ("STRING", {"multiline": True, "default": "",
                                             "tooltip": "This request's own LoRAs, one NAME:STRENGTH a line (NAME: a file "
                                                        "in the server's --lora-dir; STRENGTH default 1). Empty: the "
                                                        "server's active set."})}}

    def generate(self, base_url, api_key, prompt, width, height, seed, steps, cfg, negative_prompt="", loras=""):
        import comfy.model_management

        chain = lora_chain(GENERATE_NODE, loras)
        if SERVER_DEFAULT in (width, height, steps, cfg):
            width, height, steps, cfg = _with_server_defaults(base_url, api_key, width, height, steps, cfg)
        request = {"prompt": prompt, "negative_prompt": negative_prompt, "n": 1, "size": f"{width}x{height}",
                   "seed": int(seed), "num_inference_steps": int(steps), "guidance_scale": float(cfg)}
        if chain:
            request["loras"] = [{"name": name, "strength": strength} for name, strength in chain]
        body = json.dumps(request).encode()
        connection = []  # the waiting thread's, so an interrupt can close it

        def call():
            conn, response = _request(GENERATE_NODE, base_url, api_key, "POST", "/v1/images/generations", body,
                                      timeout=GENERATE_TIMEOUT_S, opened=connection)
            return _read_json(GENERATE_NODE, base_url, conn, response)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(call)
            try:
                while True:
                    comfy.model_management.throw_exception_if_processing_interrupted()
                    try:
                        result = answer.result(timeout=POLL_S)
                        break
                    except concurrent.futures.TimeoutError:
                        continue
            except comfy.model_management.InterruptProcessingException:
                _close_from_outside(answer, connection)
                raise
        try:
            png = base64.b64decode(result["data"][0]["b64_json"])
            image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32) / 255.0
        except (KeyError, IndexError, TypeError, ValueError, OSError) as e:
            raise ValueError(f"{GENERATE_NODE}: the sgld server at {base_url} sent no PNG picture ({e})") from None
        return (torch.from_numpy(image)[None],)


def lora_chain(node: str, text: str) -> Tuple[Tuple[str, float], ...]:
    """The ``loras`` widget's lines, NAME:STRENGTH (``FILE:STRENGTH`` as ``sgld generate --lora``), as a chain;
    the server checks names and strengths (a 400 naming the entry)."""
    chain: tuple = ()
    for line in (text or "").splitlines():
        if line.strip():
            try:
                chain = _chained(chain, *parse_spec(line.strip()))
            except LoRAError as e:
                raise ValueError(f"{node}: loras: {e}") from None
    return chain


def server_sampling_widgets() -> dict:
    """seed, steps, cfg as SamplingOptions declares them; steps and cfg also take SERVER_DEFAULT (0): the
    served model's default (its /v1/models card)."""
    declared = node_inputs(SamplingOptions)["required"]
    out = {"seed": declared["seed"]}
    for widget in ("steps", "cfg"):
        kind, spec = declared[widget]
        out[widget] = (kind, {**spec, "default": SERVER_DEFAULT, "min": SERVER_DEFAULT,
                              "tooltip": f"{SERVER_DEFAULT}: the server model's default. {spec.get('tooltip', '')}".strip()})
    return out


def _with_server_defaults(base_url: str, api_key: str, width: int, height: int, steps: int, cfg: float) -> tuple:
    """The widgets left at SERVER_DEFAULT replaced by what the server's GET /v1/models says of its model."""
    card = _model_card(GENERATE_NODE, base_url, api_key)
    try:
        size = [int(side) for side in str(card["default_size"]).lower().split("x")]
        default_w, default_h = size if len(size) == 2 else (size[0], size[0])
        default_steps, default_cfg = int(card["default_steps"]), float(card["default_guidance_scale"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError(f"{GENERATE_NODE}: the sgld server at {base_url} does not tell its defaults (default_size, "
                         "default_steps, default_guidance_scale in /v1/models); set width, height, steps and cfg") from None
    return (width or default_w, height or default_h, steps or default_steps, cfg or default_cfg)


def _close_from_outside(answer, connection) -> None:
    """Stop a request that another thread waits on: shut its socket (the server sees the client leave; the
    thread's read fails at once). A request still connecting ends at its timeout."""
    sock = connection[0].sock if connection else None
    if sock is not None and not answer.done():
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


NODE_CLASS_MAPPINGS = {"SGLDiffusionServer": SGLDiffusionServer, "SGLDiffusionServerGenerate": SGLDiffusionServerGenerate}
NODE_DISPLAY_NAME_MAPPINGS = {"SGLDiffusionServer": SERVER_NODE, "SGLDiffusionServerGenerate": GENERATE_NODE}
