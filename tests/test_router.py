"""The router opens every engine: a model already in memory (benchmarks, the ranks' workers) gets the features
its EngineConfig asks for there too, parallel degrees on such a model are refused with a clear error, and the
torchrun launch (real torch.distributed.run, 2 gloo ranks on the CPU) opens its engine through it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, open_engine
from engine.errors import ParallelConfigError
from engine.features import patching
from engine.features import quant as Q
from engine.local import LocalRunner
from engine.models.random_weights import SIZES, random_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_model_in_memory_opens_through_the_router_with_its_features():
    model = random_model(SIZES["tiny"], seed=0)
    eng = open_engine(model, EngineConfig(quant="fp8", attention="math"), label="random:tiny")
    assert isinstance(eng.runner, LocalRunner) and eng.model is model
    assert Q.model_quant_format(model) == "fp8" and patching.get(model, "attention").describe()["backend"] == "math"
    assert eng.source == "random:tiny" and open_engine(random_model(SIZES["tiny"], seed=0)).source == ""
    latent = torch.zeros(1, SIZES["tiny"].in_channels, 4, 4)
    out = eng.sample(latent, [torch.randn(3, SIZES["tiny"].text_in_dim)], None, seed=0, steps=2, cfg=1.0)
    assert out.shape == latent.shape and torch.isfinite(out).all()


def test_parallel_degrees_on_a_model_in_memory_are_refused():
    with pytest.raises(ParallelConfigError, match="a model in memory runs in this process; 2 ranks load their weights "
                                                  "from a file"):
        open_engine(random_model(SIZES["tiny"], seed=0), EngineConfig(ulysses_degree=2, device="cpu"))


@pytest.mark.subprocess
def test_the_torchrun_launch_runs_two_ranks(tmp_path):
    out = tmp_path / "latent.safetensors"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "engine.parallel.launch", "--size", "tiny", "--device", "cpu", "--ulysses-degree", "2", "--random-text", "4",
         "--steps", "2", "--width", "64", "--height", "64", "--out", str(out)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert report["parallel"] == "2 ranks (ulysses=2)" and report["model_calls"] == 2 and report["warnings"] == []
    latent = load_file(str(out))["latent"]
    assert latent.shape == (1, SIZES["tiny"].in_channels, 4, 4) and torch.isfinite(latent).all()
