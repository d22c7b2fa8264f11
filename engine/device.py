"""The device seam: every CUDA runtime piece the engine uses (streams, events, pinned host memory, memory
queries, capability and device-count queries, cache release) goes through this module, and nothing else in
engine/ calls ``torch.cuda``. Tensors and their ops stay ordinary torch; what needs a CUDA driver is here.

Why one module: the engine can then be traced at the release shape on fake CUDA tensors on a CPU machine
(bench/memory/rehearse.py swaps in a runtime with ``using``), and a port to another accelerator changes one
file. Callers call the module functions (``device.event()``), never a bound copy, so a swapped runtime is
seen everywhere at once. No function here asks "is this a rehearsal": the runtime object answers.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch


class CudaRuntime:
    """torch.cuda as the engine uses it. Every method is safe to call without a GPU (it answers "none")."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.available() else 0

    def current_index(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def capability(self, device) -> Tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def free_bytes(self, device) -> Optional[int]:
        """Memory this process can still allocate on a CUDA device: the driver's free memory and what PyTorch's
        caching allocator holds unused (None: not a CUDA device, or none here)."""
        dev = torch.device(device)
        if dev.type != "cuda" or not self.available():
            return None
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(torch.cuda.mem_get_info(dev)[0]) + max(int(cached), 0)

    # -- streams and events (None off CUDA: callers then copy synchronously) ---------------------------
    def new_stream(self, device):
        return torch.cuda.Stream(device)

    def event(self):
        return torch.cuda.Event()

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def on_stream(self, stream):
        return torch.cuda.stream(stream)

    # -- memory -----------------------------------------------------------------------------------------
    def can_pin(self, device) -> bool:
        """Is page-locked host memory worth having for copies to ``device`` (a CUDA device, CUDA here)?"""
        return torch.device(device).type == "cuda" and self.available()

    def host_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A flat uint8 CPU buffer of ``nbytes`` (page-locked when ``pin``)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def empty_cache(self) -> None:
        if self.available():
            torch.cuda.empty_cache()

    def empty_host_cache(self) -> None:
        fn = getattr(torch._C, "_host_emptyCache", None)
        if fn is not None and self.available():
            fn()

    def synchronize(self, device=None) -> None:
        if self.available():
            torch.cuda.synchronize(device)

    def reset_peak(self, device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def allocated_bytes(self, device) -> int:
        return int(torch.cuda.memory_allocated(device))

    def peak_bytes(self, device) -> int:
        return int(torch.cuda.max_memory_allocated(device))


_runtime = CudaRuntime()


def runtime():
    """The runtime in use (CudaRuntime unless ``using`` swapped one in)."""
    return _runtime


@contextlib.contextmanager
def using(rt) -> Iterator:
    """Run the ``with`` body on runtime ``rt`` (an object with CudaRuntime's methods), then put the old one back."""
    global _runtime
    old, _runtime = _runtime, rt
    try:
        yield rt
    finally:
        _runtime = old


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


# The engine's calls, each forwarded to the runtime in use at call time.
def available() -> bool:
    return _runtime.available()


def device_count() -> int:
    return _runtime.device_count()


def current_index() -> int:
    return _runtime.current_index()


def set_device(index: int) -> None:
    _runtime.set_device(index)


def capability(device) -> Tuple[int, int]:
    return _runtime.capability(device)


def free_bytes(device) -> Optional[int]:
    return _runtime.free_bytes(device)


def new_stream(device):
    return _runtime.new_stream(device) if is_cuda(device) else None


def event():
    return _runtime.event()


def current_stream(device):
    return _runtime.current_stream(device)


def on_stream(stream):
    return contextlib.nullcontext() if stream is None else _runtime.on_stream(stream)


def can_pin(device) -> bool:
    return _runtime.can_pin(device)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    return _runtime.host_buffer(nbytes, pin)


def empty_cache() -> None:
    _runtime.empty_cache()


def empty_host_cache() -> None:
    _runtime.empty_host_cache()


def synchronize(device=None) -> None:
    _runtime.synchronize(device)


def reset_peak(device) -> None:
    _runtime.reset_peak(device)


def allocated_bytes(device) -> int:
    return _runtime.allocated_bytes(device)


def peak_bytes(device) -> int:
    return _runtime.peak_bytes(device)
