"""The one resolution of an ERNIE-Image release: which files are its transformer, text encoder, tokenizer,
VAE, scheduler and prompt enhancer. ``ErnieImagePipeline.from_pretrained``, ``sgld generate --model-path`` and
``sgld serve --model-path`` all call ``resolve_release``, so a folder, a Hugging Face repo id and ComfyUI's
single files are found the same way everywhere.

A release is
- a local folder in diffusers' layout (``model_index.json``, ``transformer/``, ``text_encoder/``, ``tokenizer/``,
  ``vae/``, ``scheduler/``, optional ``pe/`` and ``pe_tokenizer/``);
- a Hugging Face repo id (``baidu/ERNIE-Image-Turbo``) already in the local Hugging Face cache
  (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``): nothing is downloaded, a repo
  id not found there is an error that says how to download it;
- a single DiT file (ComfyUI's repackaged ``ernie-image*.safetensors``) with the text encoder and VAE given
  beside it (``text_encoder=``, ``vae=``, ...);
- ``"demo"``: the embedded demo model (its one file holds DiT, text encoder and vocabulary).

Only safetensors: a weight folder holding pickles (.bin/.pt/.ckpt/.pth) and no safetensors is refused naming the
pickle. Nothing here reads a tensor; the loaders (engine/io, engine/models/external.py) do.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import re
from dataclasses import dataclass, fields, replace
from typing import Optional

from .errors import CheckpointError
from .io.checkpoint import check_architecture, open_checkpoint, read_json_file
from .io.safetensors import refuse_pickle, refuse_pickles_in
from .models import families, family_of
from .models.bundle import bundle_named, bundle_of_file
from .sampling import MAX_SHIFT

COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae", "scheduler", "pe", "pe_tokenizer")
WEIGHTS = ("transformer", "text_encoder", "vae", "pe")  # the components that hold weights (safetensors only)
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Release:
    """The paths of one release's parts (None: absent). ``transformer``, ``text_encoder`` and ``vae`` are folders or
    single files; the others are folders. ``source``: what the caller named (folder, repo id, file); ``kind``: "folder",
    "hub" (a repo id found in the cache), "files" (single files) or a bundled model's name ("demo": ``bundled``)."""

    source: str
    kind: str
    transformer: str
    text_encoder: Optional[str] = None
    tokenizer: Optional[str] = None
    vae: Optional[str] = None
    scheduler: Optional[str] = None
    pe: Optional[str] = None
    pe_tokenizer: Optional[str] = None
    model_index: Optional[str] = None

    def require(self, *names: str, why: str = "") -> None:
        """CheckpointError naming each missing component and where it was looked for."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            where = f" in '{self.source}'" if self.kind in ("folder", "hub") else ""
            hint = f" ({why})" if why else ""
            raise CheckpointError(f"ERNIE-Image release '{self.source}': missing {', '.join(f'{m}/' for m in missing)}"
                                  f"{where}{hint}; a release has {', '.join(c + '/' for c in COMPONENTS[:5])} "
                                  "(pe/ and pe_tokenizer/ optional)")

    def scheduler_config(self) -> dict:
        """The release's scheduler/scheduler_config.json ({} when it has none), read once: a dynamic shift is asked
        for at every picture's size (each `sgld serve` request)."""
        return self._scheduler_config

    @functools.cached_property
    def _scheduler_config(self) -> dict:
        if self.scheduler is None:
            return {}
        path = os.path.join(self.scheduler, "scheduler_config.json")
        return read_json_file(path) if os.path.isfile(path) else {}

    def shift(self, tokens: Optional[int] = None) -> Optional[float]:
        """The sigma shift the release's scheduler_config.json says (None: it says none, the sampling default
        applies). The one reading for ``sgld generate``, ``sgld serve`` and ``ErnieImagePipeline``. With
        ``use_dynamic_shifting`` (diffusers' resolution-dependent shift, which Z-Image's pipeline computes) the shift
        of a picture of ``tokens`` DiT tokens (``picture_shift``); CheckpointError naming the file and field when the
        caller's family runs a static shift only (``tokens`` None: ERNIE-Image's pipeline) or a value is out of range."""
        config = self.scheduler_config()
        where = os.path.join(self.scheduler or "", "scheduler_config.json")
        if config.get("use_dynamic_shifting"):
            if tokens is None:
                raise CheckpointError(f"{where}: field 'use_dynamic_shifting' is true; this family's pipeline runs a "
                                      "static shift only (set it to false)")
            return _dynamic_shift(config, tokens, where)
        return _number(config, "shift", None, where, 0.0, MAX_SHIFT)

    def dynamic_shift(self) -> bool:
        """Its shift depends on the picture's size (``shift`` needs the token count)."""
        return bool(self.scheduler_config().get("use_dynamic_shifting"))

    def components(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in COMPONENTS}


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps its downloads (its own rule: HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def cached_snapshot(repo_id: str) -> str:
    """The local snapshot folder of a Hugging Face repo id (refs/main's revision, else the newest snapshot);
    CheckpointError saying how to download it when it is not in the cache. Never downloads."""
    cache = hub_cache_dir()
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    ref = os.path.join(repo, "refs", "main")
    candidates = []
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            candidates.append(os.path.join(snapshots, f.read(100).strip()))
    if os.path.isdir(snapshots):
        candidates += sorted((os.path.join(snapshots, d) for d in os.listdir(snapshots)), key=os.path.getmtime,
                             reverse=True)
    found = next((c for c in candidates if os.path.isdir(c)), None)
    if found is None:
        raise CheckpointError(
            f"'{repo_id}' is not a local folder and is not in the local Hugging Face cache (looked for {repo}); "
            f"nothing is downloaded here: download it first with `huggingface-cli download {repo_id}` (or "
            f"`hf download {repo_id}`, or `--local-dir DIR` and pass DIR), then run again")
    return found


def _weights_folder(path: str, name: str) -> Optional[str]:
    """``path`` if it is a folder with safetensors weights; None if absent; CheckpointError for pickles only."""
    if not os.path.isdir(path):
        return None
    if glob.glob(os.path.join(path, "*.safetensors")):
        return path
    refuse_pickles_in(path)  # raises, naming the file
    raise CheckpointError(f"{path}: the release's {name}/ folder has no .safetensors weights")


def _folder(path: str) -> Optional[str]:
    return path if os.path.isdir(path) else None


def _from_folder(root: str, source: str, kind: str) -> Release:
    index = os.path.join(root, "model_index.json")
    if os.path.isfile(index):
        cls = read_json_file(index).get("_class_name")
        known = [f.companions.pipeline_class for f in families() if f.companions]
        if cls is not None and cls not in known:
            raise CheckpointError(f"{index}: field '_class_name' is '{cls}'; this is not a release of a model sgld "
                                  f"runs (expected {' or '.join(repr(k) for k in known)})")
    parts = {}
    for name in COMPONENTS:
        path = os.path.join(root, name)
        parts[name] = _weights_folder(path, name) if name in WEIGHTS else _folder(path)
    if parts["transformer"] is None:
        raise CheckpointError(f"ERNIE-Image release '{source}': no transformer/ folder in {root} (a release folder has "
                              f"model_index.json and {', '.join(c + '/' for c in COMPONENTS[:5])}); for a single DiT "
                              "file pass the file itself")
    if parts["tokenizer"] is None and parts["text_encoder"] and os.path.isfile(
            os.path.join(parts["text_encoder"], "tokenizer_config.json")):
        parts["tokenizer"] = parts["text_encoder"]  # tokenizer files inside text_encoder/ (external.py's rule)
    if parts["pe_tokenizer"] is None and parts["pe"] and os.path.isfile(os.path.join(parts["pe"], "tokenizer_config.json")):
        parts["pe_tokenizer"] = parts["pe"]
    return Release(source, kind, model_index=index if os.path.isfile(index) else None, **parts)


def _from_file(path: str, source: str) -> Release:
    refuse_pickle(path)  # by name and by content
    bundle = bundle_of_file(path)  # a copy of a bundled DiT in another format runs with the bundle's own parts
    return Release(source, bundle.name if bundle is not None else "files", path)


def bundled(release: Optional[Release]) -> bool:
    """Does ``release`` hold a bundled model (its text encoder and codec in its DiT's file: engine/models/bundle.py)?"""
    return release is not None and bundle_named(release.kind) is not None


def resolve_release(source, *, text_encoder=None, tokenizer=None, vae=None, scheduler=None, pe=None,
                    pe_tokenizer=None) -> Release:
    """The parts of the release ``source`` names (a release folder, a transformer/ folder, a repo id in the local
    Hugging Face cache, a single DiT file or "demo"). The keyword arguments give or replace single components
    (folders, or a ComfyUI install's single text encoder and VAE files next to its DiT file, which
    engine/models/external.py reads with their configs). Raises CheckpointError
    naming the file or folder for what cannot be used; loads nothing."""
    source = os.fspath(source)
    bundle = bundle_named(source)
    if bundle is not None and source in bundle.named:  # a bundled model's file name: "demo", "demo-turbo"
        release = Release(source, bundle.name, bundle.named[source])
    elif os.path.isfile(source):
        release = _from_file(source, source)
    elif os.path.isdir(source):
        if not os.path.isdir(os.path.join(source, "transformer")) and (
                glob.glob(os.path.join(source, "*.safetensors")) or os.path.isfile(os.path.join(source, "config.json"))):
            weights = _weights_folder(source, "transformer")  # a bare transformer/ folder: its siblings may be the rest
            parent = os.path.dirname(os.path.abspath(source))
            sibling = _from_folder(parent, source, "folder") if os.path.isdir(os.path.join(parent, "transformer")) and \
                os.path.samefile(os.path.join(parent, "transformer"), source) else None
            release = sibling or Release(source, "files", weights)
        else:
            release = _from_folder(source, source, "folder")
    elif REPO_ID.match(source) and not source.startswith((".", "/")):
        release = _from_folder(cached_snapshot(source), source, "hub")
    else:
        raise CheckpointError(f"'{source}': no such file or folder (expected an ERNIE-Image release folder, a DiT "
                              ".safetensors file, a Hugging Face repo id such as baidu/ERNIE-Image-Turbo, or 'demo')")
    given = {"text_encoder": text_encoder, "tokenizer": tokenizer, "vae": vae, "scheduler": scheduler, "pe": pe,
             "pe_tokenizer": pe_tokenizer}
    changes = {}
    for name, value in given.items():
        if value is None:
            continue
        value = os.fspath(value)
        if name in WEIGHTS:
            if os.path.isfile(value):
                refuse_pickle(value)  # a single file stays one: engine/models/external.py reads its layout
            checked = _weights_folder(value, name) if os.path.isdir(value) else None
            if checked is None and not os.path.isfile(value):
                raise CheckpointError(f"{name} '{value}': no such file or folder")
            changes[name] = checked or value
        else:
            if not os.path.isdir(value):
                raise CheckpointError(f"{name} '{value}': no such folder")
            changes[name] = value
    if "text_encoder" in changes and "tokenizer" not in changes and os.path.isdir(changes["text_encoder"]):
        inside = os.path.join(changes["text_encoder"], "tokenizer_config.json")
        sibling = os.path.join(os.path.dirname(os.path.abspath(changes["text_encoder"])), "tokenizer")
        changes["tokenizer"] = changes["text_encoder"] if os.path.isfile(inside) else (
            sibling if os.path.isdir(sibling) else release.tokenizer)
    if "pe" in changes and "pe_tokenizer" not in changes and os.path.isdir(changes["pe"]):
        sibling = os.path.join(os.path.dirname(os.path.abspath(changes["pe"])), "pe_tokenizer")
        if os.path.isfile(os.path.join(changes["pe"], "tokenizer_config.json")):
            changes["pe_tokenizer"] = changes["pe"]
        elif os.path.isdir(sibling):
            changes["pe_tokenizer"] = sibling
    return replace(release, **changes) if changes else release


DYNAMIC_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}


