"""The LoRAs active on one model, attached as the "lora" Patch: a transactional apply and its rollback.

Plain weights are merged in place (float32 arithmetic, one restore record per layer, engine/features/
lora/records.py); FP8 / INT4 layers get a low-rank side path instead (a class swap, which compiled
blocks see; its tensors in ``patching.state(module)["lora"]``). Under layer-wise offload the merges
happen inside ``updating()``, into the CPU masters. All or nothing: docs/lora.md.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import LoRAError
from ...models.family import family_of
from .. import patching
from ..fuse import RowView
from ..offload import get_offload
from . import records
from .formats import LoRAEntry, LoRAFile, is_quantized, numel, target_modules, weight_shape
from .lycoris import kron_linear

log = logging.getLogger("sgld.lora")
FEATURE = "lora"


@dataclass
class SidePath:
    """``state(module)["lora"]`` of a quantized linear with a side path. ``parts``: target name -> (its
    output rows in the module, down [r, in], up [rows, r]) (a fused module has one per LoRA target in
    it); ``low_rank``: (A, B) that the forward adds as ``(x @ A^T) @ B^T``, every part's down stacked
    along the rank, each part's up in its own output rows (zeros elsewhere). ``kron_parts``: target name ->
    (its rows, [(w1, w2), ...]) of LoKr updates (and full ones, w1 = [[s]]), added as ``kron(w1, w2) x`` from the
    factors; ``krons`` those as one list for the forward. ``row_terms``: per-request LoRAs (rows.py), adapter
    key -> (low_rank or None, krons) at strength 1, added only to the rows the forward's ``RowRoute`` gives
    that adapter, times each row's strength."""

    parts: Dict[str, Tuple[Tuple[int, int], torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    low_rank: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    kron_parts: Dict[str, Tuple[Tuple[int, int], List[Tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=dict)
    krons: Tuple[Tuple[int, int, torch.Tensor, torch.Tensor], ...] = ()
    row_terms: Dict[int, tuple] = field(default_factory=dict)


@dataclass(frozen=True)
class RowRoute:
    """Which rows of the batch a forward runs on get which per-request LoRA: ``rows`` (the batch's first
    dimension) and (adapter key, its rows: a slice or an index tensor, their strength: a float or one per
    row) for each adapter."""

    rows: int
    groups: Tuple[Tuple[int, object, object], ...]


_ROUTE = threading.local()  # the route of the forward running on this thread (the server's batcher loop)


@contextlib.contextmanager
def routed(route: Optional[RowRoute]):
    """Forwards on this thread inside the block add their rows' per-request LoRAs (None: none)."""
    before = getattr(_ROUTE, "value", None)
    _ROUTE.value = route
    try:
        yield
    finally:
        _ROUTE.value = before


def _add_delta(y: torch.Tensor, d: torch.Tensor, start: int, stop: int, out_features: int) -> torch.Tensor:
    """``d`` added to output columns ``start:stop`` of ``y``, in place (``y`` is the layer's fresh output)."""
    if stop - start == out_features:
        return y.add_(d)
    y[..., start:stop] += d
    return y


def _delta(x: torch.Tensor, low_rank, krons, out_features: int, strength) -> torch.Tensor:
    """One per-request adapter's update of ``x``'s output, each row times its ``strength``."""
    def scaled(t):
        if isinstance(strength, torch.Tensor):
            return t * strength.to(t.dtype).view(-1, *([1] * (t.dim() - 1)))
        return t * strength

    d = None
    if low_rank is not None:
        down, up = low_rank
        d = F.linear(scaled(F.linear(x, down.to(x.dtype))), up.to(x.dtype))
    for start, stop, w1, w2 in krons:
        k = scaled(kron_linear(x, w1.to(x.dtype), w2.to(x.dtype)))
        d = F.pad(k, (start, out_features - stop)) if d is None else _add_delta(d, k, start, stop, out_features)
    return d


def _add_rows(y: torch.Tensor, x: torch.Tensor, side: SidePath, route: RowRoute, out_features: int) -> torch.Tensor:
    """The per-request LoRAs of ``route`` on their own rows (grouped by adapter: one pair of GEMMs each)."""
    if x.shape[0] != route.rows:
        raise RuntimeError(f"a per-request LoRA route for {route.rows} rows met a batch of {x.shape[0]}")
    for key, rows, strength in route.groups:
        terms = side.row_terms.get(key)
        if terms is None:
            continue
        d = _delta(x[rows], *terms, out_features, strength)
        if isinstance(rows, slice):
            y[rows] += d
        else:
            y.index_add_(0, rows, d)
    return y


def _with_side_path(base: type) -> type:
    """``base`` (a linear, FP8Linear / Int4Linear) whose forward adds the module's LoRA side path: the
    merged set's terms on every row, and the per-request LoRAs' on the rows the thread's route gives them."""

    def forward(self, x):
        side = patching.state(self)[FEATURE]
        y = base.forward(self, x)
        if side.low_rank is not None:
            down, up = side.low_rank
            y = y.add_(F.linear(F.linear(x, down.to(x.dtype)), up.to(x.dtype)))  # in place: no third [tokens, out] copy
        for start, stop, w1, w2 in side.krons:
            y = _add_delta(y, kron_linear(x, w1.to(x.dtype), w2.to(x.dtype)), start, stop, self.out_features)
        route = getattr(_ROUTE, "value", None)
        if route is not None and side.row_terms:
            y = _add_rows(y, x, side, route, self.out_features)
        return y

    return type(base.__name__ + "WithLoRA", (base,), {"forward": forward})


def side_module(target) -> Tuple[nn.Module, Tuple[int, int]]:
    """The module whose forward gets the side path, and the target's output rows in it (a fused part's)."""
    if isinstance(target, RowView):
        return target.module, (target.start, target.stop)
    return target, (0, target.out_features)


def low_rank_of(parts, out_features: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of several targets' ((start, stop), down, up) in one module: the downs stacked along the rank,
    each up in its own output rows of B (zeros elsewhere)."""
    a = torch.cat([pa for _, pa, _ in parts], 0)
    b = a.new_zeros(out_features, a.shape[0])
    r = 0
    for (start, stop), pa, pb in parts:
        b[start:stop, r:r + pa.shape[0]] = pb
        r += pa.shape[0]
    return a, b


def refresh_class(mod: nn.Module) -> None:
    """The side-path class while the module has any side-path terms; else its class and state as they were."""
    side = patching.state(mod)[FEATURE]
    if not side.parts and not side.kron_parts and not side.row_terms:
        patching.restore_class(mod, FEATURE)
        patching.clear_state(mod, FEATURE)
    else:
        patching.swap_class(mod, FEATURE, _with_side_path)


def _install_side(mod: nn.Module) -> None:
    """The module's side path from its parts; none left: its class and state back as they were."""
    side = patching.state(mod)[FEATURE]
    side.krons = tuple((start, stop, w1, w2) for (start, stop), terms in side.kron_parts.values() for w1, w2 in terms)
    if not side.parts:
        side.low_rank = None
        refresh_class(mod)
        return
    a, b = low_rank_of(side.parts.values(), mod.out_features)
    old = side.low_rank
    if old is not None and old[0].shape == a.shape and old[1].shape == b.shape:
        old[0].copy_(a)  # same shapes: in place (no new graph under torch.compile)
        old[1].copy_(b)
    else:
        side.low_rank = (a, b)
    refresh_class(mod)


def compute_device(model: nn.Module) -> torch.device:
    """The device the blocks compute on (offload: its device, not the CPU masters)."""
    off = get_offload(model)
    if off is not None:
        return torch.device(off.device)
    return family_of(model).device_of(model)  # else where its weights outside the blocks are


def side_terms(model: nn.Module, items, device=None) -> tuple:
    """One target's side-path terms for [(entry, strength)], on the compute device (or ``device``: "meta" for
    what they would cost) in the model's dtype: (down [r, in], up [out, r]) or None, and [(w1, w2), ...] of the
    Kronecker (and full) updates."""
    dev = torch.device(device) if device is not None else compute_device(model)
    dtype = model.dtype if hasattr(model, "dtype") else torch.float32
    downs, ups, krons = [], [], []
    for e, s in items:
        if e.diff is not None:  # a full difference: kron([[s]], dW)
            krons.append((torch.full((1, 1), s * e.scale, device=dev, dtype=dtype),
                          e.diff.reshape(e.diff.shape[0], -1).to(dev, dtype)))
            continue
        if e.lycoris is None:
            downs.append(e.down.float().flatten(1))
            ups.append(e.up.float().flatten(1) * (s * e.scale))
            continue
        for kind, t1, t2 in e.lycoris.side_terms(dev, s * e.scale):
            if kind == "low_rank":
                downs.append(t1)
                ups.append(t2)
            else:
                krons.append((t1.to(dev, dtype), t2.to(dev, dtype)))
    low_rank = None
    if downs:
        low_rank = (torch.cat([d.to(dev) for d in downs], 0).to(dtype), torch.cat([u.to(dev) for u in ups], 1).to(dtype))
    return low_rank, krons


class LoRAState(patching.Patch):
    """The LoRAs applied to one model, and what restores the layers they touch exactly.

    ``apply`` is transactional: a layer's restore record (``backups``) or side-path record (``side_paths``)
    exists before the layer changes, so these two always name every layer that may differ from the base;
    any exception (a bad LoRA, out of memory, KeyboardInterrupt) restores the base bit-exactly before it
    propagates, and the state is then "no LoRA" (``applied == ()``). ``applied`` is None while a change is
    under way."""

    name = FEATURE

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.backups: Dict[str, object] = {}  # target name -> UlpDiff or original weight (CPU)
        self.side_paths: Dict[str, nn.Module] = {}  # target name -> the quantized module carrying its side path
        self.applied: Optional[Tuple] = ()  # ((LoRAFile, strength), ...); None while changing
        self.last_seconds = 0.0

    @property
    def backup_bytes(self) -> int:
        return sum(records.record_bytes(r) for r in self.backups.values())

    def describe(self) -> dict:
        applied = self.applied or ()
        return {"files": [lf.path for lf, _ in applied], "strengths": [s for _, s in applied],
                "layers_merged": len(self.backups), "side_paths": len(self.side_paths), "bytes_kept": self.backup_bytes}

    def remove(self) -> None:
        """Every touched layer back to the base bit-exactly, every side path gone."""
        model = self.model
        if model is not None:
            with self._updating():
                self._rollback(target_modules(model))

    def _updating(self):
        off = get_offload(self.model)
        return off.updating() if off is not None else contextlib.nullcontext()

    def _plan(self, loras, modules) -> Dict[str, List[Tuple[LoRAEntry, float]]]:
        """module name -> [(entry, strength)], checked against the model (nothing is changed here)."""
        plan: Dict[str, List[Tuple[LoRAEntry, float]]] = {}
        for lf, strength in loras:
            if float(strength) == 0.0:
                continue
            for name, e in lf.entries.items():
                if name not in modules:
                    raise LoRAError(f"{lf.path}: layer '{name}' is not in this model")
                mod = modules[name]
                wshape = weight_shape(mod)
                if e.lycoris is not None:
                    got = [e.lycoris.out_features, e.lycoris.in_flat]
                else:
                    got = [e.diff.numel()] if e.diff is not None else [int(e.up.shape[0]), numel(e.down.shape[1:])]
                want = [numel(wshape)] if e.diff is not None else [wshape[0], numel(wshape[1:])]
                if got != want:
                    raise LoRAError(f"{lf.path}: the update of layer '{name}' is {got} but the layer's weight is "
                                    f"{tuple(wshape)}: this LoRA was read against a model of another size")
                plan.setdefault(name, []).append((e, float(strength)))
        return plan

    @torch.no_grad()
    def apply(self, loras: Sequence[Tuple[LoRAFile, float]]) -> None:
        """Make exactly ``loras`` (with their strengths) active; ``[]`` restores the base bit-exactly.
        All or nothing: on any exception the base is restored (then ``applied == ()``) and it propagates."""
        t0 = time.perf_counter()
        modules = target_modules(self.model)
        plan = self._plan(loras, modules)
        compact_ok = records.restore_mode() == "compact"
        self.applied = None
        try:
            with self._updating():
                self._change(plan, modules, compact_ok)
            self.applied = tuple((lf, float(s)) for lf, s in loras)
        except BaseException:
            with self._updating():  # offload: the layer buffers are refilled with the restored masters
                self._rollback(modules)
            raise
        self.last_seconds = time.perf_counter() - t0

    def _change(self, plan, modules, compact_ok: bool) -> None:
        def compact(name: str) -> bool:
            return compact_ok and modules[name].weight.element_size() == 2

        # 1. back to the original: every layer with a compact record, and copied layers no longer touched
        #    (or to be recorded compactly now); a record is dropped only once its layer is restored
        for name in list(self.backups):
            rec = self.backups[name]
            if isinstance(rec, records.UlpDiff):
                records.restore(modules[name].weight, rec)
                del self.backups[name]
            elif name not in plan or compact(name):
                modules[name].weight.copy_(rec)
                del self.backups[name]
        for name in [n for n in self.side_paths if n not in plan or not is_quantized(modules[n])]:
            self._remove_side(name, modules[name])
        # 2. touched layers: merged in float32, or a side path when quantized; the record first
        for name, items in plan.items():
            mod = modules[name]
            if is_quantized(mod):
                self._set_side(name, mod, items)
                continue
            w = mod.weight
            if compact(name):
                rec = self.backups[name] = records.UlpDiff(w.numel(), w.dtype)
                records.merge(w, w, items, rec)
            else:
                if name not in self.backups:
                    self.backups[name] = w.detach().to("cpu", copy=True)
                records.merge(w, self.backups[name], items)

    def _rollback(self, modules) -> None:
        """Every touched layer back to the base (whatever point a merge or restore had reached), records dropped."""
        for name in list(self.backups):
            rec = self.backups[name]
            if isinstance(rec, records.UlpDiff):
                records.restore(modules[name].weight, rec)
            else:
                modules[name].weight.copy_(rec)
            del self.backups[name]
        for name in list(self.side_paths):
            self._remove_side(name, modules[name])
        self.applied = ()

    def _set_side(self, name: str, target, items) -> None:
        mod, rows = side_module(target)
        low_rank, krons = side_terms(self.model, items)
        self.side_paths[name] = mod  # recorded before the module changes
        side = patching.state(mod).setdefault(FEATURE, SidePath())
        side.parts.pop(name, None)  # this target's terms from an earlier set are replaced
        side.kron_parts.pop(name, None)
        if low_rank is not None:
            side.parts[name] = (rows, *low_rank)
        if krons:
            side.kron_parts[name] = (rows, krons)
        _install_side(mod)

    def _remove_side(self, name: str, target) -> None:
        mod, _ = side_module(target)
        side = patching.feature_state(mod, FEATURE)
        if side is not None:
            side.parts.pop(name, None)
            side.kron_parts.pop(name, None)
            _install_side(mod)
        self.side_paths.pop(name, None)  # forgotten only once the module is back


def _key(loras) -> tuple:
    return tuple((id(lf), float(s)) for lf, s in loras)


def apply_loras(model: nn.Module, loras: Sequence[Tuple[LoRAFile, float]]) -> List[str]:
    """Make exactly ``loras`` [(LoRAFile read against this model, strength), ...] active on ``model``;
    ``[]`` restores the base bit-exactly and detaches the "lora" Patch. The same list again does nothing.
    Returns the report (messages about keys that were not applied)."""
    loras = [(lf, float(s)) for lf, s in loras]
    st = patching.get(model, FEATURE)
    if st is None:
        if not loras:
            return []
        st = patching.attach(model, LoRAState(model))
    if st.applied is None or _key(loras) != _key(st.applied):
        try:
            st.apply(loras)
        finally:
            if st.applied == ():  # the base (asked for, or rolled back to): nothing stays attached
                patching.detach(model, FEATURE)
        log.info("LoRA: %s in %.2f s (%d layers merged, %d side paths, %.1f MiB of original weights kept)",
                 ", ".join(f"{lf.name} x{s:g}" for lf, s in loras) or "base restored", st.last_seconds,
                 len(st.backups), len(st.side_paths), st.backup_bytes / 2 ** 20)
    return [m for lf, _ in loras for m in lf.report()]


def active_loras(model: nn.Module) -> List[Tuple[LoRAFile, float]]:
    """[(LoRAFile, strength), ...] active on ``model`` now ([] for the base)."""
    st = patching.get(model, FEATURE)
    return list(st.applied or ()) if st is not None else []


def remove_loras(model: nn.Module) -> bool:
    """Back to the base bit-exactly. False when no LoRA was attached."""
    return patching.detach(model, FEATURE)
