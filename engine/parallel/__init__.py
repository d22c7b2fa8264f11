"""Several processes (GPUs) on one image: Ulysses and Ring sequence parallel, tensor parallel and
CFG parallel, run by a pool of worker processes (one per rank). See docs/parallel.md.

    from engine import EngineConfig, open_engine
    eng = open_engine(path, EngineConfig(device="cuda", ulysses_degree=2, ring_degree=2))  # a RankedRunner inside
    eng.sample(...)                    # the same loop as on one device
    eng.release()                      # unload the weights; the workers stop unless another engine uses them
    engine.parallel.shutdown_pools()   # stop every worker process

Errors (engine.errors): ``ParallelConfigError`` (bad degrees, before any worker starts),
``ParallelWorkerError`` (a worker died, failed or froze; the pool restarts on the next run).
"""
from ..errors import ParallelConfigError, ParallelWorkerError
from .plan import ParallelPlan, check_devices, check_model, make_plan
from .pool import WorkerPool, get_pool, shutdown_pools
from .ranked import RankedRunner, open_ranked_runner, plan_from_config, validate

__all__ = ["ParallelConfigError", "ParallelPlan", "ParallelWorkerError", "RankedRunner", "WorkerPool", "check_devices",
           "check_model", "get_pool", "make_plan", "open_ranked_runner", "plan_from_config", "shutdown_pools", "validate"]
