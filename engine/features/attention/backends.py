"""The attention backend table (``BACKEND_TABLE``: sdpa, sage, flash, math; auto picks the best that runs), the
choice made once at load and set as the model's ``attention`` slot by the "attention" Patch, and the probe that
gives ring attention its block kernel from the same table. A new backend is one ``register_backend(Backend(...))``
(docs/architecture.md)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...models.family import sdpa  # the model's own attention: the default backend
from .. import patching
from ..tables import LiveNames
from .flash import check_flash, flash
from .kernels import installed_version, math_attention
from .lse import reference_lse, torch_flash_lse
from .sage import check_sage, sage, sage_lse

log = logging.getLogger("sgld.attention")


def _pytorch(device: torch.device, dtype: torch.dtype, head_dim: int) -> Tuple[bool, str]:
    return True, "PyTorch"


# -- the table ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """One attention backend: ``fn(q, k, v, key_mask=None)`` ([B, S, heads, head_dim], mask [B, S] True =
    attend); ``check(device, dtype, head_dim)`` -> (runs here, why); ``package``: the module whose version
    describes it (None: torch); ``auto``: its rank when "auto" chooses (higher first; 0: never chosen);
    ``lse(device, dtype, head_dim)`` -> (name, kernel) or None: where it has one here, its attention with the
    log-sum-exp, ``kernel(q, k, v)`` -> (out [B, S, H, D], lse [B, S, H]) float32 on unmasked keys of any count,
    which ring attention's blocks run when this backend is chosen (``lse_kernel``)."""

    name: str
    fn: Callable
    check: Callable[[torch.device, torch.dtype, int], Tuple[bool, str]]
    package: Optional[str] = None
    auto: int = 0
    lse: Optional[Callable[[torch.device, torch.dtype, int], Optional[Tuple[str, Callable]]]] = None


BACKEND_TABLE: Dict[str, Backend] = {}  # in registration order: the order of lists and messages


