"""RankedRunner: the DiT on a pool of rank processes, behind the same interface as LocalRunner.

``engine.open_engine(path, EngineConfig(ulysses_degree=2, ...))`` gives an Engine with one when the
degrees ask for more than one rank; the Engine keeps the sampling loop (same sigmas, noise, sampler
arithmetic and CFG combination), only the model calls go to the ranks. The parent holds no weights:
it reads the checkpoint's header for the shapes and validates everything before a worker starts.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import weakref
from typing import List, Optional

import torch

from ..config import EngineConfig
from ..errors import CheckpointError, LoRAError
from ..features.lora import normalize
from ..io.checkpoint import check_architecture, open_checkpoint, parse_dtype
from ..models import family_of
from ..sampling import to_sigma
from .plan import ParallelPlan, check_devices, check_model, make_plan
from .pool import check_settings, detach, get_pool
from .wire import pack, pack_loras, unpack

log = logging.getLogger("sgld.parallel")
_ids = itertools.count(1)
WORKER_ERRORS = {"LoRAError": LoRAError, "CheckpointError": CheckpointError}


def plan_from_config(config: EngineConfig) -> ParallelPlan:
    return make_plan(config.tp, config.ulysses_degree, config.ring_degree, config.cfg_parallel, config.num_gpus)


def validate(config: EngineConfig, num_heads: int, ffn_hidden_size: int, available_gpus: Optional[int] = None,
             cpu_ranks: Optional[int] = None):
    """All checks that need no worker: degrees, GPUs (what the machine has comes first), heads, the
    timeout variables. Returns (plan, backend)."""
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
    def alive(self) -> bool:
        return self.pool is None or self.pool.alive

    @property
    def pids(self) -> List[int]:
        """The worker processes (rank order) while they run, else []."""
        return list(self.pool.pids) if self.pool is not None and self.pool.alive else []


class LocalTransport:
    """Every rank runs the same loop (torchrun): requests are handled in this process, collectively."""

    alive = True
    pids: List[int] = []

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


class RankedRun:
    """One sampling run on the ranks: begun with the cache plan, ended with the ranks' cache summary."""

    def __init__(self, owner: "RankedRunner", plan, cfg_batched: bool):
        self.owner = owner
        self.sent_text = None
        branches = 2 if cfg_batched and owner.plan.cfg == 1 else 1
        owner.transport.request(("begin", None, None, cfg_batched, None if plan is None else dataclasses.asdict(plan),
                                   branches))

    def call(self, x, sigma, text, lens):
        msg = ("call", pack(x), pack(sigma.reshape(-1)))
        if text is not self.sent_text:  # the text goes once per run
            msg += (pack(text), lens.detach().cpu().contiguous().numpy())
            self.sent_text = text
        out, computed = self.owner.transport.request(msg)
        return unpack(out).to(x.device), bool(computed)

    def finish(self) -> Optional[dict]:
        if not self.owner.transport.alive:  # the pool failed mid-run: nothing to end
            return None
        return self.owner.transport.request(("end",))


