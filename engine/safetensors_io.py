"""A strict, streaming safetensors reader.

Why not ``safetensors.safe_open``: its mmap keeps every touched page resident while a model is
built, so peak RSS reaches twice the file size; and its errors on damaged files are terse. This
reader checks the header against the file size first (naming the file and the tensor on failure)
and reads each tensor straight into its own buffer with ``readinto``.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Dict, Iterator, Optional, Tuple

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A model file that cannot be used; the message names the file and the problem."""


def refuse_pickle(path: str) -> None:
    """Refuse pickle-based checkpoints by name and by content, without unpickling anything."""
    name = os.path.basename(path)
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise CheckpointError(
            f"{path}: refusing to load '{name}': pickle-based checkpoints (.ckpt/.pt/.pth/.bin) can run "
            "arbitrary code when loaded. Only .safetensors files are supported; convert it with a trusted tool first."
        )
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] == b"\x80\x02" or head[:1] == b"\x80" and head[1:2] in (b"\x03", b"\x04", b"\x05") or head == b"PK\x03\x04":
        raise CheckpointError(
            f"{path}: this file is a pickle / PyTorch zip archive, not safetensors; refusing to load it "
            "(pickles can run arbitrary code). Only .safetensors files are supported."
        )


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
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: not a safetensors file (header is not valid JSON: {e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
        self.metadata: Dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: not a safetensors file (bad header entry for '{key}')") from None
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            if end - begin != nbytes or begin < 0:
                raise CheckpointError(f"{path}: corrupt header: tensor '{key}' {shape} {info['dtype']} spans {end - begin} bytes, expected {nbytes}")
            if self.data_start + end > size:
                raise CheckpointError(
                    f"{path}: file is truncated: tensor '{key}' ends at byte {self.data_start + end} but the file has {size} bytes"
                )
            self.entries[key] = (dtype, shape, begin, end)

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
                if end > begin and f.readinto(buf.numpy()) != end - begin:
                    raise CheckpointError(f"{self.path}: file is truncated while reading '{key}'")
                t = buf.view(src_dtype).reshape(shape)
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t = t.to(dtype)
                yield key, t
