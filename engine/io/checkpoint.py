"""The checkpoint opener, ``open_checkpoint``: one weight file or a diffusers folder (shards, config.json),
each file opened by its reader (engine/io/readers.py), its tensors without their prefix, and the
architecture read from the header alone (the DiT family whose signature keys it holds, engine/models/family.py) (engine/io/load.py reads the tensors). Every problem with the
input is a ``CheckpointError`` whose message names the file and what is wrong.
"""
from __future__ import annotations

import glob
import os
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from ..models.family import Family, detect, detect_layout, families
from .layouts import LayoutView
from .readers import open_file, shard_suffixes
from .safetensors import COMPUTE_DTYPES, DTYPE_NAMES, CheckpointError, load_json_object, refuse_pickle

# "bf16" and "bfloat16" alike
DTYPE_CHOICES = {**COMPUTE_DTYPES, **{str(d).replace("torch.", ""): d for d in COMPUTE_DTYPES.values()}}


def parse_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """None / "default" / "auto" / "as stored" mean: keep the checkpoint's dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key in ("default", "auto", "as stored", "stored", "none"):
        return None
    if key not in DTYPE_CHOICES:
        raise ValueError(f"dtype '{dtype}' is not supported; choose one of bf16, fp16, fp32 or default (as stored)")
    return DTYPE_CHOICES[key]


MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json / index files (the 8B index is about 40 KB)


def read_json_file(path: str) -> dict:
    """A JSON object from a small side file (config.json, an index), or a CheckpointError naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_JSON_BYTES // 2 ** 20} MB, too large for a JSON side file")
    return load_json_object(raw, path)


def is_plain_shard_name(name) -> bool:
    """A file name in the index's own folder: no folders, no '..', no NUL, ending in .safetensors."""
    return (isinstance(name, str) and name.endswith(".safetensors") and name == os.path.basename(name)
            and "/" not in name and "\\" not in name and "\0" not in name and name not in (".", ".."))


