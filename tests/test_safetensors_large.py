"""A tensor of 2 GiB or more reads whole: Linux hands out at most 0x7ffff000 bytes per read() call, so the
reader loops until the tensor is in. The file is sparse (a header, holes, a few marked bytes): ~2.1 GiB of
address space, no disk; the tensor (2.1 GiB of memory) is freed at once."""
from __future__ import annotations

import gc
import json
import struct

import pytest
import torch

from engine.io.safetensors import SafetensorsFile

SIZE = 2 ** 31 + 2 ** 26  # bytes: past the 0x7ffff000 bytes of one read()
MARKS = {0: 7, 0x7ffff000: 9, SIZE - 1: 5}  # offset in the tensor -> byte value


def sparse_file(path, size: int = SIZE) -> str:
    header = json.dumps({"big": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        start = f.tell()
        f.truncate(start + size)  # holes read as zeros
        for offset, value in MARKS.items() if size == SIZE else ():
            f.seek(start + offset)
            f.write(bytes([value]))
    return str(path)


def test_a_tensor_over_2_gib_reads_whole(tmp_path):
    f = SafetensorsFile(sparse_file(tmp_path / "big.safetensors"))
    try:
        ((key, t),) = list(f.tensors())
        assert key == "big" and t.shape == (SIZE,) and t.dtype == torch.uint8
        assert {offset: int(t[offset]) for offset in MARKS} == MARKS
        assert int(t[1]) == 0 and int(t[SIZE - 2]) == 0
    finally:
        t = None
        gc.collect()


def test_a_truncated_file_is_still_refused(tmp_path):
    """The loop ends at the file's end: a file that shrank after its header was read is refused by name."""
    path = sparse_file(tmp_path / "small.safetensors", 4096)
    f = SafetensorsFile(path)
    with open(path, "r+b") as out:
        out.truncate(f.data_start + 100)
    with pytest.raises(ValueError, match="truncated while reading 'big'"):
        list(f.tensors())
