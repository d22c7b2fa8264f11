"""``ParallelEngine``: the ``Engine`` API with the DiT running on a pool of rank processes.

``Engine.from_file(path, EngineConfig(ulysses_degree=2, ...))`` returns one when the degrees ask
for more than one rank. The parent (ComfyUI, the CLI) keeps the sampling loop, exactly as
``Engine.sample`` runs it (same sigmas, noise, sampler arithmetic and CFG combination, through
``Engine.make_denoiser``); only the model call goes to the workers. The parent holds no weights:
it reads the checkpoint's header for the shapes, and validates everything before a worker starts.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ..config import EngineConfig
from ..engine import Engine, RunStats
from ..sampling import DEFAULT_SHIFT, run_sampler
from .plan import ParallelPlan, check_devices, check_model, make_plan
from .worker import pack, unpack

_ids = itertools.count(1)


@dataclass
class ModelInfo:
    """What the parent needs of the model: its configuration and compute dtype (no weights)."""

    config: object
    dtype: torch.dtype
    block_runner: Optional[Callable] = None
    num_params: int = 0

    def parameters(self):
        """One meta tensor with the model's parameter count (so ``sum(p.numel() ...)`` works)."""
        return iter([torch.empty(self.num_params, device="meta")])


class _Computed:
    """Stands in for the cache runner in ``make_denoiser``: the workers' per-call decisions."""

    def __init__(self):
        self.computed: List[bool] = []


def plan_from_config(config: EngineConfig) -> ParallelPlan:
    return make_plan(getattr(config, "tp", 1), getattr(config, "ulysses_degree", 1), getattr(config, "ring_degree", 1),
                     getattr(config, "cfg_parallel", False), getattr(config, "num_gpus", None))


def validate(config: EngineConfig, num_heads: int, ffn_hidden_size: int, available_gpus: Optional[int] = None,
             cpu_ranks: Optional[int] = None):
    """All checks that need no worker: degrees, GPUs (what the machine has comes first), heads, the
    timeout variables. Returns (plan, backend)."""
    from .pool import check_settings

    plan = plan_from_config(config)
    backend = check_devices(plan, config.device, available_gpus, cpu_ranks)
    check_model(plan, num_heads, ffn_hidden_size)
    check_settings()
    return plan, backend


class PoolTransport:
    """Requests go to rank 0 of a spawned pool (the default)."""

    def __init__(self, plan: ParallelPlan, backend: str):
        self.plan, self.backend = plan, backend
        self.pool = None

    def ensure(self, key, spec) -> Optional[dict]:
        from .pool import get_pool

        self.pool = get_pool(self.plan.world_size, self.backend, user=key)
        with self.pool.lock:
            if self.pool.loaded != key:
                self.pool.loaded = None
                info = self.pool.request(("load", spec))
                self.pool.loaded = key
                return info
        return None

    def request(self, msg):
        return self.pool.request(msg)

    @property
    def pids(self) -> List[int]:
        """The worker processes (rank order) while they run, else []."""
        return list(self.pool.pids) if self.pool is not None and self.pool.alive else []


class LocalTransport:
    """Every rank runs the same loop (torchrun): requests are handled in this process, collectively."""

    def __init__(self, state):
        self.state = state
        self.loaded = None

    def ensure(self, key, spec):
        if self.loaded != key:
            info = self.state.handle(("load", spec))
            self.loaded = key
            return info
        return None

    def request(self, msg):
        return self.state.handle(msg)


