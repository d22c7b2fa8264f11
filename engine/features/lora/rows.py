"""Per-request LoRAs: several LoRA sets in one batched forward, each on its own rows, the base weights untouched
(what S-LoRA and Punica do for language models), through the "lora" side path of state.py (one class swap).

``RowLoRAs`` (the "lora_rows" Patch) is a cache of LoRA files read against the model under a byte budget, least
recently used out. The files a forward needs are made resident (``use``): their side-path terms at strength 1,
on the compute device, sit in ``SidePath.row_terms`` of every module they adapt, and that module's forward adds
them to the rows the thread's ``RowRoute`` gives each adapter (``routed``), times each row's strength: one pair
of GEMMs per adapter and module, over all rows that use it.

What a job's rows get is its set minus the model's merged set (``net``): a job that asks for nothing new gets
no terms (the merged weights are its set), a job with its own set gets its LoRAs and the merged ones with the
opposite strength. Identity is the LoRAFile object: files read through this cache and merged with
``Engine.set_loras`` of the same objects cancel exactly.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...errors import LoRAError
from .. import patching
from ..fuse import RowView
from .files import file_key
from .formats import LoRAFile, read_lora, target_modules
from .state import FEATURE as SIDE
from .state import RowRoute, SidePath, active_loras, low_rank_of, refresh_class, side_module, side_terms

FEATURE = "lora_rows"
DEFAULT_BUDGET_BYTES = 2 << 30
MAX_NAMES = 256  # LoRA names the per-LoRA counters remember (the metrics' label values)


class _Entry:
    """One cached LoRA: its file read against the model, and where its terms are resident."""

    def __init__(self, lf: LoRAFile, key: int, file_key: Optional[tuple]):
        self.lf, self.key, self.file_key = lf, key, file_key
        self.modules: List[nn.Module] = []  # the modules holding its row terms (resident) or []
        self.terms_bytes = 0
        self.pinned = False  # its terms are being made (the forward's thread): not evicted meanwhile

    @property
    def nbytes(self) -> int:
        return self.lf.nbytes + self.terms_bytes


def net(own: Optional[Sequence[Tuple[LoRAFile, float]]], merged: Sequence[Tuple[LoRAFile, float]]) -> List[Tuple[LoRAFile, float]]:
    """[(LoRAFile, strength)] a job's rows need on top of the merged set: ``own`` (None: the merged set itself,
    nothing to add) minus ``merged``, by LoRAFile identity; zero strengths dropped."""
    if own is None:
        return []
    out: Dict[int, list] = {}
    for lf, s in own:
        out.setdefault(id(lf), [lf, 0.0])[1] += float(s)
    for lf, s in merged:
        out.setdefault(id(lf), [lf, 0.0])[1] -= float(s)
    return [(lf, s) for lf, s in out.values() if s != 0.0]


class RowLoRAs(patching.Patch):
    """The per-request LoRAs of one model: read (any thread), made resident per forward (the forward's thread)."""

    name = FEATURE

    def __init__(self, model: nn.Module, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        super().__init__(model)
        self.budget = int(budget_bytes)
        self._lock = threading.Lock()
        self._entries: "OrderedDict[int, _Entry]" = OrderedDict()  # id(LoRAFile) -> entry, most recent last
        self._by_file: Dict[tuple, int] = {}
        self._next_key = 0
        self.counts: "OrderedDict[str, Dict[str, int]]" = OrderedDict()  # LoRA name -> its counters

    # -- reading (request threads) -------------------------------------------------------------------------
    def read(self, path) -> LoRAFile:
        """The LoRA at ``path`` read against the model (from the cache while the file is unchanged); LoRAError
        naming the file and what is wrong. ``check`` says whether per-request use can apply it."""
        key = file_key(path)
        with self._lock:
            entry = self._entries.get(self._by_file.get(key, -1))
            if entry is not None:
                self._entries.move_to_end(id(entry.lf))
                return entry.lf
        lf = read_lora(path, self.model)
        with self._lock:
            entry = self._add(lf, key)
            self._shrink(keep=None)
            return entry.lf

    def adopt(self, lf: LoRAFile) -> None:
        """Cache ``lf`` (a LoRA merged before this cache existed: ``sgld serve --lora``) under its file as it is now,
        so requests naming that file get this very object (and cancel against the merged set)."""
        try:
            key = file_key(lf.path)
        except LoRAError:
            return
        with self._lock:
            self._add(lf, key)

    def check(self, lf: LoRAFile, role: str = "") -> None:
        """A LoRA that per-request use can apply: linear layers only, and not larger than the whole budget."""
        modules = target_modules(self.model)
        for name in lf.entries:
            target = modules.get(name)
            if target is None:
                raise LoRAError(f"{lf.path}: layer '{name}' is not in this model")
            if not hasattr(target.module if isinstance(target, RowView) else target, "out_features"):
                raise LoRAError(f"{role}LoRA {lf.name} adapts the convolution '{name}': per-request LoRAs apply to "
                                "linear layers only (make it the server's own set with /v1/set_lora instead)")
        if lf.nbytes > self.budget:
            raise LoRAError(f"{role}LoRA {lf.name} holds {lf.nbytes / 2 ** 20:.1f} MiB, more than the per-request LoRA "
                            f"cache's budget of {self.budget / 2 ** 20:.1f} MiB (sgld serve --lora-cache-mb)")

    def job_set(self, lora_set: Sequence[Tuple[object, float]]) -> List[Tuple[LoRAFile, float]]:
        """A job's [(path or LoRAFile, strength)] as what its rows need on top of the model's merged set (``net``),
        each LoRA read and checked; LoRAError naming the file or the strength."""
        own = [(lf if isinstance(lf, LoRAFile) else self.read(lf), _finite(s)) for lf, s in lora_set]
        mine = {id(lf) for lf, _ in own}
        out = net(own, active_loras(self.model))
        for lf, _ in out:
            self.check(lf, "" if id(lf) in mine else "the engine's active ")
        return out

    # -- a forward (its thread) ----------------------------------------------------------------------------
    def use(self, samples: Sequence[Tuple[LoRAFile, int]]) -> Dict[int, int]:
        """Make the LoRAs of one forward resident ((LoRAFile, samples it serves) for each job's each LoRA); their
        adapter keys by id(LoRAFile). Others are evicted, least recently used first, while over the budget."""
        with self._lock:
            keys, wanted, todo = {}, set(), []
            for lf, rows in samples:
                entry = self._entries.get(id(lf)) or self._add(lf, None)
                self._entries.move_to_end(id(lf))
                keys[id(lf)] = entry.key
                if id(lf) not in wanted:
                    wanted.add(id(lf))
                    self._count(lf.name, "forwards")
                    if not entry.modules:
                        entry.pinned = True  # no read() evicts it while its terms are made
                        todo.append(entry)
                self._count(lf.name, "samples", rows)
        try:
            for entry in todo:  # outside the lock: a scrape or a request's read does not wait for it
                self._install(entry)
                with self._lock:
                    self._count(entry.lf.name, "loads")
        finally:
            with self._lock:
                for entry in todo:
                    entry.pinned = False
                self._shrink(keep=wanted)
        return keys

    def _install(self, entry: _Entry) -> None:
        model, modules = self.model, target_modules(self.model)
        by_module: Dict[nn.Module, Tuple[list, list]] = {}
        for name, e in entry.lf.entries.items():
            mod, rows = side_module(modules[name])
            low_rank, krons = side_terms(model, [(e, 1.0)])
            parts, kron_list = by_module.setdefault(mod, ([], []))
            if low_rank is not None:
                parts.append((rows, *low_rank))
            kron_list += [(rows[0], rows[1], w1, w2) for w1, w2 in krons]
        try:
            for mod, (parts, kron_list) in by_module.items():
                low_rank = low_rank_of(parts, mod.out_features) if parts else None
                side = patching.state(mod).setdefault(SIDE, SidePath())
                side.row_terms[entry.key] = (low_rank, tuple(kron_list))
                entry.modules.append(mod)
                refresh_class(mod)
                entry.terms_bytes += sum(t.numel() * t.element_size() for t in (low_rank or ()))
                entry.terms_bytes += sum(w.numel() * w.element_size() for _, _, w1, w2 in kron_list for w in (w1, w2))
        except BaseException:
            self._uninstall(entry)
            raise

    def _uninstall(self, entry: _Entry) -> None:
        for mod in entry.modules:
            side = patching.feature_state(mod, SIDE)
            if side is not None:
                side.row_terms.pop(entry.key, None)
                refresh_class(mod)
        entry.modules, entry.terms_bytes = [], 0

    # -- the cache (under the lock) ------------------------------------------------------------------------
    def _add(self, lf: LoRAFile, file_key: Optional[tuple]) -> _Entry:
        entry = self._entries.get(id(lf))
        if entry is None:
            entry = self._entries[id(lf)] = _Entry(lf, self._next_key, file_key)
            self._next_key += 1
        if file_key is not None:
            self._by_file[file_key] = id(lf)
            entry.file_key = file_key
        return entry

    def _shrink(self, keep: Optional[set]) -> None:
        """Least recently used out while over the budget; resident ones only from the forward's thread (``keep``:
        this forward's LoRAs, which stay), the others' files from any (``keep`` None)."""
        total = sum(e.nbytes for e in self._entries.values())
        for ident in list(self._entries):
            if total <= self.budget:
                return
            entry = self._entries[ident]
            if entry.pinned or ((ident in keep) if keep is not None else bool(entry.modules)):
                continue
            total -= entry.nbytes
            if entry.modules:
                self._uninstall(entry)
                self._count(entry.lf.name, "evictions")
            del self._entries[ident]
            if entry.file_key is not None and self._by_file.get(entry.file_key) == ident:
                del self._by_file[entry.file_key]

    def _count(self, name: str, what: str, n: int = 1) -> None:
        counts = self.counts.setdefault(name, {"forwards": 0, "samples": 0, "loads": 0, "evictions": 0})
        counts[what] += n
        self.counts.move_to_end(name)
        while len(self.counts) > MAX_NAMES:
            self.counts.popitem(last=False)

    # -- what it holds -------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Per LoRA name: its counters and whether it is resident; the cache's bytes and budget."""
        with self._lock:
            resident = {e.lf.name for e in self._entries.values() if e.modules}
            per = {name: {**c, "resident": name in resident} for name, c in self.counts.items()}
            return {"loras": per, "bytes": sum(e.nbytes for e in self._entries.values()), "budget": self.budget,
                    "cached": len(self._entries), "resident": sum(bool(e.modules) for e in self._entries.values())}

    def describe(self) -> dict:
        m = self.metrics()
        return {k: m[k] for k in ("bytes", "budget", "cached", "resident")}

    def remove(self) -> None:
        """Every per-request term off the model (the merged set stays)."""
        with self._lock:
            for entry in self._entries.values():
                self._uninstall(entry)
            self._entries.clear()
            self._by_file.clear()


def _finite(value) -> float:
    try:
        strength = float(value)
    except (TypeError, ValueError):
        raise LoRAError(f"strength {value!r:.40} is not a number") from None
    if not math.isfinite(strength):
        raise LoRAError(f"strength {strength} is not a finite number")
    return strength


def attach_row_loras(model: nn.Module, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> RowLoRAs:
    """The model's per-request LoRA cache (made once; a second call sets its budget)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise LoRAError(f"the per-request LoRA cache's budget must be a positive number of bytes (got {budget_bytes!r})")
    rows = patching.get(model, FEATURE)
    if rows is None:
        rows = patching.attach(model, RowLoRAs(model, budget_bytes))
    rows.budget = budget_bytes
    return rows


def remove_row_loras(model: nn.Module) -> bool:
    return patching.detach(model, FEATURE)


def row_route(jobs: Sequence[Tuple[int, Dict[int, float]]], device) -> Optional[RowRoute]:
    """The route of a batch made of ``jobs`` in order ((rows, {adapter key: strength})): each adapter's rows
    (a slice when they are one run of rows, else an index) and their strengths (a float when all equal, else
    one per row, float32). None when no job has an adapter."""
    spans: Dict[int, List[Tuple[int, int, float]]] = {}
    row = 0
    for rows, adapters in jobs:
        for key, strength in (adapters or {}).items():
            spans.setdefault(key, []).append((row, row + rows, float(strength)))
        row += rows
    if not spans:
        return None
    groups = []
    for key, runs in spans.items():
        strengths = {s for _, _, s in runs}
        contiguous = all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        rows = slice(runs[0][0], runs[-1][1]) if contiguous else torch.cat(
            [torch.arange(r0, r1, device=device) for r0, r1, _ in runs])
        if len(strengths) == 1:
            strength = strengths.pop()
        else:
            strength = torch.cat([torch.full((r1 - r0,), s, device=device) for r0, r1, s in runs])
        groups.append((key, rows, strength))
    return RowRoute(row, tuple(groups))
