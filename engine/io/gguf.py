"""The GGUF reader of the checkpoint-reader table (engine/io/readers.py): ``.gguf`` files (and files that start
with the GGUF magic), as unsloth and city96's ComfyUI-GGUF write them.

The header is parsed by ``gguf.GGUFReader`` (the format's reference Python reader, memory-mapped), but only
after ``_scan`` walked it once itself, bounding every count and length by the bytes really left in the file and
the tensor count by a DiT's (``MAX_TENSORS``), and checking each tensor as strictly as a safetensors entry: a type
of ``READ_TYPES``, 1-4 positive dims, whole blocks per row, an aligned offset, its bytes inside the file and no two
tensors sharing bytes (the reference reader would loop over, and build objects for, whatever a header states).
ComfyUI-GGUF's convention is honoured: a tensor stored reshaped has its torch shape in the metadata key
``comfy.gguf.orig_shape.<name>`` (an INT32 array). Quantized tensors are reported as U8 in their torch
(logical) shape and read as their raw bytes, [rows, bytes per row]; the weight formats of
engine/features/quant/gguf/linear.py keep them so. Details: docs/quantization.md, "Loading GGUF files".
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Dict, Iterator, Optional, Tuple

import gguf
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import CheckpointError
from .readers import Reader, register_reader

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_HEADER = 256 * 1024 * 1024  # metadata and tensor infos (an ERNIE-Image file's header is ~100 KB)
MAX_STRING = 16 * 1024 * 1024  # one metadata string
MAX_NAME = 4096  # a key or tensor name (ggml itself allows 64 bytes)
MAX_ARRAY_ITEMS = 1 << 16  # all metadata arrays together: the reference reader makes objects per item
MAX_DEPTH = 3  # arrays of arrays
MAX_DIMS = 4  # GGML_MAX_DIMS
# A DiT's tensors: ERNIE-Image 8B has 409 (11 per layer); MAX_LAYERS (512) of its layers fit. The reference reader
# builds objects per tensor and per key (300,000 took it 57 s and 1.6 GB), so the counts are bounded before it runs.
MAX_TENSORS = 8192
MAX_KV = MAX_TENSORS + 1024  # general.* keys and a comfy.gguf.orig_shape.<name> per tensor
ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
# GGUF value types -> (struct format, size) of the scalar ones; 8 = string, 9 = array
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
STRING, ARRAY, INT32 = 8, 9, 5


_T = GGMLQuantizationType
# The block types read (engine/features/quant/gguf/numerics.py dequantizes exactly these: SUPPORTED there,
# tests/checkpoints/test_gguf_validation.py checks the two agree). F32 / F16 / BF16 load as ordinary tensors.
READ_TYPES: Dict[int, str] = {int(t): t.name for t in (_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q5_0,
                                                        _T.Q5_1, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K)}
DENSE = {int(_T.F32): torch.float32, int(_T.F16): torch.float16, int(_T.BF16): torch.bfloat16}


def tensor_bytes(qtype: int, shape: Tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` (torch order, rows last, whole blocks) in block type ``qtype``."""
    block, size = GGML_QUANT_SIZES[_T(qtype)]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * (shape[-1] // block) * size


class _Scan:
    """A bounded walk over the header bytes (``buf``, the file's size ``size``), failing with field names."""

    def __init__(self, path: str, buf, size: int):
        self.path, self.buf, self.size, self.pos, self.items = path, buf, size, 0, 0

    def fail(self, what: str):
        raise CheckpointError(f"{self.path}: not a valid GGUF file: {what}")

    def take(self, n: int, field: str) -> int:
        if n < 0 or self.pos + n > min(self.size, MAX_HEADER):
            where = "the file ends" if self.pos + n > self.size else f"the header passes {MAX_HEADER >> 20} MB"
            self.fail(f"{field} needs {n} bytes at byte {self.pos}, but {where} (truncated or damaged header)")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str, n: int, field: str):
        return struct.unpack_from(fmt, self.buf, self.take(n, field))[0]

    def string(self, field: str, limit: int, name: bool = False) -> str:
        n = self.unpack("<Q", 8, f"the length of {field}")
        if n > limit or (name and n == 0):
            self.fail(f"{field} is {n} bytes long; {'1 to ' if name else 'at most '}{limit} are allowed")
        start = self.take(n, field)
        try:
            text = bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{field} is not UTF-8 text")
        if name and not text.isprintable():
            self.fail(f"{field} {ascii(text)} holds control characters")
        return text

    def value(self, vtype: int, field: str, depth: int = 0) -> None:
        if vtype in SCALARS:
            self.take(SCALARS[vtype][1], field)
        elif vtype == STRING:
            self.string(field, MAX_STRING)
        elif vtype == ARRAY:
            if depth >= MAX_DEPTH:
                self.fail(f"{field}: arrays nested deeper than {MAX_DEPTH}")
            itype = self.unpack("<I", 4, f"the item type of {field}")
            count = self.unpack("<Q", 8, f"the length of {field}")
            self.items += count
            if self.items > MAX_ARRAY_ITEMS:
                self.fail(f"{field}: the metadata arrays hold more than {MAX_ARRAY_ITEMS} items")
            if itype not in SCALARS and itype not in (STRING, ARRAY):
                self.fail(f"{field}: unknown item type {itype}")
            if itype in SCALARS:  # one bounds check for the whole run
                self.take(count * SCALARS[itype][1], f"{field} ({count} items)")
            else:
                for i in range(count):
                    self.value(itype, f"{field}[{i}]", depth + 1)
        else:
            self.fail(f"{field}: unknown value type {vtype}")