class ParallelEngine(Engine):
    loras: list = []  # plain attributes here (set in __init__): an Engine derives them from its model's LoRA patch
    lora_report: List[str] = []

    def __init__(self, path: str, config: EngineConfig, model_config, dtype: torch.dtype, plan: ParallelPlan,
                 backend: str, transport=None, num_params: int = 0):
        # No Engine.__init__: the parent holds no model.
        self.config = config
        self.source = str(path)
        self.path = str(path)
        self.plan = plan
        self.backend = backend
        self.model = ModelInfo(model_config, dtype, num_params=num_params)
        self.last_run = RunStats()
        self.warnings: List[str] = []
        self.notes: List[str] = [f"parallel: {plan.describe()} over {backend}"]
        self.attention_backend = "parallel"
        self.offload = None  # layer-wise offload runs inside the workers, if asked for
        self.loras: list = []  # [(path, strength)] active on the workers (re-applied after a reload)
        self.lora_report: List[str] = []
        self.worker_device = torch.device(config.device)  # where the weights live (the workers' GPUs)
        self.info: dict = {}
        self.transport = transport or PoolTransport(plan, backend)
        self._key = (next(_ids), self.path)
        self._sent_text = None
        self._computed: Optional[_Computed] = None
        # dropped without close(): release from a thread (the GC may run inside another request); at
        # interpreter exit shutdown_pools (atexit) stops the workers instead
        self._finalizer = weakref.finalize(self, _release_in_thread, self.transport, self._key)
        self._finalizer.atexit = False
        self._ensure()

    @classmethod
    def from_file(cls, path: str, config: EngineConfig, transport=None, available_gpus: Optional[int] = None) -> "ParallelEngine":
        from ..io.checkpoint import Checkpoint, check_architecture, parse_dtype

        ckpt = Checkpoint(str(path))
        mcfg = check_architecture(ckpt)
        plan, backend = validate(config, mcfg.num_attention_heads, mcfg.ffn_hidden_size, available_gpus)
        dtype = parse_dtype(config.dtype) or ckpt.stored_dtype()
        eng = cls(path, config, mcfg, dtype, plan, backend, transport, num_params=_count(ckpt))
        return eng

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where the parent's loop and its tensors live

    @property
    def pids(self) -> List[int]:
        return getattr(self.transport, "pids", [])

    def _ensure(self) -> None:
        # plain data only: the workers import the engine as the top-level package ``engine``, which
        # need not be the name the parent imported it under (ComfyUI loads the pack by folder name)
        config = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config) if f.name != "cache"}
        spec = {"path": self.path, "config": config, "plan": dataclasses.asdict(self.plan)}
        info = self.transport.ensure(self._key, spec)
        if info:
            self.info = info
            if self.loras:  # fresh weights (first load, reload, restarted pool): put the LoRAs back
                self.lora_report = self._worker_call(("loras", list(self.loras)))
            self.attention_backend = f"{info['attention']} (parallel)"
            self.warnings = list(dict.fromkeys(self.warnings + info.get("warnings", [])))
            self.notes = [self.notes[0]] + info.get("notes", [])

    # -- LoRA: merged on every rank (sequence / CFG parallel hold the full weights) ---------------------
    def set_loras(self, loras) -> List[str]:
        """``Engine.set_loras`` on the workers: exactly these LoRAs active, the same list again is free."""
        from ..features.lora import normalize

        items = [(getattr(p, "path", p), float(s)) for p, s in normalize(loras)]
        if items == list(self.loras):
            return list(self.lora_report)
        if items:
            self._refuse_tp()
        self._ensure()
        try:
            self.lora_report = list(self._worker_call(("loras", items)) or [])
        except ValueError:  # the workers' answer: they refused the set (nothing changed) or rolled back to the
            self.loras, self.lora_report = [], []  # base; make every rank the base, so this engine knows what is active
            try:
                self._worker_call(("loras", []))
            except Exception:  # workers gone: the next run reloads them with no LoRA; report the first error
                pass
            raise
        self.loras = items
        return list(self.lora_report)

    def check_lora(self, path) -> List[str]:
        """``Engine.check_lora`` on the workers: read a LoRA against the model without applying it."""
        import os

        self._refuse_tp()
        self._ensure()
        return list(self._worker_call(("check_lora", os.fspath(path))) or [])

    def _refuse_tp(self) -> None:
        from ..features.lora import LoRAError

        if self.plan.tp > 1:
            raise LoRAError("LoRA with tensor parallel (tp > 1) is not supported yet: each rank holds a slice of the "
                            "layers; use ulysses_degree / ring_degree / cfg_parallel, or one GPU")

    def _worker_call(self, msg):
        """A request whose user errors (a bad LoRA file) come back as the engine's own exception types."""
        res = self.transport.request(msg)
        if isinstance(res, dict) and "error" in res:
            kind, text = res["error"]
            from ..features.lora import LoRAError
            from ..io.safetensors import CheckpointError

            raise {"LoRAError": LoRAError, "CheckpointError": CheckpointError}.get(kind, ValueError)(text)
        return res

    def close(self) -> None:
        """Unload this engine's weights from the workers, and stop the worker processes unless another
        engine uses them. The next ``sample`` starts them and loads the weights again."""
        _release(self.transport, self._key)

    def release(self) -> int:
        """Free the workers' memory for the host (ComfyUI): ``close()``; the next run starts them again.
        Returns the bytes of weights unloaded (all ranks)."""
        pool = getattr(self.transport, "pool", None)
        loaded = pool is not None and pool.alive and pool.loaded == self._key
        self.close()
        if not loaded:
            return 0
        per_rank = self.info.get("params_per_rank", self.model.num_params) * self.model.dtype.itemsize
        return int(per_rank * self.plan.world_size)

    # -- the model call --------------------------------------------------------------------------------
    def velocity(self, x, sigma, text, lens):
        send_text = text is not self._sent_text
        msg = ("call", pack(x), pack(sigma.reshape(-1)))
        if send_text:
            msg += (pack(text), lens.detach().cpu().contiguous().numpy())
            self._sent_text = text
        out, computed = self.transport.request(msg)
        if self._computed is not None:
            self._computed.computed.append(computed)
        return unpack(out).to(x.device)

    @torch.no_grad()
    def model_forward(self, x, timestep, text, lens) -> torch.Tensor:
        """One DiT forward through the workers, like ``model(x, timestep, text, lens)`` (no cache)."""
        from ..sampling import MULTIPLIER

        self._ensure()
        self.transport.request(("begin", None, None, False, None, 1))
        self._sent_text = None
        try:
            sigma = torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(x.shape[0]) / MULTIPLIER
            return self.velocity(x.float(), sigma, text, torch.as_tensor(lens).reshape(-1).expand(x.shape[0]))
        finally:
            self._sent_text = None
            if self._transport_alive():
                self.transport.request(("end",))

    @torch.no_grad()
    def sample(self, latent: torch.Tensor, cond, uncond=None, *, seed: int, steps: int, cfg: float,
               sampler: str = "euler", scheduler: str = "simple", denoise: float = 1.0,
               shift: float = DEFAULT_SHIFT, callback: Optional[Callable] = None, cache=None) -> torch.Tensor:
        """Same contract as ``Engine.sample``; the model calls run on the workers."""
        latent, cond, uncond, sigmas = self._start_run(latent, cond, uncond, steps, cfg, sampler, scheduler, denoise, shift)
        if len(sigmas) < 2:
            return latent.clone()
        from ..features.cache import resolve_config

        cc = resolve_config(cache if cache is not None else getattr(self.config, "cache", None))
        rc = cc.resolve(self.last_run.model_calls, self.model.config.num_layers) if cc.enabled else None
        cfg_batched = uncond is not None
        if self.plan.cfg > 1 and not cfg_batched and not getattr(self, "_warned_cfg", False):
            self._warned_cfg = True
            msg = "cfg_parallel: this run has no negative branch (cfg = 1), so both CFG rank groups compute the same batch"
            logging.getLogger("sgld.parallel").warning(msg)
            self.warnings.append(msg)
        branches = 2 if cfg_batched and self.plan.cfg == 1 else 1
        x, step_cb = self._first_step(latent, sigmas, seed, callback)
        self._ensure()
        self._computed = _Computed() if rc is not None else None
        self._sent_text = None
        self.transport.request(("begin", None, None, cfg_batched, None if rc is None else dataclasses.asdict(rc), branches))
        start = time.perf_counter()
        denoiser = self.make_denoiser(cond, uncond, cfg, runner=self._computed)
        ok = False
        try:
            out = run_sampler(sampler, denoiser, x, sigmas, callback=step_cb, seed=seed)
            ok = True
        finally:
            self._sent_text = None
            self._computed = None
            if ok or self._transport_alive():
                summary = self.transport.request(("end",))
                if summary is not None:
                    self.last_run.cache = summary
        self.last_run.sampling_seconds = time.perf_counter() - start
        return out

    def _transport_alive(self) -> bool:
        pool = getattr(self.transport, "pool", None)
        return pool is None or pool.alive


def _count(ckpt) -> int:
    n = 0
    for shape in ckpt.shapes().values():
        k = 1
        for d in shape:
            k *= int(d)
        n += k
    return n


def _release_in_thread(transport, key) -> None:
    import threading

    threading.Thread(target=_release, args=(transport, key), name="sgld-parallel-release", daemon=True).start()


def _release(transport, key) -> None:
    from .pool import detach

    pool = getattr(transport, "pool", None)
    try:
        if pool is not None:
            detach(pool, key)
    except Exception:  # a failing pool was stopped by its own error handling
        pass
