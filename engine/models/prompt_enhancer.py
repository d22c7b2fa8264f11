"""ERNIE-Image's prompt enhancer (PE): a small causal LM that rewrites a short prompt into a detailed one. A family
names it as its companion (``Companions.prompt_enhancer``); the entry points load it from there.

It runs as diffusers' ``ErnieImagePipeline._enhance_prompt_with_pe`` does (shared/reference/ernie_image.md
§3.2): the user message is JSON ``{"prompt", "width", "height"}`` (ensure_ascii off), after an optional
system message, through the PE tokenizer's chat template with ``add_generation_prompt=False`` (the release's
template ends the user block with "Output:"); only the new tokens are decoded. What the release ships is read
from its files, not retyped here: the chat template (``chat_template.jinja`` / ``tokenizer_config.json``) and
the sampling settings (``generation_config.json``: do_sample, temperature, top_p, top_k). Only a folder with no
generation_config.json falls back to the values diffusers passes (``DIFFUSERS_SAMPLING``).

Weights: safetensors only (a folder as in the release's ``pe/``, or one file such as ComfyUI's
``ernie-image-prompt-enhancer.safetensors`` with its config.json beside it or in a given folder); a pickle
in the folder is refused by name before transformers sees it. Loaded with transformers on its own
device/dtype; ``release()`` frees the weights and the next ``enhance`` loads them again.
"""
from __future__ import annotations

import contextlib
import gc
import glob
import json
import logging
import math
import os
import tempfile
import threading
import time
from typing import List, Optional, Union

import torch

from .. import device as device_rt
from ..errors import Cancelled, CheckpointError, InputError
from ..io.readers import open_file
from ..io.safetensors import load_json_object, refuse_pickle, refuse_pickles_in
from ..io.shapes import check_counts, check_sizes, on_meta, read_header
from .external import RoomCheck, move_weights, text_encoder_dtype

log = logging.getLogger("sgld.parts")

DIFFUSERS_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95}  # what diffusers passes generate()
DEFAULT_MAX_NEW_TOKENS = 2048  # when the tokenizer states no real model_max_length (transformers' 1e30 sentinel)
MAX_NEW_TOKENS_CAP = 8192  # hard cap on any request: a revised prompt is a paragraph, not a book
# above the weights while it writes: the KV cache and a forward's work over the text (bench/memory/parts.py traces
# the 3B release shape at a 512-token prompt and 2048 new tokens: 1.2 GiB)
WRITE_WORK_BYTES = 3 << 29
# what the PE reads: the prompt in its chat template (system prompt included), in tokens. A longer one is refused,
# not cut: cutting would drop the template's closing "Output:". The text encoder reads at most 2048 tokens anyway,
# and the prefill (the part a cancellation cannot stop) stays seconds long.
MAX_PROMPT_TOKENS = 4096
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tekken.json", "tokenizer.model")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise InputError(f"the prompt enhancer needs the 'transformers' package (pip install transformers): {e}") from None
    return transformers


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"prompt enhancer dtype '{dtype}': use one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def _weights_and_config(path: str, config: Optional[str]):
    """(folder with config.json, the single weight file or None, the opened weight files) for a PE folder or one
    safetensors file."""
    if os.path.isdir(path):
        refuse_pickles_in(path)
        cfg = os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            raise CheckpointError(f"{cfg}: missing; the prompt enhancer folder '{path}' needs the config.json the "
                                  "release ships in pe/")
        shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not shards:
            raise CheckpointError(f"{path}: no .safetensors weights in the prompt enhancer folder (only "
                                  "safetensors are loaded)")
        # the headers are checked here, with the file named, before transformers reads them
        return path, None, [open_file(shard) for shard in shards]
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: prompt enhancer not found (give the release's pe/ folder or a "
                              ".safetensors file with its config.json)")
    refuse_pickle(path)
    opened = open_file(path)
    folder = config or os.path.dirname(os.path.abspath(path))
    if os.path.isfile(folder):
        folder = os.path.dirname(os.path.abspath(folder))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise CheckpointError(f"{os.path.join(folder, 'config.json')}: missing; a single prompt enhancer file "
                              f"('{os.path.basename(path)}') needs its model config beside it or in the folder given "
                              "as config=")
    return folder, path, [opened]


