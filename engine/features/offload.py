"""Layer-wise offload: the DiT blocks' weights live in (pinned) CPU memory and stream through a few
device buffers, one block ahead of compute, so the 8B model (15.3 GiB in bf16) runs on an 8 GB GPU:
on the device, the non-block 0.34 GiB + 2 x 0.41 GiB block buffers (bf16; fp8 blocks 0.20 GiB), plus
activations.

Layout
  * Non-block weights (embedders, modulation, final layer: ~2% of the model) move to the device for good.
  * Each block ``model.layers[i]`` gets one flat CPU byte buffer (its *master*; pinned when the compute
    device is a CUDA GPU) holding its parameters back to back (256-byte aligned); quantized layers
    (engine/features/quant.py) keep their quantized bytes. The model keeps its classes, names and state_dict.
  * ``resident_layers`` device buffers (*slots*, default 2) of one block's size. Loading block i is ONE
    host-to-device copy of its master on a copy stream; offloading it is only pointing its parameters
    back at the master. With more than two slots, blocks ``0 .. resident_layers - 3`` stay loaded (blocks
    run cyclically: anything evicted would reload every forward; Cache-DiT always computes the first
    blocks) and two slots stream the rest; with a slot per block nothing streams after the first forward.

Order (CUDA streams and events; no-ops on the CPU, where the same code runs)
  * load(i -> slot): the copy stream waits for the slot's ``free`` event, copies, records ``ready``.
  * acquire(i), just before block i runs: compute waits for ``ready``, the parameters point at the
    slot, the next planned blocks are prefetched into the other slots.
  * release(i), once block i's kernels are queued: ``free`` is recorded on the compute stream and the
    parameters point back at the master.
  Compute never reads a slot being written, a slot is never overwritten while queued kernels read it;
  slots keep their addresses (no ``record_stream``), a fresh slot's first copy waits for the compute
  work queued before its allocation. tests/test_offload.py checks the schedule for races.

Which blocks: each block's class becomes a subclass whose ``__call__`` does acquire ->
``nn.Module.__call__`` -> release (outside regional torch.compile's ``_call_impl``, and
``torch.compiler.disable``: graphs never contain transfers), so any caller gets correct weights, loaded
on demand if not prefetched. ``model.layers`` becomes a ``ModuleList`` whose iteration (also of a slice)
announces the blocks about to run; prefetch follows only announced blocks, so a Cache-DiT-skipped middle
is never transferred (``plan_blocks`` for runners that index blocks). ``prefetch_first``: after the last
block, block 0 (which every runner runs first) is prefetched for the next forward.

Parameters: the offloader replaces every block parameter (and every non-block one it moves, or that is
an inference tensor) by a new normal Parameter made outside inference mode, and re-points only those.
A model loaded under ``torch.inference_mode`` (ComfyUI) has inference-tensor Parameters, which cannot be
re-pointed at normal buffers (see ``_renew_parameters``); masters, slots and views are normal tensors,
so runs under inference mode and ``no_grad`` can alternate.

Between blocks and model calls every block parameter points at its master: LoRA merges, ``state_dict``
and saving see the masters. Change block weights in place inside ``with offload.updating():`` (or call
``invalidate()``) so stale slots are refilled. ``release_buffers()`` frees the slots (allocated again at
the next forward). ``remove()`` undoes the offload: every block parameter gets its own pageable CPU
tensor, slots and masters are freed at once. The model owns the offloader, which refers to it weakly:
dropping the model (an Engine) frees everything by reference counting. Never ``model.to(device)`` an
offloaded model (it would move the masters).

``choose_offload`` implements ``EngineConfig(offload="auto")``: layer-wise when the free memory of the
CUDA device is below the model's bytes plus the working memory (activations, other models).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
import weakref
from collections import deque
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

log = logging.getLogger("sgld.offload")

MODES = ("none", "layerwise", "auto")
ALIGN = 256  # bytes: every parameter view starts on a 256-byte boundary (kernels, inductor alignment)
GiB = 2 ** 30
# Working memory that "auto" keeps free besides the weights: activations of a 1024^2 CFG batch of the
# 8B model (~1-2 GiB with memory-efficient attention), the CUDA context and the allocator's slack.
# Override with SGLD_OFFLOAD_WORKING_GB.
MIN_WORKING_BYTES = 2 * GiB
WORKING_FRACTION = 0.15


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- auto ---------------------------------------------------------------------------------------------------
def working_bytes(model_bytes: int) -> int:
    env = os.environ.get("SGLD_OFFLOAD_WORKING_GB")
    if env:
        return int(float(env) * GiB)
    return max(MIN_WORKING_BYTES, int(WORKING_FRACTION * model_bytes))


def choose_offload(mode, device, model_bytes: int, free_bytes: Optional[int] = None,
                   resident_bytes: int = 0) -> Tuple[str, str]:
    """("none" | "layerwise", why). ``auto``: layer-wise when the device's free memory (plus what the
    model already holds there, ``resident_bytes``) is below ``model_bytes`` + working memory.
    ``free_bytes`` defaults to ``torch.cuda.mem_get_info``; CPU devices never offload on ``auto``."""
    if mode not in MODES:  # EngineConfig normalizes the spellings (engine/config.py)
        raise ValueError(f"offload '{mode}' is not supported; choose one of {', '.join(MODES)}")
    if mode != "auto":
        return mode, ("requested" if mode == "layerwise" else "")
    choice, why = _choose_auto(device, model_bytes, free_bytes, resident_bytes)
    log.info("offload %s", why)
    return choice, why


def _choose_auto(device, model_bytes: int, free_bytes: Optional[int], resident_bytes: int) -> Tuple[str, str]:
    dev = torch.device(device)
    if free_bytes is None:
        if dev.type != "cuda" or not torch.cuda.is_available():
            return "none", f"auto: {dev} is not a CUDA GPU, nothing to offload"
        free_bytes, _ = torch.cuda.mem_get_info(dev)
    available = int(free_bytes) + int(resident_bytes)
    need = int(model_bytes) + working_bytes(model_bytes)
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    if available < need:
        return "layerwise", f"auto: {gib(available)} free on {dev} < model {gib(model_bytes)} + working {gib(need - model_bytes)}"
    return "none", f"auto: {gib(available)} free on {dev} >= model {gib(model_bytes)} + working {gib(need - model_bytes)}"


def estimate_checkpoint_bytes(path: str, dtype=None, quant: Optional[str] = None) -> int:
    """Bytes the model will take at rest once loaded (headers only, nothing is read)."""
    from ..io.checkpoint import Checkpoint, parse_dtype
    from . import quant as Q

    ckpt = Checkpoint(path)
    target = parse_dtype(dtype) or ckpt.stored_dtype()
    kind, group = Q.parse_format(quant)
    total = 0
    for k, (f, fk) in ckpt.index.items():
        src = f.dtype(fk)
        numel = 1
        for d in f.shape(fk):
            numel *= d
        layer = k.rsplit(".", 1)[0]
        if kind and k.endswith(".weight") and Q.is_block_linear(layer):
            total += numel if kind == "fp8" else numel // 2 + numel * 4 // max(1, group)
        elif src.is_floating_point and src.itemsize >= 2:
            total += numel * target.itemsize
        else:  # quantized storage (fp8 / packed int4) stays as stored
            total += numel * src.itemsize
    return total


# -- stream / event helpers: no-ops off CUDA ------------------------------------------------------------------
class _Streams:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.copy = torch.cuda.Stream(device) if self.cuda else None

    def event(self):
        return torch.cuda.Event() if self.cuda else None

    def compute(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def on_copy(self):
        """Context: work issued inside runs on the copy stream."""
        return torch.cuda.stream(self.copy) if self.cuda else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.cuda:
            self.copy.synchronize()
            torch.cuda.current_stream(self.device).synchronize()


class _Slot:
    __slots__ = ("index", "buf", "block", "ready", "free", "free_recorded", "busy", "used")

    def __init__(self, index: int):
        self.index = index
        self.buf: Optional[torch.Tensor] = None
        self.block: Optional[int] = None  # the block whose bytes it holds (or is receiving)
        self.ready = None  # event: copy done (copy stream)
        self.free = None  # event: last compute reading it done (compute stream)
        self.free_recorded = False
        self.busy = False  # a block bound to it is between acquire and release
        self.used = 0  # acquire counter, for least-recently-used eviction


def _renew_parameters(modules: Iterable[nn.Module], make) -> None:
    """Replace each parameter ``p`` of ``modules`` (their own, shared ones once) for which ``make(p)``
    returns a tensor by a new Parameter around it, made outside inference mode. Why not ``p.data = t``:
    a Parameter created under ``torch.inference_mode`` (a model loaded by a ComfyUI node) is an
    inference tensor; re-pointing its ``.data`` at a normal tensor makes it look normal but leaves it
    without a version counter, and its next view (``F.linear``'s ``weight.t()``) raises "Inference
    tensors do not track version counter"."""
    new: Dict[int, Optional[nn.Parameter]] = {}
    keep = []  # the old parameters, alive until the end: no new object may take the id of one meanwhile
    with torch.inference_mode(False):
        for m in modules:
            for name, p in list(m._parameters.items()):
                if p is None:
                    continue
                if id(p) not in new:
                    keep.append(p)
                    data = make(p)
                    new[id(p)] = None if data is None else nn.Parameter(data, requires_grad=p.requires_grad)
                if new[id(p)] is not None:
                    m._parameters[name] = new[id(p)]


class _BlockStore:
    """One block's parameters packed into a flat CPU byte buffer, and their views."""

    def __init__(self, index: int, block: nn.Module, pin: bool):
        self.index = index
        old = list(block.parameters())  # shared parameters once
        layout, offset = [], 0  # (dtype, shape, byte offset, bytes) per parameter
        for p in old:
            layout.append((p.dtype, p.shape, offset, _nbytes(p)))
            offset = _align(offset + _nbytes(p))
        self.nbytes = max(offset, ALIGN)
        with torch.inference_mode(False):  # normal tensors even when applied under inference mode (ComfyUI)
            self.master = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
            for p, (_, _, off, n) in zip(old, layout):
                if n:
                    self.master[off:off + n].copy_(p.detach().contiguous().reshape(-1).view(torch.uint8))
        self._layout = layout
        self.layout = tuple((dtype, tuple(shape), off) for dtype, shape, off, _ in layout)
        self.master_views = [self._views(self.master)]  # kept: pointing back costs no allocation
        # new (normal) Parameters on the master views; the block's old weights are freed
        views = {id(p): v for p, v in zip(old, self.master_views[0])}
        _renew_parameters(block.modules(), lambda p: views[id(p)])
        self.params: List[nn.Parameter] = list(block.parameters())  # in the order of ``old``

    def _views(self, buf: torch.Tensor) -> List[torch.Tensor]:
        with torch.inference_mode(False):
            return [buf[off:off + n].view(dtype).view(shape) for dtype, shape, off, n in self._layout]

    def bind(self, views: Sequence[torch.Tensor]) -> None:
        for p, v in zip(self.params, views):
            p.data = v

    def bind_master(self) -> None:
        self.bind(self.master_views[0])

    def unpack(self) -> None:
        """For ``remove()``: every parameter gets its own pageable CPU tensor; the master is dropped."""
        with torch.inference_mode(False):
            for p, v in zip(self.params, self.master_views[0]):
                p.data = torch.empty(v.shape, dtype=v.dtype).copy_(v)
        self.params, self.master, self.master_views = [], None, []


class _PlannedLayers(nn.ModuleList):
    """``model.layers`` under offload: iterating it (or a slice of it) announces the blocks that are
    about to run, so the offloader prefetches exactly those."""

    def __iter__(self):
        blocks = list(self._modules.values())
        off = getattr(blocks[0], "_sgld_offload", None) if blocks else None
        if off is None:
            return iter(blocks)
        return off._iterate(blocks)


_CLASSES: Dict[type, type] = {}


def _offloaded_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        def __call__(self, *args, **kwargs):
            off = self._sgld_offload
            i = self._sgld_offload_index
            off.acquire(i)
            try:
                return base.__call__(self, *args, **kwargs)  # nn.Module.__call__ (and compiled _call_impl)
            finally:
                off.release(i)

        cls = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                             "__qualname__": base.__qualname__, "_sgld_offloaded_class": True})
        _CLASSES[base] = cls
    return cls


