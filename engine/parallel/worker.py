"""Worker processes: one per rank, a torch.distributed process group, a command loop.

Rank 0 reads commands from the parent over a ``multiprocessing`` pipe and broadcasts each one to
the other ranks over a gloo group (a separate one when the main group is NCCL); every rank runs
the command (``WorkerState.handle``) and rank 0 sends the answer back. Tensors cross the pipe as
float32 numpy arrays (plain bytes: no shared-memory file descriptors to leak).

Any exception in a worker is fatal for that worker: it puts its traceback on the error queue and
exits, the parent sees the dead process, stops the others and raises ``ParallelWorkerError`` with
that traceback; the next run starts a fresh pool. (A rank that fails on its own would otherwise
leave its peers blocked in a collective.)

Every rank runs a heartbeat thread that writes the time into shared memory once per
``HEARTBEAT_PERIOD_S``: the parent takes a rank whose heartbeat is too old for frozen (stopped,
e.g. SIGSTOP, or stuck holding the interpreter), while a rank that is only busy (a long kernel, a
compile, a slow load) keeps beating.
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import device as device_rt
from ..config import EngineConfig
from ..features.cache import apply_cache, remove_cache
from ..features.cache.config import ResolvedCache
from ..loading import load_model
from ..models import Family, families, register
from ..router import open_engine
from ..sampling import to_timestep
from .comm import build_groups, destroy_groups
from .forward import ParallelModel, cache_runner
from .plan import ParallelPlan
from .wire import pack, unpack, unpack_loras

HEARTBEAT_PERIOD_S = 0.5


def worker_config(config, device: str):
    """The engine options a rank applies to its own model: the same, minus parallelism and cache."""
    kw = dict(device=device, cache=None)
    for f, v in (("tp", 1), ("ulysses_degree", 1), ("ring_degree", 1), ("cfg_parallel", False), ("num_gpus", None)):
        if hasattr(config, f):
            kw[f] = v
    return dataclasses.replace(config, **kw)


def know_family(name: str, module: str) -> None:
    """Register the family ``name`` in this rank if the engine does not declare it: a family registered from
    outside the engine (another package, a test) is a module-level ``Family`` in the module of its model class,
    which this rank imports (the parent's sys.path came with the spawn)."""
    if any(f.name == name for f in families()):
        return
    found = [v for v in vars(importlib.import_module(module)).values() if isinstance(v, Family) and v.name == name]
    if not found:
        raise ValueError(f"DiT family '{name}' is not registered in the worker and module '{module}' (its model "
                         "class's) declares no module-level Family of that name")
    register(found[0])


class WorkerState:
    """Everything one rank holds between commands."""

    def __init__(self, rank: int, world: int, device: str):
        self.rank, self.world, self.device = rank, world, device
        self.groups = None
        self.parallel = None  # ParallelModel: this rank's share of the DiT
        self.engine = None
        self.run = None  # per-run state: text, lens, runner, cfg_batched
        self.return_all = False  # torchrun: every rank runs the loop and needs the output
        self._ctrl = None

    # -- commands ------------------------------------------------------------------------------------
    def handle(self, msg):
        kind = msg[0]
        return getattr(self, "cmd_" + kind)(*msg[1:])

    def cmd_ping(self):
        return {"rank": self.rank, "pid": os.getpid()}

    def cmd_pids(self):
        pids = [None] * self.world
        dist.all_gather_object(pids, os.getpid(), group=self._ctrl)
        return pids

    def cmd_load(self, spec: dict):
        """spec: path, config (EngineConfig fields), plan (ParallelPlan fields), family ((name, module))."""
        self.cmd_unload()
        if spec.get("family"):
            know_family(*spec["family"])
        destroy_groups(self.groups)
        plan = ParallelPlan(**spec["plan"])
        config = worker_config(EngineConfig(**spec["config"]), self.device)
        self.groups = build_groups(plan, self.rank)
        if plan.tp > 1:
            model = load_model(spec["path"], dtype=config.dtype, device=self.device, quant=config.quant,
                               shard=(plan.tp, self.groups.coords[3]))
            self.engine = open_engine(model, config, label=spec["path"])
        else:
            self.engine = open_engine(spec["path"], config)  # one rank's config: this process
        self.parallel = ParallelModel(self.engine.model, self.groups)
        described = self.engine.describe()
        return {"attention": self.engine.attention_backend, "warnings": list(self.engine.warnings),
                "notes": list(self.engine.notes), "params_per_rank": described["params"],
                **{k: described[k] for k in ("quant", "weights", "fused_projections", "offload", "compile")}}

    def cmd_unload(self):
        if self.parallel is not None:
            self.parallel.close()
        self.parallel = self.engine = self.run = None
        gc.collect()
        if self.device.startswith("cuda"):
            device_rt.empty_cache()
        return True

    def cmd_begin(self, text, lens, cfg_batched: bool, plan, branches: int):
        """A run starts: the text (or None, sent with the first call), CFG batching and the cache plan."""
        model = self.engine.model
        runner = cache_runner(ResolvedCache(**plan), branches, self.groups) if plan is not None else None
        # the lengths stay on the host: the model reads "is anything padded" from them without a device sync
        self.run = {"text": unpack(text, model.dtype, self.device), "lens": unpack(lens, torch.long),
                    "cfg_batched": bool(cfg_batched), "runner": runner}
        if runner is not None:
            apply_cache(model, runner)
        return True

    @torch.no_grad()
    def cmd_call(self, x, sigma, text=None, lens=None):
        run = self.run
        model = self.engine.model
        if text is not None:
            run["text"] = unpack(text, model.dtype, self.device)
            run["lens"] = unpack(lens, torch.long)
        x = unpack(x, None, self.device)
        timestep = to_timestep(unpack(sigma, None, self.device)).float()
        out = self.parallel.forward(x, timestep, run["text"], run["lens"], cfg_batched=run["cfg_batched"]).float()
        runner = run["runner"]
        computed = bool(runner.computed[-1]) if runner is not None and runner.computed else True
        return (pack(out) if self.rank == 0 or self.return_all else None), computed

    def cmd_end(self):
        run, self.run = self.run, None
        if run is None or run["runner"] is None:
            return None
        remove_cache(self.engine.model)
        return run["runner"].summary()

    def cmd_loras(self, items):
        try:
            return self.engine.set_loras(unpack_loras(items))
        except Exception as e:  # the same file on every rank: the same error everywhere, no collective inside
            return {"error": (type(e).__name__, str(e))}

    def cmd_check_lora(self, path):
        try:
            return self.engine.check_lora(path)
        except Exception as e:
            return {"error": (type(e).__name__, str(e))}

    def cmd_debug_sleep(self, seconds: float):
        """Keep every rank busy for ``seconds`` (tests: a slow but healthy request is not taken for a hang)."""
        time.sleep(float(seconds))
        return True

    def cmd_exit(self):
        return True


def start_heartbeat(beats, rank: int) -> None:
    """Write this rank's monotonic clock (system-wide on Linux) into ``beats[rank]`` twice a second."""
    def beat():
        while True:
            beats[rank] = time.monotonic()
            time.sleep(HEARTBEAT_PERIOD_S)

    threading.Thread(target=beat, name=f"sgld-heartbeat-rank{rank}", daemon=True).start()


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no worker outlives ComfyUI."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def worker_main(rank: int, world: int, init_method: str, backend: str, conn, errors, threads: int,
                timeout_s: float, beats=None) -> None:
    """Entry point of one spawned worker process."""
    _die_with_parent()
    try:
        if beats is not None:
            start_heartbeat(beats, rank)
        if threads:
            torch.set_num_threads(threads)
        device = "cpu"
        if backend == "nccl":
            device_rt.set_device(rank)
            device = f"cuda:{rank}"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        ctrl = dist.new_group(backend="gloo") if backend != "gloo" else None
        state = WorkerState(rank, world, device)
        state._ctrl = ctrl
        if rank == 0:
            conn.send(("ready", {"pid": os.getpid()}))
        while True:
            box = [None]
            if rank == 0:
                try:
                    box[0] = conn.recv()
                except EOFError:  # the parent is gone
                    box[0] = ("exit",)
            dist.broadcast_object_list(box, src=0, group=ctrl)
            msg = box[0]
            result = state.handle(msg)
            if rank == 0:
                conn.send(("ok", result))
            if msg[0] == "exit":
                break
        state.cmd_unload()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report everything, then die
        try:
            errors.put((rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except Exception:
            pass
        sys.stderr.flush()
        os._exit(1)