def _number(config: dict, field: str, default, where: str, low: float, high: float) -> Optional[float]:
    value = config.get(field, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise CheckpointError(f"{where}: field '{field}' is {value!r}; it must be a number above {low:g} and at most "
                              f"{high:g}")
    return float(value)


def _dynamic_shift(config: dict, tokens: int, where: str) -> float:
    """diffusers' ``calculate_shift`` (mu linear in the token count, from (base_image_seq_len, base_shift) to
    (max_image_seq_len, max_shift)) and ``time_shift`` at sigma 1: a static shift of exp(mu) ("exponential",
    the default time_shift_type), or of mu ("linear")."""
    seq = [_number(config, f, DYNAMIC_DEFAULTS[f], where, 0.0, 1e9) for f in ("base_image_seq_len", "max_image_seq_len")]
    ends = [_number(config, f, DYNAMIC_DEFAULTS[f], where, -10.0, 10.0) for f in ("base_shift", "max_shift")]
    if seq[0] == seq[1]:
        raise CheckpointError(f"{where}: fields 'base_image_seq_len' and 'max_image_seq_len' are both {seq[0]:g}; the "
                              "shift is a line between them")
    kind = config.get("time_shift_type", "exponential")
    if kind not in ("exponential", "linear"):
        raise CheckpointError(f"{where}: field 'time_shift_type' is {kind!r}; choose 'exponential' or 'linear'")
    mu = ends[0] + (tokens - seq[0]) * (ends[1] - ends[0]) / (seq[1] - seq[0])
    shift = math.exp(mu) if kind == "exponential" else mu
    if not 0 < shift <= MAX_SHIFT:
        raise CheckpointError(f"{where}: its dynamic shift at {tokens} tokens is {shift:g}; it must be above 0 and at "
                              f"most {MAX_SHIFT:g}")
    return shift


def picture_shift(release: Optional[Release], family, width: int, height: int) -> Optional[float]:
    """The shift of a ``width`` x ``height`` picture from ``release`` (None: no release, or it names none): its static
    one, or its dynamic one where the family's pipeline computes it (``Companions.dynamic_shift``)."""
    if release is None:
        return None
    companions = getattr(family, "companions", None)
    dynamic = companions is not None and companions.dynamic_shift
    return release.shift(family.latent.tokens(width, height) if dynamic else None)


def dit_family(dit: str, companions: bool = True):
    """The family of the DiT file or folder ``dit``, which must name the text encoder and VAE it runs with
    (``Family.companions``) unless ``companions`` is False: ValueError naming the file otherwise (such a DiT runs in
    ``sgld bench``, ``sgld serve --sample-only`` and the engine)."""
    family = family_of(check_architecture(open_checkpoint(dit)))
    if companions and family.companions is None:
        raise ValueError(f"{dit} is a {family.title} DiT, whose text encoder and VAE this version does not load: "
                         f"{family.title} runs in sgld bench with random text features and in the Python engine")
    return family
