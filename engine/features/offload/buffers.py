"""The memory of layer-wise offload: each block's parameters packed into one CPU byte buffer (its master,
pinned for a CUDA device), the device buffers (slots) they are copied into, and the copy stream and
events that order the copies (no-ops off CUDA).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from ... import device as device_rt

ALIGN = 256  # bytes: every parameter view starts on a 256-byte boundary (kernels, inductor alignment)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Streams:
    """The copy stream and the events of one offloader (engine/device.py; all None off CUDA)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.copy = device_rt.new_stream(device) if self.cuda else None

    def event(self):
        return device_rt.event() if self.cuda else None

    def compute(self):
        return device_rt.current_stream(self.device) if self.cuda else None

    def on_copy(self):
        """Context: work issued inside runs on the copy stream."""
        return device_rt.on_stream(self.copy)

    def synchronize(self) -> None:
        if self.cuda:
            self.copy.synchronize()
            device_rt.current_stream(self.device).synchronize()


class Slot:
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


def renew_parameters(modules: Iterable[nn.Module], make) -> None:
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


class BlockStore:
    """One block's parameters packed into a flat CPU byte buffer, and their views."""

    def __init__(self, index: int, block: nn.Module, pin: bool):
        self.index = index
        old = list(block.parameters())  # shared parameters once
        layout, offset = [], 0  # (dtype, shape, byte offset, bytes) per parameter
        for p in old:
            layout.append((p.dtype, p.shape, offset, nbytes(p)))
            offset = align(offset + nbytes(p))
        self.nbytes = max(offset, ALIGN)
        with torch.inference_mode(False):  # normal tensors even when applied under inference mode (ComfyUI)
            self.master = device_rt.host_buffer(self.nbytes, pin)
            for p, (_, _, off, n) in zip(old, layout):
                if n:
                    self.master[off:off + n].copy_(p.detach().contiguous().reshape(-1).view(torch.uint8))
        self._layout = layout
        self.layout = tuple((dtype, tuple(shape), off) for dtype, shape, off, _ in layout)
        self.master_views = [self._views(self.master)]  # kept: pointing back costs no allocation
        # new (normal) Parameters on the master views; the block's old weights are freed
        views = {id(p): v for p, v in zip(old, self.master_views[0])}
        renew_parameters(block.modules(), lambda p: views[id(p)])
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
