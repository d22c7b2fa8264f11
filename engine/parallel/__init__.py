"""Several processes (GPUs) on one image: Ulysses and Ring sequence parallel, tensor parallel and
CFG parallel, run by a pool of worker processes (one per rank). See docs/parallel.md.

Public API::

    from engine import Engine, EngineConfig
    eng = Engine.from_file(path, EngineConfig(device="cuda", ulysses_degree=2, ring_degree=2))  # -> ParallelEngine
    eng.sample(...)            # the same contract as the single-process Engine
    eng.close()                # unload the weights; the workers stop unless another engine uses them
    engine.parallel.shutdown_pools()   # stop every worker process

Errors: ``ParallelConfigError`` (bad degrees, before any worker starts), ``ParallelWorkerError``
(a worker died, failed or froze; the pool restarts on the next run).
"""
from .plan import ParallelConfigError, ParallelPlan, check_devices, check_model, make_plan
from .pool import ParallelWorkerError, WorkerPool, get_pool, shutdown_pools
from .engine import ParallelEngine, plan_from_config, validate

__all__ = ["ParallelConfigError", "ParallelPlan", "ParallelWorkerError", "ParallelEngine", "WorkerPool", "check_devices",
           "check_model", "get_pool", "make_plan", "plan_from_config", "shutdown_pools", "validate"]
