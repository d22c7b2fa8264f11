"""Parallel degrees, their validation and the rank layout.

World size = cfg x ring x ulysses x tp. Ranks are laid out with tensor parallel innermost (its
all-reduce runs twice per block, so it stays on neighbouring GPUs), then Ulysses (one all-to-all
pair per block), then Ring (point-to-point KV passing), then CFG outermost (one all-gather per
model call):

    rank = ((c * ring + r) * ulysses + u) * tp + t

Everything here is plain Python and runs before any worker starts, so a bad combination is a
``ParallelConfigError`` with a message that says what to change.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .. import device as device_rt
from ..errors import ParallelConfigError


def _as_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, str) and value.strip().isdigit():
                value = int(value)
            elif isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise ParallelConfigError(f"{name} = {value!r} is not valid; it must be an integer >= {lo}") from None
    if value < lo:
        raise ParallelConfigError(f"{name} = {value} is not valid; it must be an integer >= {lo}")
    return value


def cfg_degree(cfg_parallel) -> int:
    """``cfg_parallel``: False/True (= 2) or the degree 1 / 2."""
    if cfg_parallel is None or cfg_parallel is False:
        return 1
    if cfg_parallel is True:
        return 2
    d = _as_int("cfg_parallel", cfg_parallel, 1)
    if d > 2:
        raise ParallelConfigError(f"cfg_parallel = {d} is not valid: CFG has two branches (cond, uncond); use true/2 or false/1")
    return d


@dataclass(frozen=True)
class ParallelPlan:
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.ulysses * self.ring * self.cfg

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def degrees(self) -> str:
        parts = [f"{k}={v}" for k, v in (("tp", self.tp), ("ulysses", self.ulysses), ("ring", self.ring), ("cfg", self.cfg)) if v > 1]
        return ", ".join(parts) or "single"

    def describe(self) -> str:
        return f"{self.world_size} ranks ({self.degrees()})"

    # -- rank layout ---------------------------------------------------------------------------
    def coords(self, rank: int) -> Tuple[int, int, int, int]:
        """rank -> (c, r, u, t)."""
        t = rank % self.tp
        u = (rank // self.tp) % self.ulysses
        r = (rank // (self.tp * self.ulysses)) % self.ring
        c = rank // (self.tp * self.ulysses * self.ring)
        return c, r, u, t

    def rank_of(self, c: int, r: int, u: int, t: int) -> int:
        return ((c * self.ring + r) * self.ulysses + u) * self.tp + t

    def groups(self) -> dict:
        """Every group of every kind, as sorted rank lists (the order torch.distributed sees them in).

        tp: vary t; ulysses: vary u; ring: vary r; sp: vary (r, u), ordered by sequence chunk
        r * ulysses + u; cfg: vary c."""
        C, R, U, T = self.cfg, self.ring, self.ulysses, self.tp
        g = {"tp": [], "ulysses": [], "ring": [], "sp": [], "cfg": []}
        for c in range(C):
            for r in range(R):
                for u in range(U):
                    g["tp"].append([self.rank_of(c, r, u, t) for t in range(T)])
        for c in range(C):
            for r in range(R):
                for t in range(T):
                    g["ulysses"].append([self.rank_of(c, r, u, t) for u in range(U)])
        for c in range(C):
            for u in range(U):
                for t in range(T):
                    g["ring"].append([self.rank_of(c, r, u, t) for r in range(R)])
        for c in range(C):
            for t in range(T):
                g["sp"].append([self.rank_of(c, r, u, t) for r in range(R) for u in range(U)])
        for r in range(R):
            for u in range(U):
                for t in range(T):
                    g["cfg"].append([self.rank_of(c, r, u, t) for c in range(C)])
        return g


def make_plan(tp=1, ulysses_degree=1, ring_degree=1, cfg_parallel=False, num_gpus=None) -> ParallelPlan:
    """Degrees -> plan, checking only what needs no model: integers, and that they multiply to
    ``num_gpus`` when it is given. ``num_gpus`` alone (all degrees 1) means Ulysses over all ranks."""
    tp = _as_int("tp", tp, 1)
    u = _as_int("ulysses_degree", ulysses_degree, 1)
    r = _as_int("ring_degree", ring_degree, 1)
    c = cfg_degree(cfg_parallel)
    n = None if num_gpus in (None, 0, "", "auto") else _as_int("num_gpus", num_gpus, 1)
    product = tp * u * r * c
    if n is not None and n != product:
        if product == 1:
            u = n  # only a GPU count: sequence parallel (Ulysses) over all of them
        else:
            raise ParallelConfigError(
                f"parallel degrees do not multiply to num_gpus: tp {tp} x ulysses_degree {u} x ring_degree {r} x "
                f"cfg {c} = {product}, but num_gpus = {n}. Set num_gpus to {product}, or change the degrees so that "
                f"their product is {n}")
    return ParallelPlan(tp=tp, ulysses=u, ring=r, cfg=c)


def check_model(plan: ParallelPlan, num_heads: int, ffn_hidden_size: int) -> None:
    """Heads and MLP width must split evenly: TP shards heads and the MLP, Ulysses the TP-local heads."""
    if num_heads % plan.tp:
        raise ParallelConfigError(
            f"tp = {plan.tp} does not divide the model's {num_heads} attention heads; choose tp from "
            f"{_divisors(num_heads)}")
    local = num_heads // plan.tp
    if local % plan.ulysses:
        extra = f" (the {local} heads each TP rank holds)" if plan.tp > 1 else ""
        raise ParallelConfigError(
            f"ulysses_degree = {plan.ulysses} does not divide the model's {num_heads} attention heads{extra}; choose "
            f"ulysses_degree from {_divisors(local)}, or put the remaining factor into ring_degree (any size works)")
    if ffn_hidden_size % plan.tp:
        raise ParallelConfigError(f"tp = {plan.tp} does not divide the MLP width {ffn_hidden_size}; choose tp from "
                                  f"{_divisors(ffn_hidden_size)}")


def visible_gpus() -> int:
    return device_rt.device_count()


def cpu_rank_limit() -> int:
    """Gloo ranks allowed on the CPU: one per CPU core this process may use, and always 2 (to try it out)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(2, cores)


