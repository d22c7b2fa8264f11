"""Per-request LoRAs: several LoRA sets in one batched forward, each on its own rows, the base weights untouched
(what S-LoRA and Punica do for language models), through the "lora" side path of state.py (one class swap).

``RowLoRAs`` (the "lora_rows" Patch) is a cache of LoRA files read against the model under a byte budget, least
recently used out. A LoRA is an ``CachedLoRA``: what identifies its file (formats.file_key: a file replaced is another
LoRA), what it costs resident (its tensors and side-path terms, known from the header before any data is read),
and, while cached, its data. A job holds entries, not data: an evicted entry drops its data and is read again
when a forward needs it, so the memory is the budget plus the LoRAs of the running forward, however many jobs
wait. A file is read once however many requests name it at once (the others wait for that read).

The files a forward needs are made resident (``use``): their side-path terms at strength 1, on the compute
device, sit in ``SidePath.row_terms`` of every module they adapt, and that module's forward adds them to the rows
the thread's ``RowRoute`` gives each adapter (``routed``), times each row's strength: one pair of GEMMs per adapter
and module, over all rows that use it. A LoRA that cannot be made ready fails the jobs that named it, not the
forward's others.

What a job's rows get is its set minus the model's merged set (``net``, by file identity): a job that asks for
nothing new gets no terms (the merged weights are its set), a job with its own set gets its LoRAs and the merged
ones with the opposite strength.
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
from .formats import LoRAFile, file_key, read_lora, target_modules
from .state import FEATURE as SIDE
from .state import RowRoute, SidePath, active_loras, low_rank_of, refresh_class, side_module, side_terms

FEATURE = "lora_rows"
DEFAULT_BUDGET_BYTES = 2 << 30
MAX_NAMES = 256  # LoRA names the per-LoRA counters remember (the metrics' label values)
MAX_ENTRIES = 256  # entries kept without data (a file's identity and costs) once the budget's are counted


def identity(lf: LoRAFile) -> tuple:
    """What makes two LoRAs one: the file read (formats.file_key), or the object for one held in memory."""
    return lf.file_key if lf.file_key is not None else ("memory", id(lf))


def _size(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CachedLoRA:
    """One LoRA of the cache: its identity and costs, and its data (``lf``) while cached."""

    def __init__(self, key: int, ident: tuple, source, head: LoRAFile, terms_cost: int, convs: List[str]):
        self.key, self.ident = key, ident  # the adapter key of its row terms; identity()
        self.source = source  # its path (read again after an eviction), or the LoRAFile held in memory
        self.name, self.convs = head.name, convs  # the convolutions it adapts (per-request use refuses them)
        self.file_cost, self.terms_cost = head.nbytes, terms_cost  # predicted from the header
        self.lf: Optional[LoRAFile] = source if isinstance(source, LoRAFile) else None
        self.loading = False  # a thread reads it now; others wait for that read
        self.error: Optional[LoRAError] = None  # why the last read failed
        self.modules: List[nn.Module] = []  # the modules holding its row terms (resident) or []
        self.terms_bytes = 0
        self.pinned = False  # its terms are being made (the forward's thread): not evicted meanwhile

    @property
    def cost(self) -> int:
        return self.file_cost + self.terms_cost

    @property
    def reloadable(self) -> bool:
        return not isinstance(self.source, LoRAFile)


def net(own: Optional[Sequence[Tuple[object, float]]], merged: Sequence[Tuple[object, float]], key=id) -> list:
    """[(LoRA, strength)] a job's rows need on top of the merged set: ``own`` (None: the merged set itself,
    nothing to add) minus ``merged``, LoRAs compared by ``key``; zero strengths dropped."""
    if own is None:
        return []
    out: Dict[object, list] = {}
    for lora, s in own:
        out.setdefault(key(lora), [lora, 0.0])[1] += float(s)
    for lora, s in merged:
        out.setdefault(key(lora), [lora, 0.0])[1] -= float(s)
    return [(lora, s) for lora, s in out.values() if s != 0.0]


class RowLoRAs(patching.Patch):
    """The per-request LoRAs of one model: named and read (any thread), made resident per forward (the forward's
    thread)."""

    name = FEATURE

    def __init__(self, model: nn.Module, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        super().__init__(model)
        self.budget = int(budget_bytes)
        self._cv = threading.Condition()
        self._entries: "OrderedDict[tuple, CachedLoRA]" = OrderedDict()  # identity -> entry, most recent last
        self._next_key = 0
        self.counts: "OrderedDict[str, Dict[str, int]]" = OrderedDict()  # LoRA name -> its counters
        meta = torch.empty(1, device="meta")  # torch's meta kernels of cat load on first use (seconds): here, at
        torch.cat([meta, meta])  # the server's start, not in the first request that names a LoRA

    # -- naming and reading (request threads) --------------------------------------------------------------
    def entry(self, source) -> CachedLoRA:
        """The cache's entry of a LoRA (a path: made from its header if new, no data read; a LoRAFile: held as
        it is); LoRAError naming the file and what is wrong."""
        ident = identity(source) if isinstance(source, LoRAFile) else file_key(source)
        with self._cv:
            found = self._entries.get(ident)
            if found is not None:
                if isinstance(source, LoRAFile) and found.lf is None and not found.loading:
                    found.lf = source  # the same file's data, held anyway (the merged set)
                self._entries.move_to_end(ident)
                return found
        head = source if isinstance(source, LoRAFile) else read_lora(source, self.model, header_only=True)
        modules = target_modules(self.model)
        convs = [n for n in head.entries if not hasattr(getattr(modules[n], "module", modules[n]), "out_features")]
        terms = 0 if convs else sum(_nbytes(lr or ()) + _nbytes(w for _, _, w1, w2 in kr for w in (w1, w2))
                                    for lr, kr in self._terms(head, "meta").values())
        with self._cv:
            found = self._entries.get(ident)
            if found is None:
                found = self._entries[ident] = CachedLoRA(self._next_key, ident, source, head, terms, convs)
                self._next_key += 1
            self._shrink(keep=None)
            return found

    def load(self, entry: CachedLoRA) -> LoRAFile:
        """The entry's data, read once however many threads ask at once (the others wait for that read and
        share its outcome); LoRAError naming the file, also for a file replaced since it was named."""
        with self._cv:
            entry = self._entries.setdefault(entry.ident, entry)  # an evicted one comes back (or its successor)
            if entry.loading:
                while entry.loading:
                    self._cv.wait()
                if entry.lf is None:
                    raise entry.error or LoRAError(f"{entry.name}: the LoRA could not be read")
            if entry.lf is not None:
                self._entries.move_to_end(entry.ident)
                return entry.lf
            entry.loading, entry.error = True, None
        lf = None
        try:
            lf = read_lora(entry.source, self.model)
            if lf.file_key != entry.ident:
                lf = None
                raise LoRAError(f"{entry.name}: the file was replaced after the request named it; name it again")
        except LoRAError as e:
            entry.error = e
            raise
        finally:
            with self._cv:
                entry.loading, entry.lf = False, lf
                self._cv.notify_all()
                self._shrink(keep=None)
        return lf

    def read(self, path) -> LoRAFile:
        """The LoRA at ``path`` read against the model, from the cache while the file is unchanged (the server's
        merged set: requests naming that file then get this very object)."""
        return self.load(self.entry(path))

    def adopt(self, lf: LoRAFile) -> None:
        """Cache ``lf`` (a LoRA merged before this cache existed: ``sgld serve --lora``) so that requests naming its
        file get this very object while the file is unchanged."""
        if lf.file_key is not None:
            self.entry(lf).source = lf.path  # a file: read again if ever evicted

    def check(self, entry: CachedLoRA, role: str = "") -> None:
        """A LoRA that per-request use can apply: linear layers only, and its file and resident terms together
        within the whole budget (both known from its header)."""
        if entry.convs:
            raise LoRAError(f"{role}LoRA {entry.name} adapts the convolution '{entry.convs[0]}': per-request LoRAs apply "
                            "to linear layers only (make it the server's own set with /v1/set_lora instead)")
        if entry.cost > self.budget:
            raise LoRAError(f"{role}LoRA {entry.name} needs {_size(entry.cost)} resident (its file "
                            f"{_size(entry.file_cost)} and its side-path terms {_size(entry.terms_cost)}), more than the "
                            f"per-request LoRA cache's budget of {_size(self.budget)} (sgld serve --lora-cache-mb)")

    def named(self, lora_set: Sequence[Tuple[object, float]]) -> List[Tuple[CachedLoRA, float]]:
        """A job's [(path, LoRAFile or CachedLoRA, strength)] as entries, each file once (aliases of one file: a
        link, another spelling of its path, are one); LoRAError naming the file or the strength."""
        own, seen = [], {}
        for source, s in lora_set:
            entry, s = (source if isinstance(source, CachedLoRA) else self.entry(source)), _finite(s)
            given = getattr(source, "path", None) or getattr(source, "name", source)
            if entry.ident in seen:
                raise LoRAError(f"LoRA {entry.name} is named twice ('{seen[entry.ident]}' and '{given}' are one file): "
                                "give each LoRA once, with the strength wanted")
            seen[entry.ident] = given
            own.append((entry, s))
        return own

    def job_set(self, lora_set: Sequence[Tuple[object, float]], read: bool = True) -> List[Tuple[CachedLoRA, float]]:
        """What a job's rows need on top of the model's merged set (``net``, by file identity), from its
        [(path, LoRAFile or CachedLoRA, strength)]: each checked from its header and, with ``read``, read now
        (one read, shared and cached: a bad file is refused before the job is queued); LoRAError naming the file."""
        own = self.named(lora_set)
        mine = {e.ident for e, _ in own}
        out = net(own, [(self.entry(lf), s) for lf, s in active_loras(self.model)], key=lambda e: e.ident)
        for entry, _ in out:
            self.check(entry, "" if entry.ident in mine else "the engine's active ")
        for entry, _ in out if read else ():
            self.load(entry)
        return out

    # -- a forward (its thread) ----------------------------------------------------------------------------
    def use(self, samples: Sequence[Tuple[CachedLoRA, int]]) -> Tuple[Dict[tuple, int], Dict[tuple, BaseException]]:
        """Make the LoRAs of one forward resident ((entry, samples it serves) for each job's each LoRA): ({identity:
        adapter key} of those made ready, {identity: error} of those that could not be (read again, terms made):
        the jobs naming them fail, the others run). Others are evicted, least recently used first, while over
        the budget."""
        entries: Dict[tuple, CachedLoRA] = {}
        rows: Dict[tuple, int] = {}
        with self._cv:
            for entry, n in samples:  # pinned first: no other thread's read evicts them meanwhile
                entry = entries.setdefault(entry.ident, self._entries.setdefault(entry.ident, entry))
                entry.pinned = True
                rows[entry.ident] = rows.get(entry.ident, 0) + n
            coming = sum(e.terms_cost + (0 if e.lf is not None else e.file_cost) for e in entries.values() if not e.modules)
            self._shrink(keep=set(entries), coming=coming)  # the last forward's out before this one's come in
        ready, failed = {}, {}
        try:
            for ident, entry in entries.items():
                try:
                    self.load(entry)
                    if not entry.modules:  # outside the lock: a scrape or a request's read does not wait for it
                        self._install(entry)
                        with self._cv:
                            self._count(entry.name, "loads")
                except (LoRAError, RuntimeError, MemoryError) as e:  # this LoRA's jobs fail, not the forward
                    failed[ident] = e
                    continue
                ready[ident] = entry.key
                with self._cv:
                    self._entries.move_to_end(ident)
                    self._count(entry.name, "forwards")
                    self._count(entry.name, "samples", rows[ident])
        finally:
            with self._cv:
                for entry in entries.values():
                    entry.pinned = False
                self._shrink(keep=set(ready))
        return ready, failed

    def _terms(self, lf: LoRAFile, device=None) -> Dict[nn.Module, tuple]:
        """Module -> (low_rank or None, krons) of ``lf`` at strength 1, on the compute device (``device``)."""
        modules = target_modules(self.model)
        by_module: Dict[nn.Module, Tuple[list, list]] = {}
        for name, e in lf.entries.items():
            mod, rows = side_module(modules[name])
            low_rank, krons = side_terms(self.model, [(e, 1.0)], device)
            parts, kron_list = by_module.setdefault(mod, ([], []))
            if low_rank is not None:
                parts.append((rows, *low_rank))
            kron_list += [(rows[0], rows[1], w1, w2) for w1, w2 in krons]
        return {mod: (low_rank_of(parts, mod.out_features) if parts else None, tuple(krons))
                for mod, (parts, krons) in by_module.items()}

    def _install(self, entry: CachedLoRA) -> None:
        try:
            for mod, (low_rank, krons) in self._terms(entry.lf).items():
                side = patching.state(mod).setdefault(SIDE, SidePath())
                side.row_terms[entry.key] = (low_rank, krons)
                entry.modules.append(mod)
                refresh_class(mod)
                entry.terms_bytes += _nbytes(low_rank or ()) + _nbytes(w for _, _, w1, w2 in krons for w in (w1, w2))
        except BaseException:
            self._uninstall(entry)
            raise

    def _uninstall(self, entry: CachedLoRA) -> None:
        for mod in entry.modules:
            side = patching.feature_state(mod, SIDE)
            if side is not None:
                side.row_terms.pop(entry.key, None)
                refresh_class(mod)
        entry.modules, entry.terms_bytes = [], 0

    # -- the cache (under the lock) ------------------------------------------------------------------------
    def _counted(self, entry: CachedLoRA, merged: set) -> int:
        """Its bytes against the budget: resident terms, and its data unless the merged set holds it anyway."""
        held = entry.lf is not None and entry.ident not in merged
        return entry.terms_bytes + (entry.lf.nbytes if held else 0)

    def _shrink(self, keep: Optional[set], coming: int = 0) -> None:
        """Least recently used out while over the budget (less ``coming``: bytes about to be added): resident terms
        only from the forward's thread (``keep``: this forward's LoRAs, which stay), data from any (``keep`` None);
        the merged set's data stays (the weights hold it). Then entries without data past MAX_ENTRIES go."""
        merged = {identity(lf) for lf, _ in active_loras(self.model)}
        total = sum(self._counted(e, merged) for e in self._entries.values()) + coming
        for ident in list(self._entries):
            if total <= self.budget:
                break
            entry = self._entries[ident]
            if entry.pinned or entry.loading or ident in merged or (ident in keep if keep is not None else entry.modules):
                continue
            total -= self._counted(entry, merged)
            if entry.modules:
                self._uninstall(entry)
                self._count(entry.name, "evictions")
            if entry.reloadable:
                entry.lf = None
            del self._entries[ident]
        idle = [i for i, e in self._entries.items() if e.lf is None and not e.loading and not e.pinned]
        for ident in idle[:max(0, len(self._entries) - MAX_ENTRIES)]:
            del self._entries[ident]

    def _count(self, name: str, what: str, n: int = 1) -> None:
        counts = self.counts.setdefault(name, {"forwards": 0, "samples": 0, "loads": 0, "evictions": 0})
        counts[what] += n
        self.counts.move_to_end(name)
        while len(self.counts) > MAX_NAMES:
            self.counts.popitem(last=False)

    # -- what it holds -------------------------------------------------------------------------------------
    def device_bytes(self, entries: Sequence[CachedLoRA] = ()) -> int:
        """The compute device's bytes of per-request LoRA terms: those resident now, and the predicted terms of
        ``entries`` not resident yet (what the batcher's admission by bytes adds to the activations)."""
        with self._cv:
            resident = {i: e.terms_bytes for i, e in self._entries.items() if e.modules}
            more = {e.ident: e.terms_cost for e in entries if e.ident not in resident}
            return sum(resident.values()) + sum(more.values())

    def metrics(self) -> dict:
        """Per LoRA name: its counters and whether it is resident; the cache's bytes and budget."""
        with self._cv:
            merged = {identity(lf) for lf, _ in active_loras(self.model)}
            resident = {e.name for e in self._entries.values() if e.modules}
            per = {name: {**c, "resident": name in resident} for name, c in self.counts.items()}
            return {"loras": per, "bytes": sum(self._counted(e, merged) for e in self._entries.values()),
                    "budget": self.budget, "cached": sum(e.lf is not None for e in self._entries.values()),
                    "resident": sum(bool(e.modules) for e in self._entries.values())}

    def describe(self) -> dict:
        m = self.metrics()
        return {k: m[k] for k in ("bytes", "budget", "cached", "resident")}

    def remove(self) -> None:
        """Every per-request term off the model (the merged set stays)."""
        with self._cv:
            for entry in self._entries.values():
                self._uninstall(entry)
            self._entries.clear()


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
