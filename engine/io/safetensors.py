"""A strict, streaming safetensors reader, and a streaming writer (atomic).

Why not ``safetensors.safe_open``: its mmap keeps every touched page resident while a model is
built, so peak RSS reaches twice the file size; and its errors on damaged files are terse. This
reader checks the header as the format's reference reader does (known dtypes, non-negative integer
shapes, string metadata, tensors that cover the data bytes exactly: no overlaps, gaps, trailing bytes
or repeated keys), naming the file and the tensor on failure, and reads each tensor straight into its
own buffer with ``readinto``. The writer takes the tensors one at a time from a function (``sgld
quantize``: one tensor in memory) and replaces the target only when the file is complete.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from .atomic import atomic_write

# The one dtype table: the format's names of torch dtypes (reader, writer, messages), and the user's
# names of the dtypes a model computes in (parse_dtype, the sgld quantize metadata).
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # the power-of-two block scales of ComfyUI's mxfp8 files
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
MAX_HEADER = 100 * 1024 * 1024
# Opcodes a protocol 0/1 pickle can start with (protocol 2+ starts with b"\x80" and the protocol number).
PICKLE_0_STARTS = frozenset(b"(}]cNIFLSVXKJMUGTa")


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def load_json_object(raw, where: str) -> dict:
    """Parse ``raw`` (str or bytes) as one JSON object without repeated keys; otherwise a CheckpointError
    that starts with ``where`` (the file and the field)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise CheckpointError(f"{where}: key '{e.args[0]}' appears twice") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{where} is not valid JSON (not UTF-8 text)") from None
    except (ValueError, RecursionError, TypeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} must be a JSON object, not {type(obj).__name__}")
    return obj


def sniff(path: str) -> str:
    """What a file holds, judged from its first and last bytes (nothing is unpickled): "zip", "pickle"
    (protocol 2+ magic), "pickle0" (looks like a protocol 0/1 pickle: a weak sign), "safetensors" (the
    layout, possibly truncated) or "other"."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(9)
        f.seek(max(size - 1, 0))
        last = f.read(1)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    # before the pickle magic: a safetensors header of 640 / 896 / 1152 / 1408 bytes starts with 80 02..80 05 too
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pickle"
    if head[:1] and head[0] in PICKLE_0_STARTS and last == b".":  # a pickle always ends with STOP (".")
        return "pickle0"
    return "other"


def refuse_pickle(path: str) -> None:
    """Refuse pickle-based checkpoints by name and by content, without unpickling anything. A file with a
    pickle name whose content is no pickle is told so (it is refused all the same: only .safetensors load)."""
    name = os.path.basename(path)
    kind = sniff(path)
    if name.lower().endswith(PICKLE_SUFFIXES):
        if kind == "safetensors":
            raise CheckpointError(
                f"{path}: '{name}' holds safetensors data under a pickle file name; rename it to .safetensors "
                "(files named .ckpt/.pt/.pth/.bin are refused as pickles)")
        if kind == "other":
            raise CheckpointError(
                f"{path}: not a safetensors file (and not a pickle either, though its name says so); only "
                ".safetensors files are loaded, and pickle checkpoints (.ckpt/.pt/.pth/.bin) are refused")
        raise CheckpointError(
            f"{path}: refusing to load '{name}': pickle-based checkpoints (.ckpt/.pt/.pth/.bin) can run "
            "arbitrary code when loaded. Only .safetensors files are supported; convert it with a trusted tool first."
        )
    if kind in ("pickle", "zip"):  # under another name only the strong signs count
        raise CheckpointError(
            f"{path}: this file is a pickle / PyTorch zip archive, not safetensors; refusing to load it "
            "(pickles can run arbitrary code). Only .safetensors files are supported."
        )


def refuse_pickles_in(folder: str) -> None:
    """A pickle-named file among ``folder``'s files is refused by name (the first in sorted order), before any
    library that would pick it up (transformers, diffusers) sees the folder."""
    for name in sorted(os.listdir(folder)):
        if name.lower().endswith(PICKLE_SUFFIXES):
            refuse_pickle(os.path.join(folder, name))


def nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


def _read_exactly(f, view: memoryview, truncated: str) -> None:
    """Fill ``view`` from ``f``: one ``readinto`` returns at most 0x7ffff000 bytes on Linux (a tensor of
    2 GiB or more takes several), and less near a short file's end (then the file is truncated)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(truncated)
        got += n


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