class RankedRunner:
    def __init__(self, path: str, config: EngineConfig, model_config, dtype: torch.dtype, plan: ParallelPlan,
                 backend: str, transport=None, num_params: int = 0):
        self.path = str(path)
        self.config = config
        self.model = None  # the weights live on the ranks
        self.model_config = model_config
        self.dtype = dtype
        self.plan = plan
        self.backend = backend
        self.num_params = num_params
        self.warnings: List[str] = []
        self.notes: List[str] = [f"parallel: {plan.describe()} over {backend}"]
        self.attention_backend = "parallel"
        self.loras: list = []  # [(path or LoRATensors, strength)] active on the ranks (put back after a reload)
        self.lora_report: List[str] = []
        self.info: dict = {}
        self.transport = transport or PoolTransport(plan, backend)
        self._key = (next(_ids), self.path)
        self._warned_cfg = False
        # dropped without release(): release from a thread (the GC may run inside another request); at
        # interpreter exit shutdown_pools (atexit) stops the workers instead
        self._finalizer = weakref.finalize(self, _release_in_thread, self.transport, self._key)
        self._finalizer.atexit = False
        self._ensure()

    device = torch.device("cpu")  # where the parent's loop and its tensors live

    @property
    def pids(self) -> List[int]:
        return self.transport.pids

    def describe(self) -> dict:
        ranks = {k: v for k, v in self.info.items() if k not in ("warnings", "notes")}
        return {"device": str(self.config.device), "dtype": str(self.dtype).replace("torch.", ""), "params": self.num_params,
                "model": self.model_config.to_dict(), "attention": self.attention_backend, "quant": ranks.get("quant"),
                "weights": ranks.get("weights"), "fused_projections": ranks.get("fused_projections"), "offload": ranks.get("offload"),
                "compile": ranks.get("compile"), "parallel": {"plan": self.plan.describe(), "world_size": self.plan.world_size,
                                                              "backend": self.backend, "worker_pids": self.pids}}

    def _ensure(self) -> None:
        # plain data only: the workers import the engine as the top-level package ``engine``, which
        # need not be the name the parent imported it under (ComfyUI loads the pack by folder name)
        config = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config) if f.name != "cache"}
        family = family_of(self.model_config)  # a family registered outside the engine: the ranks import its module
        spec = {"path": self.path, "config": config, "plan": dataclasses.asdict(self.plan),
                "family": (family.name, family.model_class.__module__)}
        info = self.transport.ensure(self._key, spec)
        if info:
            self.info = info
            if self.loras:  # fresh weights (first load, reload, restarted pool): put the LoRAs back
                self.lora_report = self._worker_call(("loras", pack_loras(self.loras)))
            self.attention_backend = f"{info['attention']} (parallel)"
            self.warnings[:] = list(dict.fromkeys(self.warnings + info.get("warnings", [])))
            self.notes[:] = [self.notes[0]] + info.get("notes", [])

    # -- LoRA: on every rank (sequence / CFG parallel: the full weights; TP: each rank its slice, lora/shard.py) ---
    def set_loras(self, loras) -> List[str]:
        items = [(getattr(p, "path", p), float(s)) for p, s in normalize(loras)]
        if items == list(self.loras):
            return list(self.lora_report)
        self._ensure()
        try:
            self.lora_report = list(self._worker_call(("loras", pack_loras(items))) or [])
        except ValueError:  # the ranks refused the set (nothing changed) or rolled back to the base: make
            self.loras, self.lora_report = [], []  # every rank the base, so this engine knows what is active
            try:
                self._worker_call(("loras", []))
            except Exception:  # workers gone: the next run reloads them with no LoRA; report the first error
                pass
            raise
        self.loras = items
        return list(self.lora_report)

    def check_lora(self, path) -> List[str]:
        self._ensure()
        return list(self._worker_call(("check_lora", os.fspath(path))) or [])

    def active_loras(self) -> list:
        return [(getattr(p, "name", p), s) for p, s in self.loras]

    def _worker_call(self, msg):
        """A request whose user errors (a bad LoRA file) come back as the engine's own exception types."""
        res = self.transport.request(msg)
        if isinstance(res, dict) and "error" in res:
            kind, text = res["error"]
            raise WORKER_ERRORS.get(kind, ValueError)(text)
        return res

    def close(self) -> None:
        """Unload the weights from the ranks, and stop them unless another engine uses them. The next run
        starts them and loads the weights again."""
        _release(self.transport, self._key)

    def release(self) -> int:
        """``close()`` for the host (ComfyUI freeing memory); the bytes of weights unloaded (all ranks)."""
        pool = getattr(self.transport, "pool", None)
        loaded = pool is not None and pool.alive and pool.loaded == self._key
        self.close()
        if not loaded:
            return 0
        return int(self.info.get("params_per_rank", self.num_params) * self.dtype.itemsize * self.plan.world_size)

    # -- the model calls ---------------------------------------------------------------------------------
    def make_room(self, x_shape, text_tokens: int) -> None:
        """Offload is decided on the ranks when they load (each holds its share): nothing to move per call."""
        return None

    def activation_room(self) -> None:
        """No bound here: the ranks keep one run at a time (the server's batcher admits one job)."""
        return None

    def run(self, plan, cfg_batched: bool) -> RankedRun:
        if self.plan.cfg > 1 and not cfg_batched and not self._warned_cfg:
            self._warned_cfg = True
            msg = "cfg_parallel: this run has no negative branch (cfg = 1), so both CFG rank groups compute the same batch"
            log.warning(msg)
            self.warnings.append(msg)
        self._ensure()
        return RankedRun(self, plan, cfg_batched)

    @torch.no_grad()
    def dit(self, x, timestep, text, lens) -> torch.Tensor:
        """One DiT forward through the ranks, like ``model(x, timestep, text, lens)`` (no cache)."""
        run = self.run(None, cfg_batched=False)
        try:
            sigma = to_sigma(torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(x.shape[0]))
            return run.call(x.float(), sigma, text, torch.as_tensor(lens).reshape(-1).expand(x.shape[0]))[0]
        finally:
            run.finish()


def open_ranked_runner(path: str, config: EngineConfig, transport=None, available_gpus: Optional[int] = None) -> RankedRunner:
    """Read the header, validate the plan (before any worker starts) and start the ranks on the weights.
    ``transport``: ranks that already run (torchrun, across machines): this machine's GPUs are not counted."""
    ckpt = open_checkpoint(path)
    model_config = check_architecture(ckpt)
    if transport is None:
        plan, backend = validate(config, model_config.num_attention_heads, model_config.ffn_hidden_size, available_gpus)
    else:
        plan = plan_from_config(config)
        check_model(plan, model_config.num_attention_heads, model_config.ffn_hidden_size)
        backend = "nccl" if str(config.device).startswith("cuda") else "gloo"
    dtype = parse_dtype(config.dtype) or ckpt.stored_dtype()
    num_params = sum(torch.Size(shape).numel() for shape in ckpt.shapes().values())
    return RankedRunner(path, config, model_config, dtype, plan, backend, transport, num_params=num_params)


def _release_in_thread(transport, key) -> None:
    threading.Thread(target=_release, args=(transport, key), name="sgld-parallel-release", daemon=True).start()


def _release(transport, key) -> None:
    pool = getattr(transport, "pool", None)
    try:
        if pool is not None:
            detach(pool, key)
    except Exception:  # a failing pool was stopped by its own error handling
        pass
