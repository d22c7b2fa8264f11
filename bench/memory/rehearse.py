"""The engine rehearsed on fake CUDA tensors at the release shape, and its peak GPU memory from the trace.

A fake tensor (``torch._subclasses.fake_tensor``) has a device, a dtype and a shape but no memory and no
FLOPs, so the 8B DiT runs here, on a CPU machine (a CUDA or a CPU-only build of torch: cpu_build.py), through
the engine's own entry points (``open_engine``, ``Engine.sample``) in seconds. What the rehearsal replaces, and
only that:

- the device seam (``engine/device.py``): ``FakeRuntime`` answers as a card of ``card_bytes`` (free memory for
  offload "auto", sm90 capability, streams and events that order nothing, page-locked host buffers that are
  fake CPU tensors counted on the host side);
- where the CUDA dispatcher would pick a kernel the fake device cannot see: PyTorch SDPA on a GPU runs its
  flash kernel (no mask) or its memory-efficient one (a key mask), never the math path that materializes the
  [B, heads, S, S] scores, so ``_FusedSDPA`` calls those kernels' own ops; the fp8 ``_scaled_mm`` and int8
  ``_int_mm`` probes (a numeric comparison, which fake tensors cannot make) are answered "runs" as sm90 would;
- host reads: a device tensor copied to the CPU arrives as zeros (the sampling loop goes on), and a host read
  of a device value (``.item()``, ``bool(t)``) fails naming the op, the tensor and the module, as does any op
  given tensors on two devices or a kernel with no fake implementation.

- threads: torch's dispatch modes are per thread, a CUDA device is per process, so a thread started inside the
  rehearsal (the server's batcher: its loop and a thread per job) runs under the same modes and tracker; the
  fake mode keeps state while it runs an op, so torch calls take turns (a lock), and a fake tensor reports
  its kernel-time "meta" device only to the thread running the op.

``Tracker`` counts the live CUDA bytes after every op (each storage once, rounded up to the caching
allocator's 512-byte blocks, freed when its last tensor dies) and keeps the peak and where it happened (op,
module). It cannot see allocator fragmentation, cuBLAS / attention workspaces, or the CUDA context: see
docs/memory.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import List, Optional, Tuple

import cpu_build  # beside this file (bench/memory is on sys.path wherever rehearse is imported)
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine import device as device_rt

GiB = 2 ** 30
ALLOC_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this
_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_TO_COPY = torch.ops.aten._to_copy.default
_TO_DEVICE = torch.ops.aten.to.device
_TO_DTYPE_LAYOUT = torch.ops.aten.to.dtype_layout
_SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default)


class RehearsalError(RuntimeError):
    """Something that would not run on the GPU (or that a trace cannot see), with the op, tensors and module."""


def describe_tensor(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{type(t).__name__}{list(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"
    return repr(t)[:60]


def _round(n: int) -> int:
    return (n + ALLOC_BLOCK - 1) // ALLOC_BLOCK * ALLOC_BLOCK


@dataclasses.dataclass
class Peak:
    bytes: int = 0
    op: str = ""
    module: str = ""


class Tracker:
    """Live fake-CUDA bytes over time (and pinned host bytes), with the peak and where it happened."""

    def __init__(self):
        self.live = 0
        self.peak = Peak()
        self.host = 0  # page-locked host bytes alive (offload's block masters)
        self.host_peak = 0
        self._seen = {}  # id(storage) -> rounded bytes
        self.modules: List[str] = []  # the module stack (names), for "where"
        self.op = ""
        self._lock = threading.Lock()  # the batcher's threads allocate and free too

    def _gone(self, key: int, host: bool) -> None:
        with self._lock:
            n = self._seen.pop(key, 0)
            if host:
                self.host -= n
            else:
                self.live -= n

    def track(self, out, op: str) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, FakeTensor) and t.device.type == "cuda":
                self._add(t, host=False, op=op)

    def track_host(self, t: torch.Tensor) -> None:
        self._add(t, host=True, op="pinned host buffer")

    def _add(self, t, host: bool, op: str) -> None:
        st = t.untyped_storage()
        key = id(st)
        with self._lock:
            if key in self._seen:
                return
            n = _round(st.nbytes())
            self._seen[key] = n
            weakref.finalize(st, self._gone, key, host)
            if host:
                self.host += n
                self.host_peak = max(self.host_peak, self.host)
                return
            self.live += n
            if self.live > self.peak.bytes:
                self.peak = Peak(self.live, op, self.modules[-1] if self.modules else "")

    def reset_peak(self) -> None:
        self.peak = Peak(self.live, "(start)", "")


class _Dispatch(TorchDispatchMode):
    """Fake where a CUDA device (or a fake tensor, or ``forcing``) is involved, real CPU ops otherwise."""

    def __init__(self, rehearsal: "Rehearsal"):
        super().__init__()
        self.r = rehearsal

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        fake = self.r.forcing or any(isinstance(a, FakeTensor) or _names_cuda(a) for a in flat)
        if not fake:
            with _without_fake():
                return func(*args, **kwargs)
        with self.r.lock:  # FakeTensorMode keeps per-instance state while it runs an op: one thread at a time
            return self._fake(func, flat, args, kwargs)

    def _fake(self, func, flat, args, kwargs):
        target = _copy_target(func, args, kwargs)
        if target is not None and not self.r.forcing and isinstance(args[0], FakeTensor) and args[0].device.type == "cuda" \
                and torch.device(target[0]).type == "cpu":
            with _without_fake():  # a device -> host copy: the host gets zeros of the shape (the loop goes on)
                return torch.zeros(args[0].shape, dtype=target[1] or args[0].dtype)
        if func in _SCALAR_READS and self.r.answers is not None:  # a read the caller expects and accepts
            self.r.answers.append(f"{func} of {', '.join(describe_tensor(a) for a in flat if isinstance(a, torch.Tensor))} "
                                  f"in {self.r.where()}")
            return True
        if func in _SCALAR_READS:
            raise RehearsalError(f"{func}: a host read of a device value ({', '.join(describe_tensor(a) for a in flat if isinstance(a, torch.Tensor))}) "
                                 f"in {self.r.where()}: a device sync on the GPU, and a trace cannot know the value")
        try:  # Tensor.to under inference_mode: its composite, so the fake mode sees the _to_copy it is
            out = func.decompose(*args, **kwargs) if target is not None and func is not _TO_COPY else func(*args, **kwargs)
        except RehearsalError:
            raise
        except Exception as e:  # a device / dtype mismatch, a kernel with no fake implementation
            tensors = ", ".join(describe_tensor(a) for a in flat if isinstance(a, torch.Tensor))
            raise RehearsalError(f"{func} failed in {self.r.where()} on [{tensors}]: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from e
        self.r.tracker.track(out, str(func))
        return out


def _names_cuda(a) -> bool:
    return isinstance(a, torch.device) and a.type == "cuda"


def _copy_target(func, args, kwargs) -> Optional[tuple]:
    """(device, dtype) a copy op sends its tensor to, or None. Under ``inference_mode`` (the batcher's threads)
    ``Tensor.to`` reaches the mode as ``aten.to`` with positional arguments, not as ``_to_copy``."""
    if func is _TO_COPY or func is _TO_DTYPE_LAYOUT:
        device, dtype = kwargs.get("device"), kwargs.get("dtype")
    elif func is _TO_DEVICE:
        device = args[1] if len(args) > 1 else kwargs.get("device")
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    else:
        return None
    return None if device is None else (device, dtype)


@contextlib.contextmanager
def _without_fake():
    mode = torch._C._unset_dispatch_mode(_FAKE_KEY)
    try:
        yield
    finally:
        if mode is not None:
            torch._C._set_dispatch_mode(mode)


class _FusedSDPA(TorchFunctionMode):
    """SDPA on fake CUDA tensors as the GPU runs it: the flash kernel without a mask, the memory-efficient one
    with a mask (their own ops, whose fake kernels allocate what the kernels allocate), never the math path."""

    def __init__(self, lock=None):
        super().__init__()
        self.lock = lock or contextlib.nullcontext()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        with self.lock:  # threads take turns per torch call: a fake tensor reports "meta" while any thread's op runs
            return self._call(func, args, kwargs or {})

    def _call(self, func, args, kwargs):
        if func is F.scaled_dot_product_attention and isinstance(args[0], FakeTensor) and args[0].device.type == "cuda":
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if mask is None:
                return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False)[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def _data_keeps_device():
    """``p.data = v`` (offload binds a block's parameters to a device buffer that way) swaps a fake tensor's
    storage but not the device it reports (a Python attribute of FakeTensor): carry it over while rehearsing."""
    base = torch._C.TensorBase.data

    def set_data(self, new):
        base.__set__(self, new)
        if isinstance(new, FakeTensor):
            self.fake_device = new.fake_device

    FakeTensor.data = property(base.__get__, set_data)
    try:
        yield
    finally:
        del FakeTensor.data


@contextlib.contextmanager
def _device_per_thread(lock):
    """A fake tensor reports device "meta" while its mode runs a kernel (a flag of the mode, not of a thread):
    another thread reading ``t.device`` meanwhile would get "meta". Only the thread running the op (it holds
    the rehearsal's lock) sees that."""
    prop = FakeTensor.__dict__["device"]

    def device(self):
        if self.fake_mode.in_kernel_invocation and lock._is_owned():
            return torch.device("meta")
        return self.fake_device

    FakeTensor.device = property(device)
    try:
        yield
    finally:
        FakeTensor.device = prop


class FakeStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or FakeEvent()


class FakeEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeRuntime:
    """engine/device.py's runtime for a rehearsal: a CUDA card of ``card_bytes`` (what ``free_bytes`` starts from),
    compute capability ``capability``, ``count`` devices."""

    def __init__(self, rehearsal: "Rehearsal", card_bytes: int, capability: Tuple[int, int] = (9, 0), count: int = 1):
        self.r, self.card_bytes, self.cap, self.count = rehearsal, int(card_bytes), capability, count

    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def current_index(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        pass

    def capability(self, device) -> Tuple[int, int]:
        return self.cap

    def free_bytes(self, device) -> Optional[int]:
        return self.card_bytes - self.r.tracker.live if torch.device(device).type == "cuda" else None

    def new_stream(self, device):
        return FakeStream()

    def event(self):
        return FakeEvent()

    def current_stream(self, device):
        return FakeStream()

    def on_stream(self, stream):
        return contextlib.nullcontext()

    def can_pin(self, device) -> bool:
        return torch.device(device).type == "cuda"

    def host_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        with self.r.all_fake():
            t = torch.empty(nbytes, dtype=torch.uint8)
        if pin:
            self.r.tracker.track_host(t)
        return t

    def empty_cache(self) -> None:
        pass

    def empty_host_cache(self) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass

    def reset_peak(self, device) -> None:
        self.r.tracker.reset_peak()

    def allocated_bytes(self, device) -> int:
        return self.r.tracker.live

    def peak_bytes(self, device) -> int:
        return self.r.tracker.peak.bytes


class Rehearsal:
    """``with Rehearsal(card_bytes) as r:`` everything CUDA inside is fake and counted in ``r.tracker``."""

    def __init__(self, card_bytes: int = 80 * GiB, capability: Tuple[int, int] = (9, 0)):
        self.tracker = Tracker()
        self.runtime = FakeRuntime(self, card_bytes, capability)
        self.forcing = False
        self.answers: Optional[List[str]] = None  # see answering()
        self.lock = threading.RLock()
        self._stack = contextlib.ExitStack()
        self._names = {}

    def name_modules(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Name ``model``'s modules in "where" reports (the peak's module, errors)."""
        self._names.update({id(m): (prefix + n) or type(m).__name__ for n, m in model.named_modules()})

    def where(self) -> str:
        return self.tracker.modules[-1] if self.tracker.modules else "(outside any module)"

    @contextlib.contextmanager
    def answering(self):
        """Host reads of a device value answered True (a check that finds nothing wrong) instead of failing,
        each listed in the yielded list: for a path whose checks read the device by design, so that the
        trace goes on and says which reads it answered."""
        old, self.answers = self.answers, []
        try:
            yield self.answers
        finally:
            self.answers = old

    @contextlib.contextmanager
    def all_fake(self):
        """Every op fake, CPU ones too (weights of the 8B shape built on the host: no real 16 GB)."""
        old, self.forcing = self.forcing, True
        try:
            yield
        finally:
            self.forcing = old

    @contextlib.contextmanager
    def _modes(self):
        with self._fake, _Dispatch(self), _FusedSDPA(self.lock):
            yield

    @contextlib.contextmanager
    def _threads_inherit(self):
        """Threads started inside the rehearsal run under its modes (they are thread-local in torch)."""
        run = threading.Thread.run
        rehearsal = self

        def run_rehearsed(thread):
            with rehearsal._modes():
                run(thread)

        threading.Thread.run = run_rehearsed
        try:
            yield
        finally:
            threading.Thread.run = run

    def __enter__(self) -> "Rehearsal":
        try:  # a CPU-only torch lacks CUDA's device guard and the CUDA kernel of rms_norm's fused op
            cpu_build.as_cuda_build()
        except RuntimeError as e:
            raise RehearsalError(str(e)) from e
        s = self._stack
        self._fake = FakeTensorMode(allow_non_fake_inputs=True)
        s.enter_context(self._modes())
        s.enter_context(self._threads_inherit())
        s.enter_context(device_rt.using(self.runtime))
        s.enter_context(_data_keeps_device())
        s.enter_context(_device_per_thread(self.lock))
        from torch.nn.modules import module as nn_module

        def pre(mod, args):
            self.tracker.modules.append(self._names.get(id(mod), type(mod).__name__))

        def post(mod, args, out):
            if self.tracker.modules:
                self.tracker.modules.pop()

        s.callback(nn_module.register_module_forward_pre_hook(pre).remove)
        s.callback(nn_module.register_module_forward_hook(post, always_call=True).remove)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
