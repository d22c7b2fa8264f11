"""Which LoRAs a caller asked for: ``FILE:STRENGTH`` specs and (path, strength) pairs, checked; and the
files read against one model, cached by what identifies the file (formats.file_key) so that asking again
before every run is cheap.
"""
from __future__ import annotations

import math
import os
from typing import Dict, Iterable, List, Optional, Tuple

from torch import nn

from ...errors import LoRAError
from .formats import LoRAFile, LoRATensors, file_key, read_lora

MAX_CACHED_FILES = 8


def parse_spec(spec: str) -> Tuple[str, float]:
    """``FILE:STRENGTH`` (``FILE`` alone = strength 1.0; a Windows drive letter is not a strength)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            strength = float(tail)
        except ValueError:
            return spec, 1.0
        if not math.isfinite(strength):
            raise LoRAError(f"LoRA '{spec}': the strength '{tail}' is not a finite number (FILE:STRENGTH, e.g. "
                            f"{head}:0.8)")
        return head, strength
    return spec, 1.0


def normalize(loras: Optional[Iterable]) -> List[Tuple[object, float]]:
    """[(path, LoRAFile or LoRATensors, strength)] from paths, (path, strength) pairs or "FILE:STRENGTH" strings."""
    out = []
    for item in loras or ():
        if isinstance(item, str):
            item = parse_spec(item)
        path, strength = item
        name = getattr(path, "path", getattr(path, "name", path))
        try:
            strength = float(strength)
        except (TypeError, ValueError):
            raise LoRAError(f"{name}: LoRA strength '{strength}' is not a number") from None
        if not math.isfinite(strength):
            raise LoRAError(f"{name}: LoRA strength {strength} is not a finite number")
        out.append((path if isinstance(path, (LoRAFile, LoRATensors)) else os.fspath(path), strength))
    return out


class LoRAFileCache:
    """The last ``size`` LoRA files read against one model (its owner, an Engine, keeps one per model)."""

    def __init__(self, size: int = MAX_CACHED_FILES):
        self.size = size
        self._files: Dict[tuple, tuple] = {}  # key -> (what was read, LoRAFile)

    def read(self, path, model: nn.Module) -> LoRAFile:
        """The LoRA at ``path`` (or a LoRATensors) read against ``model``, from the cache while the file is
        unchanged (a LoRATensors: while it is the same object, which the cache keeps alive with its entry)."""
        if isinstance(path, LoRATensors):
            key = ("memory", id(path))
        else:
            path = os.fspath(path)
            key = file_key(path)
        source, lf = self._files.pop(key, (None, None))
        if lf is None or (isinstance(path, LoRATensors) and source is not path):
            lf = read_lora(path, model)
        self._files[key] = (path, lf)  # most recently used last
        while len(self._files) > self.size:
            self._files.pop(next(iter(self._files)))
        return lf

    def files(self, loras: Optional[Iterable], model: nn.Module) -> List[Tuple[LoRAFile, float]]:
        """``normalize(loras)`` with every path read (a LoRAFile given is used as it is)."""
        return [(p if isinstance(p, LoRAFile) else self.read(p, model), s) for p, s in normalize(loras)]