class SafetensorsFile:
    """Header of one safetensors file, validated; tensors are read on demand."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: file not found")
        refuse_pickle(path)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n < 2 or n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: not a safetensors file, or a truncated one (header length {n} does not fit a {size}-byte file)"
                )
            header = load_json_object(f.read(n), f"{path}: not a safetensors file: the header")
        meta = header.pop("__metadata__", None)
        if meta is not None and not isinstance(meta, dict):
            raise CheckpointError(f"{path}: header field '__metadata__' must be an object of strings, not {type(meta).__name__}")
        bad = next((k for k, v in (meta or {}).items() if not isinstance(v, str)), None)
        if bad is not None:
            raise CheckpointError(f"{path}: header field '__metadata__': the value of '{bad}' must be a string, "
                                  f"not {type(meta[bad]).__name__}")
        self.metadata: Dict[str, str] = meta or {}
        self.data_start = 8 + n
        self.entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            self.entries[key] = self._entry(key, info, size)
        self._check_coverage(size)

    def _entry(self, key: str, info, size: int) -> Tuple[torch.dtype, Tuple[int, ...], int, int]:
        path = self.path
        if not isinstance(info, dict):
            raise CheckpointError(f"{path}: not a safetensors file: header entry '{key}' must be an object with "
                                  "dtype, shape and data_offsets")
        name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(name, str) or name not in DTYPES:
            raise CheckpointError(f"{path}: tensor '{key}': dtype {name!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise CheckpointError(f"{path}: tensor '{key}': shape {shape!r} must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor '{key}': data_offsets {offsets!r} must be [begin, end] with "
                                  "0 <= begin <= end")
        dtype, (begin, end) = DTYPES[name], offsets
        size_of_tensor = nbytes(dtype, shape)
        if end - begin != size_of_tensor:
            raise CheckpointError(f"{path}: corrupt header: tensor '{key}' {tuple(shape)} {name} spans {end - begin} bytes, "
                                  f"expected {size_of_tensor}")
        if self.data_start + end > size:
            raise CheckpointError(
                f"{path}: file is truncated: tensor '{key}' ends at byte {self.data_start + end} but the file has {size} bytes"
            )
        return dtype, tuple(shape), begin, end

    def _check_coverage(self, size: int) -> None:
        """The tensors must tile the data section: each starts where the previous one ends."""
        pos, prev = 0, None
        for begin, end, key in sorted((b, e, k) for k, (_, _, b, e) in self.entries.items()):
            if begin < pos:
                raise CheckpointError(f"{self.path}: corrupt header: tensor '{key}' (data bytes {begin}-{end}) overlaps "
                                      f"tensor '{prev}'; tensors may not share bytes")
            if begin > pos:
                raise CheckpointError(f"{self.path}: corrupt header: data bytes {pos}-{begin} (before tensor '{key}') "
                                      "belong to no tensor; the tensors must cover the data exactly")
            pos, prev = end, key
        if self.data_start + pos != size:
            raise CheckpointError(f"{self.path}: corrupt file: {size - self.data_start - pos} bytes after the last tensor "
                                  "belong to no tensor; the tensors must cover the data exactly")

    def keys(self):
        return self.entries.keys()

    def shape(self, key: str) -> Tuple[int, ...]:
        return self.entries[key][1]

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][0]

    def tensors(self, keys=None, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yield (key, tensor) in file order, each read into its own buffer (optionally cast)."""
        wanted = list(self.entries) if keys is None else list(keys)
        wanted.sort(key=lambda k: self.entries[k][2])
        with open(self.path, "rb", buffering=0) as f:
            for key in wanted:
                src_dtype, shape, begin, end = self.entries[key]
                buf = torch.empty(end - begin, dtype=torch.uint8)
                f.seek(self.data_start + begin)
                _read_exactly(f, memoryview(buf.numpy()), f"{self.path}: file is truncated while reading '{key}'")
                t = buf.view(src_dtype).reshape(shape)
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t = t.to(dtype)
                yield key, t


def write_safetensors_streaming(path: str, specs: List[Tuple[str, torch.dtype, tuple]],
                                produce: Callable[[str], torch.Tensor], metadata: dict) -> None:
    """Write a safetensors file whose tensors come one at a time from ``produce(key) -> tensor``
    (memory: one tensor). ``specs`` fixes the order, dtypes and shapes in the header."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    offset = 0
    for key, dtype, shape in specs:
        size = nbytes(dtype, shape)
        header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": [int(d) for d in shape], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with atomic_write(path) as f:  # a unique temporary file, renamed when complete, removed on any failure
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, dtype, shape in specs:
            t = produce(key)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"internal: '{key}' produced {t.dtype} {tuple(t.shape)}, header says {dtype} {tuple(shape)}")
            f.write(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
