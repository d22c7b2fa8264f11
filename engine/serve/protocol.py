"""The server's API: request bodies (OpenAI's Images API plus SGLang's extras), their checks, and errors in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` so the ``openai`` SDK reads them."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from ..errors import CheckpointError, InputError
from ..features.cache import CacheConfig
from ..inputs import check_sampling_settings, check_seed
from ..options import declared
from ..sample_wire import WireError, cache_setting, lora_setting
from ..sampling_options import SamplingOptions

MAX_IMAGES = 8  # n: OpenAI's dall-e-2 allows 1 to 10; SGLang clips; we refuse past 8


class ApiError(Exception):
    """An answer other than 200, with the OpenAI error body (param: the field at fault)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_field(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


class _Strict(BaseModel):
    # unknown fields are refused with their name (an option is honoured or refused, never dropped); no coercion
    # of "5" into 5 or 1.0 into True
    model_config = ConfigDict(extra="forbid", strict=True)


# The sampling options a request may set, by their request field (SamplingOptions' ``api`` spelling):
# {option: field}. None in a request: the served model's default (seed: a random one).
SAMPLING_FIELDS = {name: opt.api for name, opt in declared(SamplingOptions).items() if opt.api}


class _ImageRequestBase(_Strict):
    """POST /v1/images/generations. OpenAI's fields we honour, SGLang's extras; None: the model's default."""
    prompt: str
    model: Optional[str] = None
    negative_prompt: str = ""
    n: int = 1
    size: Optional[str] = None
    response_format: str = "b64_json"
    output_format: Literal["png"] = "png"
    user: Optional[str] = None  # OpenAI's end-user id: accepted, not used
    cache: Optional[str] = None
    enhance_prompt: bool = False  # the prompt enhancer first (sgld serve --pe); off unless asked: it costs seconds
    loras: Optional[list] = None  # [{"name", "strength"}]: engine/sample_wire.py's lora_setting (None: the server's)


ImageRequest = create_model(  # the base's fields and the declared sampling options' request fields
    "ImageRequest", __base__=_ImageRequestBase,
    **{field: (Optional[declared(SamplingOptions)[name].kind], None) for name, field in SAMPLING_FIELDS.items()})


class SetLoraRequest(_Strict):
    """POST /v1/set_lora (SGLang's body): one adapter, or lists of them; lora_path None: the nickname's file."""
    lora_nickname: Union[str, List[str]]
    lora_path: Union[str, None, List[Optional[str]]] = None
    strength: Union[float, List[float]] = 1.0
    target: Literal["all", "transformer"] = "all"


class UnsetLoraRequest(_Strict):
    """POST /v1/unset_lora: the nicknames to switch off (none given: all)."""
    lora_nickname: Union[str, List[str], None] = None


@dataclass(frozen=True)
class Generation:
    """A generation request with every default filled in and every value checked."""
    prompt: str
    negative_prompt: str
    n: int
    width: int
    height: int
    latent_shape: Tuple[int, ...]  # [1, C, h, w] of one image (the served model's parts: its size checked once)
    options: SamplingOptions  # the served model's defaults filled in; seed None: a random one per request
    cache: Optional[CacheConfig]  # None: the server's (its flags, else SGLANG_CACHE_DIT_*)
    enhance_prompt: bool = False
    loras: Optional[Tuple[Tuple[str, float], ...]] = None  # by name (None: the server's active set)


def parse(model_class, body):
    """``body`` (parsed JSON) as ``model_class``; the first problem as a 400 naming its field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model_class.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(model_class.model_fields)
            raise ApiError(400, f"'{field}' is not a field of this endpoint (its fields: {allowed})", param=field,
                           code="unknown_field") from None
        raise ApiError(400, f"{field}: {err['msg']} (got {err.get('input')!r:.80})", param=field,
                       code="invalid_value") from None


def parse_size(text: str) -> Tuple[int, int]:
    m = re.fullmatch(r"([0-9]{1,5})[xX]([0-9]{1,5})", text)  # ASCII only: no full-width digits, no newline
    if not m:
        raise bad_field("size", f"size must be 'WIDTHxHEIGHT' in pixels, e.g. '1024x1024' (got {text!r:.40})")
    return int(m.group(1)), int(m.group(2))


def parse_cache(name: Optional[str]) -> Optional[CacheConfig]:
    """A request's cache (engine/sample_wire.py's rule, the same for /v1/sample); a 400 naming the field."""
    try:
        return cache_setting(name)
    except WireError as e:
        raise bad_field("cache", str(e)) from None


def parse_loras(value) -> Optional[Tuple[Tuple[str, float], ...]]:
    """A request's loras (engine/sample_wire.py's rule, the same for /v1/sample); a 400 naming the entry."""
    try:
        return lora_setting(value)
    except WireError as e:
        raise bad_field(e.param or "loras", str(e)) from None


def parse_generation(body, served) -> Generation:
    """The request checked against the served model (``ServedModel``: its id, sizes and defaults)."""
    req = parse(ImageRequest, body)
    if not served.parts.pictures:
        raise ApiError(400, served.parts.WHY, param="prompt", code="sample_only")
    if req.model is not None and req.model != served.id:
        raise ApiError(404, f"The model '{req.model:.80}' does not exist; this server serves '{served.id}' "
                            "(GET /v1/models)", param="model", code="model_not_found")
    if req.response_format != "b64_json":
        raise bad_field("response_format", f"response_format '{req.response_format:.20}' is not supported: this server "
                                           "keeps no files to link to; use 'b64_json'")
    if not 1 <= req.n <= MAX_IMAGES:
        raise bad_field("n", f"n must be from 1 to {MAX_IMAGES} images (got {req.n})")
    if req.enhance_prompt and getattr(served, "enhance", None) is None:
        raise bad_field("enhance_prompt", "enhance_prompt: this server has no prompt enhancer; start it with --pe PATH "
                                          "(the PE folder), or --pe with a --model-path release that has pe/")
    width, height = parse_size(req.size) if req.size is not None else (served.default_size,) * 2
    try:
        latent_shape = served.parts.latent_shape(width, height)
    except InputError as e:
        raise bad_field("size", f"size {width}x{height}: {e}") from None
    given = {name: getattr(req, field) for name, field in SAMPLING_FIELDS.items()}
    steps = served.default_steps if given["steps"] is None else given["steps"]
    cfg = served.default_cfg if given["cfg"] is None else given["cfg"]
    names, seed = SAMPLING_FIELDS, given["seed"]
    for param, check in ((names["steps"], lambda: check_sampling_settings(steps=steps, cfg=0.0, names=names)),
                         (names["cfg"], lambda: check_sampling_settings(steps=1, cfg=cfg, names=names)),
                         (names["seed"], lambda: seed is None or check_seed(seed, names["seed"]))):
        try:
            check()
        except InputError as e:
            raise bad_field(param, str(e)) from None
    try:
        shift = served.shift_at(width, height) if getattr(served, "shift_at", None) else served.shift
    except CheckpointError as e:  # a release's dynamic shift out of range at this size
        raise bad_field("size", f"size {width}x{height}: {e}") from None
    options = SamplingOptions(**{"shift": shift, **{k: v for k, v in given.items() if v is not None},
                                 "seed": seed, "steps": steps, "cfg": float(cfg)})
    return Generation(req.prompt, req.negative_prompt, req.n, width, height, latent_shape, options,
                      parse_cache(req.cache), req.enhance_prompt, parse_loras(req.loras))


def as_list(value) -> list:
    return list(value) if isinstance(value, list) else [value]


def lora_file(lora_dir: Optional[str], path: str) -> str:
    """The real path of ``path`` (relative to ``lora_dir``, or absolute inside it), refused (400, param
    lora_path) when there is no --lora-dir, when it has '..', or when it (or a symlink on the way) leads out."""
    if not lora_dir:
        raise bad_field("lora_path", "this server loads no LoRA files: start it with --lora-dir FOLDER")
    if not path or "\0" in path:
        raise bad_field("lora_path", "lora_path is empty")
    if ".." in re.split(r"[\\/]", path):
        raise bad_field("lora_path", f"lora_path '{path:.200}' must not contain '..': give a file inside --lora-dir")
    root = os.path.realpath(lora_dir)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise bad_field("lora_path", f"lora_path '{path:.200}' leads outside --lora-dir (a symlink or an absolute "
                                     "path elsewhere): only files inside it are loaded")
    if not os.path.isfile(real):
        raise bad_field("lora_path", f"lora_path '{path:.200}': no such file in --lora-dir")
    return real