def _tokenizer_folder(path: str, weights_folder: str, tokenizer: Optional[str]) -> str:
    """The PE tokenizer: the folder given, else the release's sibling pe_tokenizer/, else the PE folder itself."""
    if tokenizer is not None:
        candidates = [tokenizer]
    else:
        base = path if os.path.isdir(path) else weights_folder
        candidates = [os.path.join(os.path.dirname(os.path.abspath(base)), "pe_tokenizer"), base]
    for folder in candidates:
        if os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
            return folder
    looked = " and ".join(f"'{c}'" for c in candidates)
    raise CheckpointError(f"{candidates[0]}: no prompt enhancer tokenizer (looked for {', '.join(TOKENIZER_FILES)} in "
                          f"{looked}); give the release's pe_tokenizer/ folder (tokenizer=... / --pe-tokenizer)")


def _read_json(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: not readable: {e}") from None
    return load_json_object(raw, path)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# each sampling field: (its check, what is allowed); what transformers' logits processors accept
SAMPLING_RULES = {
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "temperature": (lambda v: _is_number(v) and v > 0, "a number above 0"),
    "top_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    "top_k": (lambda v: type(v) is int and v >= 0, "a whole number from 0 (off) up"),
}


def _sampling(folder: str) -> dict:
    """The release's sampling settings (generation_config.json), else diffusers' values; each field's type and
    range checked here, at load, naming the file and field (not a ValueError on every request later)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return dict(DIFFUSERS_SAMPLING)
    cfg = _read_json(path)
    found = {k: cfg[k] for k in SAMPLING_KEYS if cfg.get(k) is not None}  # null: not set, as transformers reads it
    for key, value in found.items():
        valid, allowed = SAMPLING_RULES[key]
        if not valid(value):
            raise CheckpointError(f"{path}: field '{key}' must be {allowed} (got {json.dumps(value)[:40]})")
    for key in ("temperature", "top_p"):  # transformers wants floats: a JSON 2 is 2.0
        if key in found:
            found[key] = float(found[key])
    if "do_sample" not in found:  # a file with temperature/top_p but no do_sample means sampling, as diffusers does
        found["do_sample"] = any(k in found for k in ("temperature", "top_p", "top_k"))
    return found


class PromptEnhancer:
    """A short prompt -> the PE's revised prompt. ``seconds``: the last ``enhance`` call's time;
    ``load_seconds``: the last load's; ``new_tokens``: the last call's generated tokens per prompt."""

    def __init__(self, model, tokenizer, *, source: str, sampling: dict, device, dtype, loader=None):
        self.model, self.tokenizer, self.source, self.sampling = model, tokenizer, source, sampling
        self.device, self.dtype, self._loader = torch.device(device), dtype, loader
        if not getattr(tokenizer, "chat_template", None):
            raise CheckpointError(f"{getattr(tokenizer, 'name_or_path', source)}: the prompt enhancer tokenizer has no "
                                  "chat template (chat_template.jinja or tokenizer_config.json's chat_template)")
        self.seconds = 0.0
        self.load_seconds = 0.0
        self.new_tokens: List[int] = []  # tokens generated per prompt by the last ``enhance``
        self.room = RoomCheck("prompt enhancer", WRITE_WORK_BYTES, "writing", "--pe-device cpu")

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: Optional[str] = None, device=None, dtype=None,
                        config: Optional[str] = None) -> "PromptEnhancer":
        """``path``: the release's pe/ folder, or one .safetensors file (its config.json beside it or in the
        ``config`` folder); ``tokenizer``: its folder (default: the sibling pe_tokenizer/, else ``path``)."""
        path = os.fspath(path)
        device = torch.device(device or "cpu")
        dtype = _dtype(dtype) if dtype is not None else text_encoder_dtype(device)  # Ministral 3 3B: the text encoder's rule
        folder, single, files = _weights_and_config(path, config)
        tok_folder = _tokenizer_folder(path, folder, tokenizer)
        sampling = _sampling(folder)
        transformers = _transformers()
        _check_config(transformers, folder, files)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(tok_folder)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{tok_folder}: the prompt enhancer tokenizer could not be loaded: {e}") from None

        def load():  # into host memory: enhance() brings the weights to ``device`` for its prompts (see there)
            t0 = time.perf_counter()
            model = _load_model(transformers, folder, single, "cpu", dtype)
            return model, time.perf_counter() - t0

        model, seconds = load()
        pe = cls(model, tok, source=single or folder, sampling=sampling, device=device, dtype=dtype, loader=load)
        pe.load_seconds = seconds
        return pe

    def max_new_tokens(self, requested: Optional[int] = None) -> int:
        """The bound on new tokens: ``requested``, else the tokenizer's model_max_length (as diffusers), else
        ``DEFAULT_MAX_NEW_TOKENS``; never above ``MAX_NEW_TOKENS_CAP``."""
        if requested is not None:
            if not isinstance(requested, int) or isinstance(requested, bool) or not 1 <= requested <= MAX_NEW_TOKENS_CAP:
                raise InputError(f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS_CAP} (got {requested!r})")
            return requested
        stated = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(stated, int) and 0 < stated < 10 ** 7:
            return min(stated, MAX_NEW_TOKENS_CAP)
        return DEFAULT_MAX_NEW_TOKENS

    def messages(self, prompt: str, width: int, height: int, system_prompt: Optional[str] = None) -> list:
        user = json.dumps({"prompt": prompt, "width": width, "height": height}, ensure_ascii=False)
        return ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + \
            [{"role": "user", "content": user}]

    def prompt_ids(self, prompt: str, width: int, height: int, system_prompt: Optional[str] = None) -> torch.Tensor:
        """The prompt in the chat template as token ids [1, T]; InputError past ``MAX_PROMPT_TOKENS``."""
        tok = self.tokenizer
        text = tok.apply_chat_template(self.messages(prompt, width, height, system_prompt), tokenize=False,
                                       add_generation_prompt=False)
        ids = tok(text, return_tensors="pt")["input_ids"]
        if ids.shape[1] > MAX_PROMPT_TOKENS:
            raise InputError(f"prompt: {ids.shape[1]} tokens in the prompt enhancer's chat template (system prompt "
                             f"included), over its limit of {MAX_PROMPT_TOKENS} tokens; shorten the prompt")
        return ids

    @torch.no_grad()
    def enhance(self, prompts: Union[str, List[str]], width: int, height: int, seed: Optional[int] = None,
                max_new_tokens: Optional[int] = None, greedy: bool = False,
                system_prompt: Optional[str] = None, stop: Optional[threading.Event] = None) -> List[str]:
        """The revised prompts, one per prompt, each generated alone (no padding, as diffusers). With ``seed``,
        prompt i is sampled from seed + i on a forked RNG (the caller's RNG state is untouched), so a result
        does not depend on what ran before; ``greedy``: argmax decoding (what parity tests compare). Every
        prompt is checked against ``MAX_PROMPT_TOKENS`` before any runs. ``stop``: once set (the server's
        request timed out or its client left), generation ends at the next token and Cancelled is raised."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise InputError("prompts must be a string or a list of strings")
        for name, value in (("width", width), ("height", height)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InputError(f"{name} must be a positive whole number of pixels (got {value!r})")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise InputError(f"seed must be a non-negative whole number (got {seed!r})")
        limit = self.max_new_tokens(max_new_tokens)
        ids = [self.prompt_ids(p, width, height, system_prompt) for p in prompts]
        if self.model is None:
            if self._loader is None:
                raise InputError(f"{self.source}: the prompt enhancer was released and cannot be loaded again")
            self.model, self.load_seconds = self._loader()
        t0 = time.perf_counter()
        out, self.new_tokens = [], []
        # the weights live in host memory and are on a GPU only while they write: a server's PE (3B, 6.4 GiB in
        # bf16) is not held beside the DiT between requests; the copy costs about a second of the PE's many
        where = self._writes_on()
        away = where.type != "cpu"
        if away:
            move_weights(self.model, where)
        try:
            for i, prompt_ids in enumerate(ids):
                out.append(self._one(prompt_ids, None if seed is None else (seed + i) % 2 ** 64, limit, greedy, stop,
                                     where))
        finally:
            if away:
                move_weights(self.model, torch.device("cpu"))
                device_rt.empty_cache()
        self.seconds = time.perf_counter() - t0
        return out

    def _writes_on(self) -> torch.device:
        """The device, when it has room for the weights and their work now (beside a served batch sampling on it);
        else the host, said once: a full GPU makes the PE slower, never out of memory."""
        if self.device.type == "cpu":
            return self.device
        return self.room.where(self.model, self.device, torch.device("cpu"))

    def _one(self, prompt_ids, seed, limit, greedy, stop, where) -> str:
        tok = self.tokenizer
        if stop is not None and stop.is_set():  # stopped while it waited (for the server's PE lock)
            raise Cancelled("the prompt enhancer was stopped before it began")
        inputs = {"input_ids": prompt_ids.to(where), "attention_mask": torch.ones_like(prompt_ids, device=where)}
        sampling = {"do_sample": False} if greedy else dict(self.sampling)
        if not sampling.get("do_sample"):
            sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        generation = _transformers().GenerationConfig(
            max_new_tokens=limit, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **sampling)
        devices = [where] if where.type == "cuda" else []
        with torch.random.fork_rng(devices=devices) if seed is not None else contextlib.nullcontext():
            if seed is not None:
                torch.manual_seed(seed)
            ids = self.model.generate(**inputs, generation_config=generation,
                                      stopping_criteria=None if stop is None else _stopping(stop))
        if stop is not None and stop.is_set():
            raise Cancelled("the prompt enhancer was stopped while it wrote")
        new = ids[0][prompt_ids.shape[1]:]
        self.new_tokens.append(int(new.numel()))
        return tok.decode(new, skip_special_tokens=True).strip()

    def release(self) -> None:
        """Free the weights (and the GPU memory they held); the next ``enhance`` loads them again."""
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            device_rt.empty_cache()


def _stopping(stop: threading.Event):
    """transformers' stopping criteria that end generation at the next token once ``stop`` is set."""
    transformers = _transformers()

    class Stopped(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

    return transformers.StoppingCriteriaList([Stopped()])


def _check_config(transformers, folder: str, files) -> None:
    """config.json against the weights' headers before transformers allocates anything: the model built on the
    meta device (no memory) and compared with the files' headers (engine/io/shapes.py)."""
    path = os.path.join(folder, "config.json")
    raw = _read_json(path)
    have, origin = read_header(files)
    check_counts(raw, len(have), path)
    if "quantization_config" in raw:  # packed tensors: their shapes are transformers' quantizer's to check
        return
    try:
        model = on_meta(lambda: transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{path}: transformers cannot build a causal LM from it: {str(e)[:300]}") from None
    check_sizes(model, have, path, "prompt enhancer", raw, strict=False, origin=origin)


def _load_model(transformers, folder: str, single: Optional[str], device, dtype):
    """The causal LM, read by transformers from safetensors: the release folder, or (one file) a private
    temporary folder linking the file as model.safetensors beside its config."""
    try:
        if single is None:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
        else:
            with tempfile.TemporaryDirectory(prefix="sgld-pe-") as tmp:
                for name in ("config.json", "generation_config.json"):
                    if os.path.isfile(os.path.join(folder, name)):
                        os.symlink(os.path.abspath(os.path.join(folder, name)), os.path.join(tmp, name))
                os.symlink(os.path.abspath(single), os.path.join(tmp, "model.safetensors"))
                model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, use_safetensors=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{single or folder}: the prompt enhancer could not be loaded by transformers: {e}") from None
    return model.to(device).eval()
