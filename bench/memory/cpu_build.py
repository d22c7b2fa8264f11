"""A CPU-only build of torch made to trace fake CUDA tensors as a CUDA build does (nothing changes on a CUDA build).

Two things such a build lacks change a rehearsal:

- **CUDA's device guard.** Some of torch's C++ bindings switch devices around an op whatever the mode: ``t[i]``,
  ``t[i] = v`` and ``Tensor.copy_`` hold a guard for ``t``'s device, and ``Tensor.to("cuda")`` asks the guard for
  the current index. With no guard registered for CUDA they fail on a fake CUDA tensor ("PyTorch is not linked
  with support for cuda devices") before any mode sees the op. ``FakeTensorMode`` means to cover this
  (``torch._C._ensureCUDADeviceGuardSet``: "in the case of CPU-only build ... patch the cuda device guard"), but
  its C++ does so only on a CUDA build that finds no GPU (seen on torch 2.13.0+cpu: the slot stays empty). The
  guard put there switches nothing and says every device is cuda:0 (a rehearsal's one card): torch's own
  Python-defined guard (``torch._C._acc.DeviceGuard``), registered by its own function into PrivateUse1's slot
  and moved to CUDA's.
- **The CUDA kernels of ops that also have a composite one** (``WITH_COMPOSITE``). A CUDA build dispatches
  ``_fused_rms_norm`` (every ``F.rms_norm``) as one op; a CPU-only build has no CUDA kernel for it, so it runs
  the composite, whose float32 intermediates the tracker would count (TP 4 rows: +0.05 / +0.19 GiB). A stand-in
  CUDA kernel, never run (the fake mode answers the op), makes the dispatcher choose as a CUDA build does.
"""
from __future__ import annotations

import ctypes
import os

import torch

_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"  # c10::impl::device_guard_impl_registry, one slot a type
_CUDA = int(torch._C._autograd.DeviceType.CUDA)
_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)
# the ops with both a CUDA and a CompositeImplicitAutograd kernel on a CUDA build (a test checks the list there)
WITH_COMPOSITE = ("aten::_fused_rms_norm", "aten::mish_backward", "aten::silu_backward")
_stand_ins = None  # the torch.library registrations, kept alive


class _NoOpCudaGuard(torch._C._acc.DeviceGuard):
    """Switches nothing; its device is always cuda:0 (torch's Python guard answers ``Device(type_(), 0)``)."""

    def type_(self):
        return torch._C._autograd.DeviceType.CUDA


def registry():
    """c10's device-guard registry (an array of pointers indexed by device type), read and written in place."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    try:
        path = next(os.path.join(lib, n) for n in ("libc10.so", "libc10.dylib") if os.path.exists(os.path.join(lib, n)))
        return (ctypes.c_void_p * (_PRIVATEUSE1 + 1)).in_dll(ctypes.CDLL(path), _REGISTRY)
    except (StopIteration, OSError, ValueError) as e:
        raise RuntimeError(f"c10's device-guard registry is not found in {lib} ({e!r}): the rehearsal needs a CUDA "
                           "build of torch (no GPU needed), or a Linux / macOS one") from e


def _cuda_guard() -> None:
    slots = registry()
    if slots[_CUDA]:
        return
    if slots[_PRIVATEUSE1]:
        raise RuntimeError(f"torch {torch.__version__} has no CUDA device guard and PrivateUse1's slot is taken: "
                           "the rehearsal needs a CUDA build of torch (no GPU needed) in this process")
    torch._C._acc.register_python_privateuseone_device_guard(_NoOpCudaGuard())  # kept alive by torch
    slots[_CUDA], slots[_PRIVATEUSE1] = slots[_PRIVATEUSE1], None


def _cuda_kernels() -> None:
    global _stand_ins
    missing = [op for op in WITH_COMPOSITE if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")]
    if not missing:
        return
    _stand_ins = _stand_ins or torch.library.Library("aten", "IMPL")
    for op in missing:
        def stand_in(*args, op=op, **kwargs):
            raise RuntimeError(f"{op}: this CPU-only torch has no CUDA kernel (a stand-in for fake CUDA tensors)")
        _stand_ins.impl(op.split("::")[1], stand_in, "CUDA")


def as_cuda_build() -> None:
    """CUDA's device guard and the CUDA kernels of ``WITH_COMPOSITE`` present in this process (no-op where they are).
    They stay for the process: on a CPU-only build no real tensor is on CUDA, so only fake ones ever meet them."""
    _cuda_guard()
    _cuda_kernels()
