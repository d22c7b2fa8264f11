"""Layer-wise offload, attached as the "offload" Patch: the DiT blocks' weights live in (pinned) CPU
memory and stream through a few device buffers, one block ahead of compute, so the 8B model runs on
an 8 GB GPU. Each block's class gets acquire -> call -> release (a class swap, outside compiled graphs),
and the blocks' ModuleList announces the blocks a loop is about to run, so prefetch follows only those
(a Cache-DiT-skipped middle is never transferred). Layout, ordering and lifetime: docs/offload.md.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
from collections import deque
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ... import device as device_rt
from ...models.family import family_of
from .. import patching
from .auto import GiB
from .buffers import BlockStore, Slot, Streams, nbytes, renew_parameters

log = logging.getLogger("sgld.offload")
FEATURE = "offload"


class OffloadedBlock(NamedTuple):
    """``patching.state(block)["offload"]``: what the block's swapped class needs at call time."""

    offload: "LayerwiseOffload"
    index: int


def _offloaded_block(base: type) -> type:
    """``base`` whose ``__call__`` makes the block's weights resident around ``nn.Module.__call__``."""

    def __call__(self, *args, **kwargs):
        offload, index = patching.state(self)[FEATURE]
        offload.acquire(index)
        try:
            return base.__call__(self, *args, **kwargs)  # nn.Module.__call__ (and compiled _call_impl)
        finally:
            offload.release(index)

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