def check_devices(plan: ParallelPlan, device: str, available: Optional[int] = None,
                  cpu_ranks: Optional[int] = None) -> str:
    """Backend for the device ("nccl" | "gloo"); refuses more ranks than the machine has GPUs (cuda)
    or CPU cores (cpu, where the ranks are gloo processes). ``available`` / ``cpu_ranks``: what the
    machine has, when the caller knows it."""
    dev = str(device).split(":")[0]
    n = plan.world_size
    if dev == "cuda":
        if available is None:
            available = visible_gpus()
        if n > available == 0:
            raise ParallelConfigError(
                f"num_gpus = {n} ({plan.degrees()}) needs {n} GPUs but this machine has no CUDA GPU; run on the CPU "
                f"(device cpu: the ranks run as gloo processes, at most {cpu_rank_limit()} here) or on a machine with GPUs")
        if n > available:
            raise ParallelConfigError(
                f"num_gpus = {n} ({plan.degrees()}) needs {n} GPUs but {available} are visible on this machine; lower "
                f"the degrees (num_gpus <= {available}), or launch across machines with torchrun (docs/parallel.md)")
        return "nccl"
    if dev == "cpu":
        limit = cpu_rank_limit() if cpu_ranks is None else cpu_ranks
        if n > limit:
            gpus = visible_gpus() if available is None else available
            where = ("this machine has no CUDA GPU" if gpus == 0 else
                     f"the engine runs on the CPU (device '{device}'; this machine has {gpus} CUDA GPU(s): use device cuda)")
            raise ParallelConfigError(
                f"num_gpus = {n} ({plan.degrees()}): {where}; on the CPU the ranks run as gloo processes, at most "
                f"{limit} here (one per CPU core). Use num_gpus <= {limit}, or a machine with {n} GPUs")
        return "gloo"
    raise ParallelConfigError(f"parallel runs support device cuda (NCCL) or cpu (gloo), not '{device}'")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