def _scan(path: str, buf, size: int):
    """Walk the fixed header, every key/value and every tensor info within the file, and check each tensor
    (a supported type, 1-4 positive dims, whole blocks per row, an aligned offset, its bytes inside the file, no
    shared bytes), all before the reference reader runs: the work is bounded by MAX_TENSORS and the file's size.
    Returns ({name: (qtype, torch shape, absolute offset, bytes)}, kv count, data start, alignment)."""
    s = _Scan(path, buf, size)
    if size < 24 or bytes(buf[:4]) != MAGIC:
        s.fail(f"it does not start with the GGUF magic and a 24-byte header (the file has {size} bytes)")
    s.take(4, "magic")
    version = s.unpack("<I", 4, "version")
    if version & 0xFFFF == 0 and version:
        s.fail("header field 'version': a big-endian file; only little-endian GGUF files are read")
    if version not in VERSIONS:
        s.fail(f"header field 'version' = {version}; versions {' and '.join(map(str, VERSIONS))} are read")
    n_tensors = s.unpack("<Q", 8, "tensor_count")
    n_kv = s.unpack("<Q", 8, "kv_count")
    if n_kv * 13 > size - 24:  # a key/value takes at least 13 bytes
        s.fail(f"header field 'kv_count' = {n_kv} does not fit a {size}-byte file")
    if n_kv > MAX_KV:
        s.fail(f"header field 'kv_count' = {n_kv}: at most {MAX_KV} metadata entries are read")
    if n_tensors * 33 > size - 24 or not 1 <= n_tensors <= MAX_TENSORS:  # a tensor info takes at least 33 bytes
        s.fail(f"header field 'tensor_count' = {n_tensors}: must be 1 to {MAX_TENSORS} (a DiT's tensors; "
               f"ERNIE-Image has 409) and fit a {size}-byte file")
    alignment = 32  # GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = s.string(f"the key of metadata entry {i}", MAX_NAME, name=True)
        vtype = s.unpack("<I", 4, f"the value type of metadata '{key}'")
        at = s.pos
        s.value(vtype, f"metadata '{key}'")
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buf, at)[0] if vtype == 4 else 0
            if not alignment or alignment & (alignment - 1) or alignment > 1 << 20:
                s.fail("metadata 'general.alignment' must be a UINT32 power of two up to 1 MB")
    infos = []
    for i in range(n_tensors):
        name = s.string(f"the name of tensor {i}", MAX_NAME, name=True)
        n_dims = s.unpack("<I", 4, f"tensor '{name}': n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            s.fail(f"tensor '{name}': n_dims = {n_dims}; 1 to {MAX_DIMS} are allowed")
        at = s.take(8 * n_dims + 12, f"tensor '{name}': dims, type and offset")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, at)
        qtype, offset = struct.unpack_from("<IQ", buf, at + 8 * n_dims)
        infos.append((name, dims, qtype, offset))
    data_start = -(-s.pos // alignment) * alignment
    tensors: Dict[str, Tuple[int, Tuple[int, ...], int, int]] = {}
    for name, dims, qtype, offset in infos:
        if name in tensors:
            s.fail(f"tensor '{name}' appears twice")
        if qtype not in READ_TYPES:
            known = _T(qtype).name if qtype in _T._value2member_map_ else "unknown"
            raise CheckpointError(f"{path}: tensor '{name}': GGUF type {qtype} ({known}) is not read; allowed: "
                                  f"{', '.join(READ_TYPES.values())}")
        if not all(d > 0 for d in dims):
            raise CheckpointError(f"{path}: tensor '{name}': dims {list(dims)} must be positive")
        shape = tuple(reversed(dims))  # torch order; GGUF lists the row (ne[0]) first
        block = GGML_QUANT_SIZES[_T(qtype)][0]
        if shape[-1] % block:
            raise CheckpointError(f"{path}: tensor '{name}': rows of {shape[-1]} values are not whole "
                                  f"{READ_TYPES[qtype]} blocks of {block}")
        nbytes = tensor_bytes(qtype, shape)
        if offset % alignment:
            raise CheckpointError(f"{path}: tensor '{name}': offset {offset} is not a multiple of the alignment {alignment}")
        if data_start + offset + nbytes > size:
            raise CheckpointError(f"{path}: file is truncated: tensor '{name}' {list(shape)} {READ_TYPES[qtype]} "
                                  f"ends at byte {data_start + offset + nbytes} but the file has {size} bytes")
        tensors[name] = (qtype, shape, data_start + offset, nbytes)
    _check_coverage(path, tensors, data_start, alignment, size)
    return tensors, n_kv, data_start, alignment


def _check_coverage(path: str, tensors: dict, data_start: int, alignment: int, size: int) -> None:
    """No two tensors share bytes; between them (and after the last) only alignment padding. One sort by offset:
    O(n log n), before the reference reader builds anything."""
    pos, prev = data_start, None
    for begin, end, key in sorted((e[2], e[2] + e[3], k) for k, e in tensors.items()):
        if begin < pos and prev is not None:
            raise CheckpointError(f"{path}: corrupt header: tensor '{key}' (bytes {begin}-{end}) overlaps "
                                  f"tensor '{prev}'; tensors may not share bytes")
        if begin - pos >= alignment:
            raise CheckpointError(f"{path}: corrupt header: bytes {pos}-{begin} (before tensor '{key}') "
                                  "belong to no tensor")
        pos, prev = end, key
    if size - pos >= alignment:
        raise CheckpointError(f"{path}: corrupt file: {size - pos} bytes after the last tensor belong to no tensor")


def _reference_reader(path: str):
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid GGUF file: the reference reader refuses it "
                              f"({type(e).__name__}: {str(e)[:160]})") from None


