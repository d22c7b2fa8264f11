"""``LiveNames``: the names of a kind table (weight formats, attention backends) as a sequence that reads the
table each time, so an option declared with it as its choices (engine/config.py) offers a kind registered
after the declaration too: the table stays the one source."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Tuple


class LiveNames(Sequence):
    def __init__(self, names: Callable[[], Tuple[str, ...]]):
        self._names = names

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))