def register_backend(backend: Backend) -> Backend:
    if backend.name == "auto" or backend.name in BACKEND_TABLE:
        raise ValueError(f"attention backend '{backend.name}' is registered twice (or named 'auto')")
    BACKEND_TABLE[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Take a backend out of the table (tests that register one of their own); sdpa, the fallback, stays."""
    if name != "sdpa":
        BACKEND_TABLE.pop(name, None)
        for key in [key for key in _LSE_KERNELS if key[0] == name]:
            del _LSE_KERNELS[key]


def backend_names() -> Tuple[str, ...]:
    """What EngineConfig.attention accepts: "auto" and every registered backend."""
    return ("auto", *BACKEND_TABLE)


for _b in (Backend("sdpa", sdpa, _pytorch, lse=torch_flash_lse), Backend("sage", sage, check_sage, "sageattention", 2, sage_lse),
           Backend("flash", flash, check_flash, "flash_attn", auto=1), Backend("math", math_attention, _pytorch, lse=reference_lse)):
    register_backend(_b)
BACKENDS = LiveNames(backend_names)  # EngineConfig.attention's choices: the table's, read when asked
FUNCTIONS: Dict[str, Callable] = {n: b.fn for n, b in BACKEND_TABLE.items()}  # the built-ins' functions (benchmarks)


# -- selection ------------------------------------------------------------------------------------------------
def check_backend(name: str, device="cpu", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> Tuple[bool, str]:
    """Can backend ``name`` run for this device / dtype / head size? (ok, reason)."""
    backend = BACKEND_TABLE.get(name)
    if backend is None:
        return False, f"unknown backend '{name}'"
    return backend.check(torch.device(device), dtype, head_dim)


def available_backends(device="cpu", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> List[str]:
    return [n for n in BACKEND_TABLE if check_backend(n, device, dtype, head_dim)[0]]


@dataclass
class AttentionChoice:
    requested: str
    name: str  # the backend in use
    fn: Callable
    reason: str
    warnings: List[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"attention: {self.name} (requested {self.requested}; {self.reason})"

    @property
    def version(self) -> str:
        """The version of what computes it: the kernel package, or torch for sdpa / math."""
        backend = BACKEND_TABLE.get(self.name)
        package = backend.package if backend is not None else None
        return installed_version(package) if package else f"torch {torch.__version__}"


def select_backend(requested: Optional[str] = "auto", device="cpu", dtype: torch.dtype = torch.bfloat16,
                   head_dim: int = 128, log_choice: bool = True) -> AttentionChoice:
    """Choose the attention backend once; one log line says which and why. Never raises for a
    backend that cannot run here: that falls back to sdpa with a warning in ``.warnings``."""
    req = (requested or "auto").lower()
    if req not in backend_names():
        raise ValueError(f"attention '{requested}' is not supported; choose one of {', '.join(backend_names())}")
    warnings: List[str] = []
    if req == "auto":
        reasons = []
        ranked = sorted((b for b in BACKEND_TABLE.values() if b.auto > 0), key=lambda b: -b.auto)
        for backend in ranked:
            ok, why = check_backend(backend.name, device, dtype, head_dim)
            if ok:
                choice = AttentionChoice(req, backend.name, backend.fn, why)
                break
            reasons.append(f"{backend.name}: {why}")
        else:
            choice = AttentionChoice(req, "sdpa", sdpa, "best available; " + "; ".join(reasons))
    else:
        ok, why = check_backend(req, device, dtype, head_dim)
        if ok:
            choice = AttentionChoice(req, req, BACKEND_TABLE[req].fn, why)
        else:
            msg = f"attention '{req}' cannot run here ({why}); using sdpa instead"
            warnings.append(msg)
            log.warning(msg)
            choice = AttentionChoice(req, "sdpa", sdpa, f"fallback: {why}", warnings)
    if log_choice:
        log.info(choice.describe())
    return choice


class AttentionBackend(patching.Patch):
    """The "attention" Patch: the chosen backend in the model's ``attention`` slot, the one before kept."""

    name = "attention"

    def __init__(self, model: nn.Module, choice: AttentionChoice):
        super().__init__(model)
        self.choice = choice
        self.previous = patching.set_slot(model, "attention", choice.fn)

    def remove(self) -> None:
        model = self.model
        if model is not None:
            patching.set_slot(model, "attention", self.previous)

    @staticmethod
    def chosen(model: nn.Module) -> Optional[str]:
        """The backend ``apply_attention`` set on ``model`` (None: none was)."""
        patch = patching.get(model, AttentionBackend.name)
        return patch.choice.name if patch is not None else None

    def describe(self) -> dict:
        c = self.choice
        return {"backend": c.name, "requested": c.requested, "reason": c.reason, "version": c.version}


def apply_attention(model: nn.Module, choice: AttentionChoice) -> AttentionBackend:
    """Set ``choice`` (from ``select_backend``) as the model's attention; a backend set before is replaced."""
    patching.detach(model, "attention")
    return patching.attach(model, AttentionBackend(model, choice))


def remove_attention(model: nn.Module) -> bool:
    """The model's attention back to what it was before ``apply_attention``. False when none was set."""
    return patching.detach(model, "attention")


# -- ring attention's block kernel ----------------------------------------------------------------------------------
_LSE_KERNELS: Dict[tuple, Callable] = {}


def lse_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, backend: Optional[str] = None) -> Callable:
    """Ring attention's block kernel from the table: the chosen ``backend``'s attention-with-LSE where it has one
    here, else sdpa's (torch's flash kernel: CUDA fp16/bf16, or CPU), each checked once per (backend, device,
    dtype, head size) on a small input against the float32 reference ``attention_with_lse``; one that fails or
    disagrees is skipped (logged), and the reference is the last resort."""
    key = (backend or "sdpa", device.type, dtype, head_dim)
    if key in _LSE_KERNELS:
        return _LSE_KERNELS[key]
    offered = [BACKEND_TABLE[n] for n in dict.fromkeys((key[0], "sdpa")) if n in BACKEND_TABLE]
    candidates = [c for c in (b.lse(device, dtype, head_dim) for b in offered if b.lse is not None) if c is not None]
    name, chosen = reference_lse(device, dtype, head_dim)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 37, 2, head_dim, generator=g).to(device, dtype) for _ in range(3))
    ref_o, ref_l = chosen(q, k, v)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for cand_name, fn in candidates:
        try:
            o, lse = fn(q, k, v)
            if o.shape == ref_o.shape and lse.shape == ref_l.shape and \
                    (o - ref_o).abs().max().item() <= tol and (lse - ref_l).abs().max().item() <= tol:
                chosen, name = fn, cand_name
                break
            log.warning("ring attention kernel %s disagrees with the reference; not used", cand_name)
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            log.warning("ring attention kernel %s unavailable (%s); using the next", cand_name, e)
    log.info("ring attention blocks on %s/%s (attention %s): %s", device.type, str(dtype).replace("torch.", ""),
             key[0], name)
    _LSE_KERNELS[key] = chosen
    return chosen
