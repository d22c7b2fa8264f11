"""A weight file in another tool's names read in the family's own (``Family.layouts``, engine/models/family.py): the
file's reader wrapped so that every caller of the checkpoint (loading, weight formats, header checks) sees our names,
shapes and tensors. A fused tensor is read once and split into equal parts along dim 0, each part its own buffer; its
module's other tensors are cut the same way when they are row-wise, else each part reads them whole."""
from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..models.family import Layout


class LayoutView:
    """The reader interface of engine/io/readers.py over ``file``, in our names (their ``prefix`` kept)."""

    def __init__(self, file, layout: Layout, prefix: str):
        self.file, self.path, self.metadata, self.layout = file, file.path, file.metadata, layout
        kind = getattr(file, "kind", lambda _: None)
        self._keys = set(file.keys())
        self._map: Dict[str, Tuple[str, Optional[Tuple[int, int]]]] = {}  # ours -> (theirs, (part, parts) or None)
        for key in file.keys():
            bare = key[len(prefix):] if key.startswith(prefix) else None
            for name, part in (layout.translate(bare) if bare is not None else [(key, None)]):
                if part is not None and self._whole(key):
                    part = None  # a companion each part takes whole (a per-tensor scale, ComfyUI's layer tag)
                if part is not None:
                    self._check_split(key, part[1], kind(key))
                ours = prefix + name if bare is not None else name
                if ours in self._map:
                    raise CheckpointError(f"{file.path}: tensors '{self._map[ours][0]}' and '{key}' are both "
                                          f"'{name}' in {layout.name}")
                self._map[ours] = (key, part)

    def _whole(self, key: str) -> bool:
        """A fused module's tensor that is not row-wise: one that is not its weight and whose first dimension is not
        the weight's rows (a scalar scale, ComfyUI's ``comfy_quant`` tag); a bias or a per-row scale is cut."""
        head, _, leaf = key.rpartition(".")
        weight = head + ".weight"
        if leaf == "weight" or weight not in self._keys:
            return False
        shape = self.file.shape(key)
        return len(shape) == 0 or shape[0] != self.file.shape(weight)[0]

    def _check_split(self, key: str, parts: int, kind) -> None:
        """A fused tensor splits along its rows: a float tensor, or one whose stored rows are its rows (GGUF's block
        types quantize each row on its own), of a multiple of ``parts`` rows."""
        file, rows = self.file, self.file.shape(key)[0]
        stored = getattr(file, "stored_shape", lambda _: file.shape(key))(key)
        rowwise = file.dtype(key).is_floating_point if kind is None else (len(stored) == 2 and stored[0] == rows)
        if not rowwise or rows % parts:
            raise CheckpointError(
                f"{file.path}: tensor '{key}' ({self.layout.name}: {parts} tensors fused) can be read only as a float "
                f"or row-wise block-quantized (GGUF) tensor of a multiple of {parts} rows (it is "
                f"{kind or file.dtype(key)}, {rows} rows, stored as {list(stored)}); convert the file to safetensors")

    def __getattr__(self, name: str):
        """What the file says of itself (a GGUF file's ``architecture``) is the view's too."""
        if name.startswith("_") or name in ("file", "layout"):
            raise AttributeError(name)
        return getattr(self.file, name)

    def keys(self):
        return self._map.keys()

    def shape(self, key: str) -> Tuple[int, ...]:
        theirs, part = self._map[key]
        shape = tuple(self.file.shape(theirs))
        return shape if part is None else (shape[0] // part[1],) + shape[1:]

    def dtype(self, key: str) -> torch.dtype:
        return self.file.dtype(self._map[key][0])

    def kind(self, key: str):
        return getattr(self.file, "kind", lambda _: None)(self._map[key][0])

    def stored_shape(self, key: str) -> Tuple[int, ...]:
        """A block-quantized tensor's byte layout, [rows, bytes per row] (a split keeps its share of the rows)."""
        theirs, part = self._map[key]
        shape = tuple(self.file.stored_shape(theirs))
        return shape if part is None else (shape[0] // part[1],) + shape[1:]

    def stored_bytes(self, key: str) -> int:
        theirs, part = self._map[key]
        n = self.file.stored_bytes(theirs)
        return n if part is None else n // part[1]

    def tensors(self, keys=None, **kw) -> Iterator[Tuple[str, torch.Tensor]]:
        wanted: Dict[str, list] = {}  # theirs -> [(ours, part)], each fused tensor read once
        for ours in (self._map if keys is None else keys):
            theirs, part = self._map[ours]
            wanted.setdefault(theirs, []).append((ours, part))
        for theirs, t in self.file.tensors(wanted.keys(), **kw):
            for ours, part in wanted[theirs]:
                yield ours, t if part is None else t.chunk(part[1])[part[0]].clone()