def _keep_transfers_out_of_graphs() -> None:
    """Make ``acquire`` / ``release`` ``torch.compiler.disable``-d, once, on the class (on an instance,
    the wrappers of its own bound methods would make it reference itself). Not decorators at import:
    torch.compiler.disable imports torch._dynamo (~1 s), which ``get_offload`` users must not pay."""
    cls = LayerwiseOffload
    if not cls.__dict__.get("_transfers_disabled", False):
        if "torch._dynamo" not in sys.modules:
            # imported on a thread of its own: torch's import code leaves its frames in reference cycles
            # (torch.fx.wrap keeps inspect.currentframe()), which on this thread would hold the callers'
            # frames, and so the model being offloaded, until the next garbage collection
            t = threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="sgld-import-dynamo")
            t.start()
            t.join()
        cls.acquire = torch.compiler.disable(cls.acquire)
        cls.release = torch.compiler.disable(cls.release)
        cls._transfers_disabled = True


class LayerwiseOffload:
    """Offload of ``model.layers`` (see the module docstring). Made by ``apply_layerwise_offload``."""

    def __init__(self, model: nn.Module, device, resident_layers: int = 2, pin: Optional[bool] = None,
                 prefetch_first: bool = True):
        if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or resident_layers < 1:
            raise ValueError(f"resident_layers '{resident_layers}' is not supported; choose an integer >= 1")
        if getattr(model, "_sgld_offload", None) is not None:
            raise ValueError("this model is already offloaded")
        # The model owns the offloader (model._sgld_offload, each block's _sgld_offload); the offloader
        # refers back weakly, so dropping the model frees both by reference counting (no gc needed).
        self._model = weakref.ref(model)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        n = len(model.layers)
        self.num_slots = min(resident_layers, n)
        # With more than 2 buffers, all but two hold blocks 0..fixed-1 for good (loaded once: cyclic access
        # would make any eviction policy reload every block), the other two stream the rest. All fit: no streaming.
        self.fixed = n if self.num_slots >= n else max(0, self.num_slots - 2)
        self.prefetch_first = prefetch_first
        _keep_transfers_out_of_graphs()
        self.pin = (self.device.type == "cuda" and torch.cuda.is_available()) if pin is None else bool(pin)
        self.streams = _Streams(self.device)
        self.record = deque(maxlen=100_000)  # block indices in transfer order (tests, stats)
        self.reset_stats()
        self._plan: List[int] = []
        self._cursor = 0
        self._token = 0
        self._tick = 0

        # non-block weights to the device, for good, as normal tensors (see _renew_parameters)
        nonblock = [model] + [m for name, child in model.named_children() if name != "layers" for m in child.modules()]
        dev = self.device

        def moved(t):
            return t.detach().to(dev, copy=True) if t.device != dev or t.is_inference() else None

        _renew_parameters(nonblock, moved)
        with torch.inference_mode(False):
            for m in nonblock:
                for name, b in list(m._buffers.items()):
                    nb = None if b is None else moved(b)
                    if nb is not None:
                        m._buffers[name] = nb
        # blocks to (pinned) CPU masters, one block at a time (peak: the model + one block)
        self.stores: List[_BlockStore] = []
        for i, block in enumerate(model.layers):
            if list(block.buffers()):
                raise ValueError(f"block {i} has buffers; layer-wise offload handles parameters only")
            self.stores.append(_BlockStore(i, block, self.pin))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the blocks' old device copies (if the model was on the GPU)
        self.slot_bytes = max(s.nbytes for s in self.stores)
        self.slots = [_Slot(k) for k in range(self.num_slots)]
        self._slot_views: Dict[Tuple[int, tuple], List[torch.Tensor]] = {}
        for i, block in enumerate(model.layers):
            block._sgld_offload = self
            block._sgld_offload_index = i
            block.__class__ = _offloaded_class(type(block))
        self._layers_class = type(model.layers)
        model.layers.__class__ = _PlannedLayers
        model._sgld_offload = self
        log.info("offload: layer-wise, %d blocks of %.1f MiB in %s CPU memory, %d resident on %s (%.1f MiB), "
                 "non-block weights %.1f MiB on the device", len(self.stores), self.slot_bytes / 2 ** 20,
                 "pinned" if self.pin else "pageable", self.num_slots, self.device,
                 self.num_slots * self.slot_bytes / 2 ** 20, self.nonblock_bytes() / 2 ** 20)

    @property
    def model(self) -> Optional[nn.Module]:
        return self._model()

    # -- accounting ------------------------------------------------------------------------------------------
    def nonblock_bytes(self) -> int:
        seen, total = set(), 0
        block_ids = {id(p) for s in self.stores for p in s.params}
        model = self.model
        for t in [] if model is None else list(model.parameters()) + list(model.buffers()):
            if id(t) not in seen and id(t) not in block_ids:
                seen.add(id(t))
                total += _nbytes(t)
        return total

    def block_bytes(self) -> int:
        return sum(s.nbytes for s in self.stores)

    def resident_bytes(self) -> int:
        """Bytes this model holds on the compute device now: non-block weights + allocated slots."""
        return self.nonblock_bytes() + sum(_nbytes(s.buf) for s in self.slots if s.buf is not None)

    def reset_stats(self) -> None:
        self.transfers = 0
        self.bytes_transferred = 0
        self.stalls = 0  # acquires that had to start the load themselves (nothing prefetched)
        self.record.clear()

    def stats(self) -> dict:
        return {"mode": "layerwise", "device": str(self.device), "resident_layers": self.num_slots, "fixed_blocks": self.fixed,
                "blocks": len(self.stores), "block_mib": round(self.slot_bytes / 2 ** 20, 2),
                "pinned": self.pin, "nonblock_mib": round(self.nonblock_bytes() / 2 ** 20, 2),
                "resident_mib": round(self.resident_bytes() / 2 ** 20, 2), "transfers": self.transfers,
                "transferred_gib": round(self.bytes_transferred / GiB, 3), "stalls": self.stalls}

    def describe(self) -> str:
        return (f"offload: layer-wise, {self.num_slots} of {len(self.stores)} blocks resident on {self.device} "
                f"({self.num_slots * self.slot_bytes / GiB:.2f} GiB + {self.nonblock_bytes() / GiB:.2f} GiB non-block), "
                f"{self.block_bytes() / GiB:.2f} GiB of blocks in {'pinned' if self.pin else 'pageable'} CPU memory")

    # -- plan ---------------------------------------------------------------------------------------------------
    def plan(self, indices: Iterable[int]) -> int:
        """Announce the blocks about to run, in order (replaces the previous plan). Returns a token."""
        self._plan = [int(i) for i in indices]
        self._cursor = 0
        self._token += 1
        return self._token

    def end_plan(self, token: int) -> None:
        if token == self._token:
            self._plan, self._cursor = [], 0

    def _iterate(self, blocks):
        token = self.plan(b._sgld_offload_index for b in blocks)
        try:
            yield from blocks
        finally:
            self.end_plan(token)

    def _upcoming(self) -> List[int]:
        nxt = self._plan[self._cursor:self._cursor + self.num_slots - 1]
        if self.prefetch_first and len(nxt) < self.num_slots - 1 and self._plan and self._cursor >= len(self._plan) \
                and self._plan[-1] == len(self.stores) - 1 and 0 not in nxt:
            nxt.append(0)
        return nxt

    # -- slots --------------------------------------------------------------------------------------------------
    def _slot_of(self, i: int) -> Optional[_Slot]:
        for s in self.slots:
            if s.block == i:
                return s
        return None

    def _victim(self, keep: Sequence[int]) -> Optional[_Slot]:
        cands = [s for s in self.slots if not s.busy and s.block not in keep
                 and (s.block is None or s.block >= self.fixed)]
        if not cands:
            return None
        empty = [s for s in cands if s.block is None]
        return empty[0] if empty else min(cands, key=lambda s: s.used)

    def _load(self, i: int, slot: _Slot) -> None:
        st = self.streams
        if slot.buf is None:
            with torch.inference_mode(False):  # a normal tensor: later runs may be outside inference mode
                slot.buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            slot.ready, slot.free, slot.free_recorded = st.event(), st.event(), False
            if st.cuda:  # fresh memory may have been freed by compute-stream work still queued: order after it
                slot.free.record(st.compute())
                slot.free_recorded = True
        src = self.stores[i]
        slot.block = i
        if st.cuda:
            with st.on_copy():
                if slot.free_recorded:
                    st.copy.wait_event(slot.free)
                slot.buf[:src.nbytes].copy_(src.master, non_blocking=self.pin)
                slot.ready.record(st.copy)
        else:
            slot.buf[:src.nbytes].copy_(src.master)
        self.transfers += 1
        self.bytes_transferred += src.nbytes
        self.record.append(i)

    def _views(self, slot: _Slot, store: _BlockStore) -> List[torch.Tensor]:
        key = (slot.index, store.layout)
        v = self._slot_views.get(key)
        if v is None:
            v = self._slot_views[key] = store._views(slot.buf)
        return v

    def _prefetch(self) -> None:
        upcoming = self._upcoming()
        for k in upcoming:
            if self._slot_of(k) is not None:
                continue
            slot = self._victim(upcoming)
            if slot is None:
                break
            self._load(k, slot)

    def acquire(self, i: int) -> None:
        """Block ``i`` is about to run: make its weights resident and point its parameters at them."""
        if self._cursor < len(self._plan):
            if self._plan[self._cursor] == i:
                self._cursor += 1
            elif i in self._plan[self._cursor:]:
                self._cursor = self._plan.index(i, self._cursor) + 1
        slot = self._slot_of(i)
        if slot is None:
            self.stalls += 1
            slot = self._victim(self._upcoming())
            if slot is None:  # every other slot is busy or planned: take any non-busy one
                slot = self._victim(())
            if slot is None:
                cands = [s for s in self.slots if not s.busy]
                slot = min(cands, key=lambda s: s.used) if cands else None
            if slot is None:
                raise RuntimeError(f"offload: no free layer buffer for block {i} "
                                   f"({self.num_slots} resident layers, all in use)")
            self._load(i, slot)
        if self.streams.cuda:
            self.streams.compute().wait_event(slot.ready)
        self.stores[i].bind(self._views(slot, self.stores[i]))
        slot.busy = True
        self._tick += 1
        slot.used = self._tick
        self._prefetch()

    def release(self, i: int) -> None:
        """Block ``i``'s call returned (its kernels are queued): free the slot after them."""
        slot = self._slot_of(i)
        if slot is not None:
            if self.streams.cuda:
                slot.free.record(self.streams.compute())
                slot.free_recorded = True
            slot.busy = False
        self.stores[i].bind_master()
        self._prefetch()

    @contextlib.contextmanager
    def hold(self, *indices: int):
        """Keep blocks resident for the ``with`` body (e.g. to probe kernels on the block weights)."""
        got = []
        try:
            for i in indices:
                self.acquire(i)
                got.append(i)
            yield
        finally:
            for i in reversed(got):
                self.release(i)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def updating(self):
        """Change block weights in place (LoRA merge / unmerge) inside ``with off.updating():``: waits for
        transfers in flight from the masters first, and refills the layer buffers afterwards."""
        self.streams.synchronize()
        try:
            yield
        finally:
            self.invalidate()

    def invalidate(self) -> None:
        """Block weights changed in place (LoRA merge): forget the slots' copies."""
        self.streams.synchronize()
        for s in self.slots:
            if not s.busy:
                s.block = None

    def release_buffers(self) -> int:
        """Free the device slots (they are allocated again at the next forward). Returns bytes freed."""
        self.streams.synchronize()
        freed = 0
        for s in self.slots:
            if s.busy:
                continue
            if s.buf is not None:
                freed += _nbytes(s.buf)
            s.buf, s.block, s.ready, s.free, s.free_recorded = None, None, None, None, False
        self._slot_views.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def remove(self) -> None:
        """Undo: blocks become plain modules again, each parameter in its own pageable CPU tensor (the
        non-block weights stay on the device). Frees the slots and the masters now, and leaves the
        offloader holding nothing (a second call does nothing)."""
        self.release_buffers()
        model = self.model
        if model is not None and get_offload(model) is self:
            for store, block in zip(self.stores, model.layers._modules.values()):
                store.bind_master()
                store.unpack()  # one block at a time: peak = the masters + one block
                block.__class__ = type(block).__mro__[1]
                del block._sgld_offload, block._sgld_offload_index
            model.layers.__class__ = self._layers_class
            model.__dict__.pop("_sgld_offload", None)
        self.stores, self.slots, self._slot_views = [], [], {}
        self._plan, self._cursor = [], 0