def _text(field) -> str:
    """A metadata value as the Reader protocol's string: strings as they are, other values as JSON."""
    types = [int(t) for t in field.types]
    if types == [STRING]:
        return field.contents()
    return json.dumps(field.contents())


class GGUFFile:
    """Header of one GGUF file, validated; tensors are read on demand into their own buffers (``readinto``:
    no page of the file stays mapped while a model is built)."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        if size == 0:
            raise CheckpointError(f"{path}: not a valid GGUF file: the file is empty")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            tensors, n_kv, data_start, self.alignment = _scan(path, buf, size)
        reader = _reference_reader(path)
        theirs = {t.name: (int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())), int(t.data_offset))
                  for t in reader.tensors}
        if (len(reader.fields) != n_kv + 3 or int(reader.data_offset) != data_start  # + version and the two counts
                or theirs != {k: v[:3] for k, v in tensors.items()}):
            raise CheckpointError(f"{path}: not a valid GGUF file: the reference reader reads its header otherwise "
                                  f"({len(reader.tensors)} tensors, {len(reader.fields) - 3} metadata entries)")
        try:
            self.metadata: Dict[str, str] = {k: _text(v) for k, v in reader.fields.items() if not k.startswith("GGUF.")}
        except (UnicodeDecodeError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: not a valid GGUF file: a metadata value cannot be read "
                                  f"({type(e).__name__}: {str(e)[:120]})") from None
        self.architecture = self.metadata.get("general.architecture", "")
        self.data_start = data_start
        # key -> (qtype, stored torch shape, torch shape, absolute offset, bytes)
        self.entries: Dict[str, Tuple[int, Tuple[int, ...], Tuple[int, ...], int, int]] = {
            k: (qtype, shape, self._orig_shape(reader, k, shape), begin, n) for k, (qtype, shape, begin, n) in tensors.items()}
        del reader  # its memory map goes with it

    def _orig_shape(self, reader, name: str, stored: Tuple[int, ...]) -> Tuple[int, ...]:
        field = reader.get_field(ORIG_SHAPE_KEY + name)
        if field is None:
            return stored
        where = f"{self.path}: metadata '{ORIG_SHAPE_KEY + name}'"
        if [int(t) for t in field.types] != [ARRAY, INT32]:
            raise CheckpointError(f"{where} must be an array of INT32 (the tensor's torch shape)")
        shape = tuple(int(v) for v in field.contents())
        n = 1
        for d in shape:
            n *= d
        m = 1
        for d in stored:
            m *= d
        if not shape or len(shape) > 8 or not all(d > 0 for d in shape) or n != m:
            raise CheckpointError(f"{where} = {list(shape)} must be positive sizes of {m} values in all, "
                                  f"as tensor '{name}' {list(stored)} holds")
        return shape

    # -- the Reader protocol ----------------------------------------------------------------------------------
    def keys(self):
        return self.entries.keys()

    def shape(self, key: str) -> Tuple[int, ...]:
        return self.entries[key][2]

    def dtype(self, key: str) -> torch.dtype:
        return DENSE.get(self.entries[key][0], torch.uint8)

    def kind(self, key: str) -> Optional[str]:
        """The block type of a quantized tensor as the weight format's name ("q4_k"); None for F32 / F16 / BF16
        (read as ordinary tensors)."""
        qtype = self.entries[key][0]
        return None if qtype in DENSE else READ_TYPES[qtype].lower()

    def stored_shape(self, key: str) -> Tuple[int, ...]:
        """The torch shape the bytes are laid out in (differs from ``shape`` for a reshaped tensor)."""
        return self.entries[key][1]

    def stored_bytes(self, key: str) -> int:
        return self.entries[key][4]

    def tensors(self, keys=None, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """(key, tensor) in file order, each in its own buffer: F32/F16/BF16 as tensors of their shape,
        quantized ones as their uint8 bytes [rows, bytes per row] of the stored layout."""
        wanted = sorted(self.entries if keys is None else keys, key=lambda k: self.entries[k][3])
        with open(self.path, "rb", buffering=0) as f:
            for key in wanted:
                qtype, stored, shape, begin, n = self.entries[key]
                buf = torch.empty(n, dtype=torch.uint8)
                f.seek(begin)
                view, got = memoryview(buf.numpy()), 0
                while got < n:  # one readinto returns at most 2 GiB, and less at a short file's end
                    step = f.readinto(view[got:])
                    if not step:
                        raise CheckpointError(f"{self.path}: file is truncated while reading '{key}'")
                    got += step
                if qtype in DENSE:
                    t = buf.view(DENSE[qtype]).reshape(shape)
                    if dtype is not None and t.dtype != dtype:
                        t = t.to(dtype)
                else:
                    t = buf.reshape(-1, tensor_bytes(qtype, stored[-1:]))  # [rows, bytes per row]
                yield key, t


def is_gguf(head: bytes) -> bool:
    return head[:4] == MAGIC


GGUF = register_reader(Reader("gguf", (".gguf",), is_gguf, GGUFFile))