def shards_of_index(index_path: str) -> List[str]:
    """The shard file names of a diffusers ``*.safetensors.index.json``, validated."""
    weight_map = read_json_file(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: field 'weight_map' must be a non-empty object of tensor name -> shard file name")
    for tensor, shard in weight_map.items():
        if not is_plain_shard_name(shard):
            raise CheckpointError(f"{index_path}: field 'weight_map': shard {shard!r} of tensor '{tensor}' must be a "
                                  "file name in the index's folder ending in .safetensors (no path separators or '..')")
    return sorted(set(weight_map.values()))


class Checkpoint:
    """The tensors of one model, possibly spread over shards, with their prefix removed (open one with
    ``open_checkpoint``). ``files``: the opened files (readers.py), in shard order; ``family``: the DiT family
    the keys belong to (None: none; ``check_architecture`` says what is missing)."""

    def __init__(self, path: str):
        self.path = path
        self.files: List[object] = []
        self.config_overrides: dict = {}
        self.config_source = ""  # where config_overrides came from, for messages
        if os.path.isdir(path):
            self._open_folder(path)
        else:
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: file not found")
            self.files = [open_file(path)]
        self.layout = None  # the other tool's names the file is written in (Family.layouts), read in ours
        found = detect_layout([k for f in self.files for k in f.keys()])
        if found is not None and detect([k for f in self.files for k in f.keys()]) is None:
            _, their_prefix, self.layout = found
            self.files = [LayoutView(f, self.layout, their_prefix) for f in self.files]
        all_keys = [(f, k) for f in self.files for k in f.keys()]
        self.family, prefix = self._detect([k for _, k in all_keys])
        meta_key = self.family.config_metadata_key if self.family is not None and not os.path.isdir(path) else ""
        meta = self.files[0].metadata.get(meta_key) if meta_key else None  # optional JSON config in the metadata
        if meta:
            self.config_source = f"metadata '{meta_key}'"
            self.config_overrides = load_json_object(meta, f"{path}: {self.config_source}")
        # key (without prefix) -> (file, key in file)
        self.index: Dict[str, Tuple[object, str]] = {}
        for f, k in all_keys:
            if k.startswith(prefix):
                name = k[len(prefix):]
                if name in self.index:
                    raise CheckpointError(f"{self.describe()}: tensor '{k}' is in two shards, "
                                          f"{os.path.basename(self.index[name][0].path)} and {os.path.basename(f.path)}")
                self.index[name] = (f, k)
        self.prefix = prefix

    def _open_folder(self, path: str) -> None:
        folder = os.path.join(path, "transformer") if os.path.isdir(os.path.join(path, "transformer")) else path
        cfg_path = os.path.join(folder, "config.json")
        if os.path.exists(cfg_path):
            self.config_source = cfg_path
            self.config_overrides = read_json_file(cfg_path)
        index_files = sorted(glob.glob(os.path.join(folder, "*.safetensors.index.json")))
        if index_files:
            shards = shards_of_index(index_files[0])
            missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
            if missing:
                raise CheckpointError(f"{index_files[0]}: shard file '{missing[0]}' named by the index is missing")
        else:
            shards = sorted({os.path.basename(p) for suffix in shard_suffixes()
                             for p in glob.glob(os.path.join(folder, "*" + suffix))})
        if not shards:
            pickles = [p for p in os.listdir(folder) if p.lower().endswith((".bin", ".pt", ".ckpt", ".pth"))]
            if pickles:
                refuse_pickle(os.path.join(folder, pickles[0]))
            raise CheckpointError(f"{path}: no .safetensors weights found in this folder")
        self.files = [open_file(os.path.join(folder, s)) for s in shards]

    @staticmethod
    def _detect(keys: List[str]) -> Tuple[Optional[Family], str]:
        """The family whose signature keys the file holds and their prefix; else a family whose first signature
        key is there under one of its prefixes (stripped, so that the message names the key that is missing)."""
        found = detect(keys)
        if found is not None:
            return found
        for family in families():
            for prefix in family.checkpoint_prefixes:
                if any(k.startswith(prefix + family.signature_keys[0]) for k in keys):
                    return family, prefix
        return None, ""

    def keys(self):
        return self.index.keys()

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {k: f.shape(fk) for k, (f, fk) in self.index.items()}

    def stored_dtype(self, skip=(), default: torch.dtype = torch.float32) -> torch.dtype:
        """The dtype of most floating-point weights (the "as stored" choice), leaving out the keys in ``skip``."""
        counts: Dict[torch.dtype, int] = {}
        for k, (f, fk) in self.index.items():
            dt = f.dtype(fk)
            if k not in skip and dt.is_floating_point and dt.itemsize >= 2:
                counts[dt] = counts.get(dt, 0) + 1
        return max(counts, key=counts.get) if counts else default

    def tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(key, tensor) for every tensor, as stored, in file order, each read into its own buffer."""
        for f in self.files:
            mine = {fk: k for k, (ff, fk) in self.index.items() if ff is f}
            for fk, t in f.tensors(mine.keys()):
                yield mine[fk], t

    def read(self, key: str) -> torch.Tensor:
        """One tensor, as stored."""
        f, fk = self.index[key]
        return next(f.tensors([fk]))[1]

    def header(self, key: str) -> Tuple[torch.dtype, Tuple[int, ...]]:
        """(dtype, shape) of a tensor, from the header."""
        f, fk = self.index[key]
        return f.dtype(fk), tuple(f.shape(fk))

    def kind(self, key: str):
        """The weight format a tensor is stored in when its reader reads a format's own bytes (a GGUF block
        type: "q4_k"), else None (a plain tensor of its dtype; readers.py)."""
        f, fk = self.index[key]
        return getattr(f, "kind", lambda _: None)(fk)

    def where(self, key: str) -> str:
        """"<file>: tensor '<key in the file>'", for messages."""
        f, fk = self.index[key]
        return f"{f.path}: tensor '{fk}'"

    def describe(self) -> str:
        return self.path if len(self.files) == 1 else f"{self.path} ({len(self.files)} shards)"


def open_checkpoint(source: Union[str, os.PathLike, Checkpoint]) -> Checkpoint:
    """The one way to open a model's weights: ``source`` opened (a file or a folder, each file by its reader),
    or as it is (a Checkpoint a caller already opened)."""
    return source if isinstance(source, Checkpoint) else Checkpoint(os.fspath(source))


def check_architecture(ckpt: Checkpoint):
    """The configuration of the checkpoint's family, from the header alone (nothing is built or read yet): the
    key set, the layer numbering, the shapes and any config the file carries must agree (the family's
    ``config_from_shapes``)."""
    keys = set(ckpt.keys())
    # no family: the message names the one whose signature the file comes closest to (the first on a tie)
    family = ckpt.family or max(families(), key=lambda f: sum(k in keys for k in f.signature_keys))
    missing_sig = [k for k in family.signature_keys if k not in keys]
    if missing_sig:
        sample = ", ".join(sorted(keys)[:3]) or "(no tensors)"
        arch = getattr(ckpt.files[0], "architecture", "") if ckpt.files else ""  # GGUF: a hint, never the test
        raise CheckpointError(
            f"{ckpt.describe()}: not {_a(family.title)} diffusion model: key '{missing_sig[0]}' is missing "
            f"(the file has {len(keys)} tensors, e.g. {sample}{f'; general.architecture {arch!r}' if arch else ''})"
        )
    try:
        cfg = family.config_from_shapes(_unpacked_shapes(ckpt), ckpt.config_overrides, ckpt.config_source or "config")
    except ValueError as e:
        raise CheckpointError(f"{ckpt.describe()}: not a usable {family.title} diffusion model: {e}") from None
    check_float_dtypes(ckpt)
    return cfg


# Readers of packed layouts that only a layer's tag tells apart (ComfyUI's 4-bit integer formats, registered by
# engine/features/quant/comfy/reader.py): checkpoint -> {weight key: the values a stored row holds}.
PACKED_COLUMNS: List[Callable[["Checkpoint"], Dict[str, int]]] = []


def _unpacked_shapes(ckpt: "Checkpoint") -> Dict[str, Tuple[int, ...]]:
    """The shapes the architecture check compares: a 4-bit weight packed two values a byte (U8 [out, in/2] with
    its ``_scale``: sgld's int4, ComfyUI's nvfp4; or one a ``PACKED_COLUMNS`` reader names) counts its values, so
    a file that keeps some layers dense and packs the others (ComfyUI's "Mixed NVFP4") is one architecture. Its
    format's reader checks it in full."""
    shapes = ckpt.shapes()
    for k, (f, fk) in ckpt.index.items():
        shape = shapes[k]
        if (k.endswith(".weight") and len(shape) == 2 and f.dtype(fk) == torch.uint8 and k + "_scale" in ckpt.index
                and ckpt.kind(k) is None):
            shapes[k] = (shape[0], 2 * shape[1])
    for columns_of in PACKED_COLUMNS:
        for k, cols in columns_of(ckpt).items():
            shapes[k] = (shapes[k][0], cols)
    return shapes


def _a(title: str) -> str:
    return f"{'an' if title[:1].lower() in 'aeiou' else 'a'} {title}"


def check_float_dtypes(ckpt: "Checkpoint") -> None:
    """Model weights and biases must be floating point (an integer or bool tensor would fail deep inside torch
    later); the exceptions are a quantized weight, integer with its ``_scale`` / ``_zero`` (ComfyUI's W4A8:
    ``_s_rel``), which a weight
    format of engine/features/quant/registry.py must then claim (QuantPlan refuses it otherwise), and a weight
    its reader reports in a format's own bytes (``Checkpoint.kind``)."""
    for k, (f, fk) in ckpt.index.items():
        leaf = k.rpartition(".")[2]
        dt = f.dtype(fk)
        if leaf not in ("weight", "bias") or dt.is_floating_point:
            continue
        if leaf == "weight" and dt != torch.bool and any(k + s in ckpt.index for s in ("_scale", "_zero", "_s_rel")):
            continue
        if leaf == "weight" and ckpt.kind(k) is not None:  # e.g. GGUF blocks (quant/gguf/linear.py)
            continue
        raise CheckpointError(f"{f.path}: tensor '{fk}' is stored as {DTYPE_NAMES[dt]}, but model weights must be floating point "
                              "(F32, F16, BF16, F64, or F8 with a scale)")
