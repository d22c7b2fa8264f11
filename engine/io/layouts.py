"""A weight file in another tool's names read in the family's own (``Family.layouts``, engine/models/family.py): the
file's reader wrapped so that every caller of the checkpoint (loading, weight formats, header checks) sees our names,
shapes and tensors. A fused tensor is read once and split into equal parts along dim 0, each part its own buffer."""
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
        self._map: Dict[str, Tuple[str, Optional[Tuple[int, int]]]] = {}  # ours -> (theirs, (part, parts) or None)
        for key in file.keys():
            bare = key[len(prefix):] if key.startswith(prefix) else None
            for name, part in (layout.translate(bare) if bare is not None else [(key, None)]):
                if part is not None:
                    rows, parts = file.shape(key)[0], part[1]
                    if kind(key) is not None or not file.dtype(key).is_floating_point or rows % parts:
                        raise CheckpointError(
                            f"{file.path}: tensor '{key}' ({layout.name}: {parts} tensors fused) can be read only as "
                            f"a plain float tensor of a multiple of {parts} rows (it is {kind(key) or file.dtype(key)}, "
                            f"{rows} rows); convert the file to safetensors in bf16 or fp16")
                ours = prefix + name if bare is not None else name
                if ours in self._map:
                    raise CheckpointError(f"{file.path}: tensors '{self._map[ours][0]}' and '{key}' are both "
                                          f"'{name}' in {layout.name}")
                self._map[ours] = (key, part)

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

    def tensors(self, keys=None, **kw) -> Iterator[Tuple[str, torch.Tensor]]:
        wanted: Dict[str, list] = {}  # theirs -> [(ours, part)], each fused tensor read once
        for ours in (self._map if keys is None else keys):
            theirs, part = self._map[ours]
            wanted.setdefault(theirs, []).append((ours, part))
        for theirs, t in self.file.tensors(wanted.keys(), **kw):
            for ours, part in wanted[theirs]:
                yield ours, t if part is None else t.chunk(part[1])[part[0]].clone()