def apply_layerwise_offload(model: nn.Module, device, resident_layers: int = 2, pin: Optional[bool] = None,
                            prefetch_first: bool = True) -> LayerwiseOffload:
    """Offload ``model.layers`` to CPU memory with ``resident_layers`` device buffers (see module doc)."""
    return LayerwiseOffload(model, device, resident_layers, pin=pin, prefetch_first=prefetch_first)


def empty_host_cache() -> None:
    """Return freed pinned host memory to the OS (torch keeps it cached). Call after dropping an
    offloaded engine (e.g. when ComfyUI unloads models) and ``gc.collect()``."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None and torch.cuda.is_available():
        fn()


def get_offload(model: nn.Module) -> Optional[LayerwiseOffload]:
    return getattr(model, "_sgld_offload", None)


def plan_blocks(model: nn.Module, indices: Iterable[int]) -> None:
    """For block runners that call ``model.layers[i]`` one by one: announce the blocks about to run
    (no-op without offload). Iterating ``model.layers`` or a slice of it announces by itself."""
    off = get_offload(model)
    if off is not None:
        off.plan(indices)


__all__ = ["MODES", "LayerwiseOffload", "apply_layerwise_offload", "get_offload", "empty_host_cache", "plan_blocks", "choose_offload",
           "estimate_checkpoint_bytes", "working_bytes"]