def _planned_layers(base: type) -> type:
    """``base`` (the model's ModuleList of blocks) whose iteration, also of a slice, announces the blocks."""

    def __iter__(self):
        blocks = list(self._modules.values())
        record = patching.feature_state(blocks[0], FEATURE) if blocks else None
        if record is None:
            return iter(blocks)
        return record.offload._iterate(blocks)

    return type(base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


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


class LayerwiseOffload(patching.Patch):
    """Offload of the model's blocks (see the module docstring). Made by ``apply_layerwise_offload``."""

    name = FEATURE

    def __init__(self, model: nn.Module, device, resident_layers: int = 2, pin: Optional[bool] = None,
                 prefetch_first: bool = True):
        if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or resident_layers < 1:
            raise ValueError(f"resident_layers '{resident_layers}' is not supported; choose an integer >= 1")
        if patching.get(model, FEATURE) is not None:
            raise ValueError("this model is already offloaded")
        # The model owns the offloader (its registry, each block's state); the offloader refers back
        # weakly, so dropping the model frees both by reference counting (no gc needed).
        super().__init__(model)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", device_rt.current_index())
        family = family_of(model)
        blocks = _ordered_blocks(model)
        n = len(blocks)
        self.num_slots = min(resident_layers, n)
        # With more than 2 buffers, all but two hold blocks 0..fixed-1 for good (loaded once: cyclic access
        # would make any eviction policy reload every block), the other two stream the rest. All fit: no streaming.
        self.fixed = n if self.num_slots >= n else max(0, self.num_slots - 2)
        self.prefetch_first = prefetch_first
        # the block a forward runs after the last of each list (after the last list's: the next forward's first)
        position = {id(b): i for i, b in enumerate(blocks)}
        lists = [[position[id(b)] for b in blocks_list] for blocks_list in family.block_lists_of(model)]
        self.after_list = {ends[-1]: lists[(k + 1) % len(lists)][0] for k, ends in enumerate(lists)}
        _keep_transfers_out_of_graphs()
        self.pin = device_rt.can_pin(self.device) if pin is None else bool(pin)
        self.streams = Streams(self.device)
        self.record = deque(maxlen=100_000)  # block indices in transfer order (tests, stats)
        self.reset_stats()
        self._plan: List[int] = []
        self._cursor = 0
        self._token = 0
        self._tick = 0

        # non-block weights to the device, for good, as normal tensors (see buffers.renew_parameters)
        lists = {id(lst) for lst in family.block_lists_of(model)}
        nonblock = [model] + [m for child in model.children() if id(child) not in lists for m in child.modules()]
        dev = self.device

        def moved(t):
            return t.detach().to(dev, copy=True) if t.device != dev or t.is_inference() else None

        renew_parameters(nonblock, moved)
        with torch.inference_mode(False):
            for m in nonblock:
                for name, b in list(m._buffers.items()):
                    nb = None if b is None else moved(b)
                    if nb is not None:
                        m._buffers[name] = nb
        # blocks to (pinned) CPU masters, one block at a time (peak: the model + one block)
        self.stores: List[BlockStore] = []
        for i, block in enumerate(blocks):
            if list(block.buffers()):
                raise ValueError(f"block {i} has buffers; layer-wise offload handles parameters only")
            self.stores.append(BlockStore(i, block, self.pin))
        if self.device.type == "cuda":
            device_rt.empty_cache()  # the blocks' old device copies (if the model was on the GPU)
        self.slot_bytes = max(s.nbytes for s in self.stores)
        self.slots = [Slot(k) for k in range(self.num_slots)]
        self._slot_views: Dict[Tuple[int, tuple], List[torch.Tensor]] = {}
        for i, block in enumerate(blocks):
            patching.state(block)[FEATURE] = OffloadedBlock(self, i)
            patching.swap_class(block, FEATURE, _offloaded_block)
        for blocks_list in family.block_lists_of(model):
            patching.swap_class(blocks_list, FEATURE, _planned_layers)
        patching.attach(model, self)
        log.info("offload: layer-wise, %d blocks of %.1f MiB in %s CPU memory, %d resident on %s (%.1f MiB), "
                 "non-block weights %.1f MiB on the device", len(self.stores), self.slot_bytes / 2 ** 20,
                 "pinned" if self.pin else "pageable", self.num_slots, self.device,
                 self.num_slots * self.slot_bytes / 2 ** 20, self.nonblock_bytes() / 2 ** 20)

    # -- accounting ------------------------------------------------------------------------------------------
    def nonblock_bytes(self) -> int:
        seen, total = set(), 0
        block_ids = {id(p) for s in self.stores for p in s.params}
        model = self.model
        for t in [] if model is None else list(model.parameters()) + list(model.buffers()):
            if id(t) not in seen and id(t) not in block_ids:
                seen.add(id(t))
                total += nbytes(t)
        return total

    def block_bytes(self) -> int:
        return sum(s.nbytes for s in self.stores)

    def resident_bytes(self) -> int:
        """Bytes this model holds on the compute device now: non-block weights + allocated slots."""
        return self.nonblock_bytes() + sum(nbytes(s.buf) for s in self.slots if s.buf is not None)

    def unallocated_bytes(self) -> int:
        """Device bytes its slots will take at the next forward that they do not hold now (made lazily)."""
        return sum(self.slot_bytes for s in self.slots if s.buf is None)

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

    def describe(self) -> dict:
        return self.stats()

    def summary(self) -> str:
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
        token = self.plan(patching.state(b)[FEATURE].index for b in blocks)
        try:
            yield from blocks
        finally:
            self.end_plan(token)

    def _upcoming(self) -> List[int]:
        nxt = self._plan[self._cursor:self._cursor + self.num_slots - 1]
        if self.prefetch_first and len(nxt) < self.num_slots - 1 and self._plan and self._cursor >= len(self._plan):
            following = self.after_list.get(self._plan[-1])  # a list ran to its end: the next list's first block
            if following is not None and following not in nxt:
                nxt.append(following)
        return nxt

    # -- slots --------------------------------------------------------------------------------------------------
    def _slot_of(self, i: int) -> Optional[Slot]:
        for s in self.slots:
            if s.block == i:
                return s
        return None

    def _victim(self, keep: Sequence[int]) -> Optional[Slot]:
        cands = [s for s in self.slots if not s.busy and s.block not in keep
                 and (s.block is None or s.block >= self.fixed)]
        if not cands:
            return None
        empty = [s for s in cands if s.block is None]
        return empty[0] if empty else min(cands, key=lambda s: s.used)

    def _load(self, i: int, slot: Slot) -> None:
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

    def _views(self, slot: Slot, store: BlockStore) -> List[torch.Tensor]:
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
                freed += nbytes(s.buf)
            s.buf, s.block, s.ready, s.free, s.free_recorded = None, None, None, None, False
        self._slot_views.clear()
        if self.device.type == "cuda":
            device_rt.empty_cache()
        return freed

    def remove(self) -> None:
        """Undo: blocks become plain modules again, each parameter in its own pageable CPU tensor (the
        non-block weights stay on the device). Frees the slots and the masters now, and leaves the
        offloader holding nothing and out of the model's registry (a second call does nothing)."""
        self.release_buffers()
        model = self.model
        if model is not None and get_offload(model) is self:
            for store, block in zip(self.stores, _ordered_blocks(model)):
                store.bind_master()
                store.unpack()  # one block at a time: peak = the masters + one block
                patching.restore_class(block, FEATURE)
                patching.clear_state(block, FEATURE)
            for blocks_list in family_of(model).block_lists_of(model):
                patching.restore_class(blocks_list, FEATURE)
            patching.patches(model).pop(FEATURE)
        self.stores, self.slots, self._slot_views = [], [], {}
        self._plan, self._cursor = [], 0


def _ordered_blocks(model: nn.Module) -> List[nn.Module]:
    """Every block the offloader streams, by store index: the main blocks first (block ``i`` is store ``i``, as the
    cache's and the runners' plans name it), then the family's other lists (``Family.block_lists``)."""
    family = family_of(model)
    main = family.blocks_of(model)
    others = [b for blocks_list in family.block_lists_of(model) if blocks_list is not main for b in blocks_list]
    return list(main._modules.values()) + others


def apply_layerwise_offload(model: nn.Module, device, resident_layers: int = 2, pin: Optional[bool] = None,
                            prefetch_first: bool = True) -> LayerwiseOffload:
    """Offload the model's blocks to CPU memory with ``resident_layers`` device buffers (see module doc)."""
    return LayerwiseOffload(model, device, resident_layers, pin=pin, prefetch_first=prefetch_first)


def empty_host_cache() -> None:
    """Return freed pinned host memory to the OS (torch keeps it cached). Call after dropping an
    offloaded engine (e.g. when ComfyUI unloads models) and ``gc.collect()``."""
    device_rt.empty_host_cache()


def get_offload(model: nn.Module) -> Optional[LayerwiseOffload]:
    return patching.get(model, FEATURE)


def remove_offload(model: nn.Module) -> bool:
    """``LayerwiseOffload.remove`` through the registry. False when the model is not offloaded."""
    return patching.detach(model, FEATURE)


def plan_blocks(model: nn.Module, indices: Iterable[int]) -> None:
    """For block runners that call block ``i`` one by one: announce the blocks about to run (no-op without
    offload). Iterating the blocks' ModuleList or a slice of it announces by itself."""
    off = get_offload(model)
    if off is not None:
        off.plan(indices)
