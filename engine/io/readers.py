"""The checkpoint readers as one table: ``READERS`` (name -> ``Reader``), chosen for a file by its name, then
by its first bytes. Every weight file is opened through ``open_file`` (engine/io/checkpoint.py's
``open_checkpoint`` for models), which refuses pickles first, whatever reader would take the file; a new
file kind (GGUF) is one module that calls ``register_reader``, imported by engine/io/__init__.py
(docs/architecture.md)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ..errors import CheckpointError
from .safetensors import SafetensorsFile, refuse_pickle

HEAD_BYTES = 16  # what ``matches`` sees of a file


@dataclass(frozen=True)
class Reader:
    """One kind of weight file. ``open(path)`` gives an object with ``path``, ``metadata`` (str -> str),
    ``keys()``, ``dtype(key)``, ``shape(key)`` and ``tensors(keys)`` (yielding (key, tensor) in file order,
    each in its own buffer), raising CheckpointError naming the file for anything wrong in it, and may have
    ``kind(key)``: the weight format (a name of engine/features/quant/registry.py's table) whose own bytes a
    tensor is read as (GGUF blocks: "q4_k"), None (or no such method) for a plain tensor of its dtype;
    ``suffixes``: the file names it takes (also the shards a folder is searched for); ``matches(head)``: the
    file's first bytes say it is one (a file under another name)."""

    name: str
    suffixes: Tuple[str, ...]
    matches: Callable[[bytes], bool]
    open: Callable[[str], object]


def _is_safetensors(head: bytes) -> bool:
    return len(head) >= 9 and head[8:9] == b"{"  # an 8-byte header length, then the JSON header


SAFETENSORS = Reader("safetensors", (".safetensors",), _is_safetensors, SafetensorsFile)
READERS: Dict[str, Reader] = {SAFETENSORS.name: SAFETENSORS}
DEFAULT = SAFETENSORS.name  # a file that no reader recognizes: this one's errors say what is wrong with it


def register_reader(reader: Reader) -> Reader:
    if reader.name in READERS:
        raise ValueError(f"checkpoint reader '{reader.name}' is registered twice")
    READERS[reader.name] = reader
    return reader


def unregister_reader(name: str) -> None:
    """Take a reader out of the table (tests that register one of their own); the default stays."""
    if name != DEFAULT:
        READERS.pop(name, None)


def shard_suffixes() -> Tuple[str, ...]:
    """The file names a checkpoint folder is searched for."""
    return tuple(s for r in READERS.values() for s in r.suffixes)


def reader_for(path: str) -> Reader:
    """The reader of a file: the one whose suffix the name ends in, else the one its first bytes match."""
    name = os.path.basename(path).lower()
    by_name = next((r for r in READERS.values() if name.endswith(r.suffixes)), None)
    if by_name is not None:
        return by_name
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    by_content: Optional[Reader] = next((r for r in READERS.values() if r.matches(head)), None)
    return by_content or READERS[DEFAULT]


def open_file(path: str):
    """One weight file opened by its reader; pickles are refused (by name and by content) before any reader."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found")
    refuse_pickle(path)
    return reader_for(path).open(path)
