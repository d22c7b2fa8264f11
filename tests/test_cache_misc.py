"""Cache-DiT: CLI flags, speedup statistics, generated docs."""
import argparse
import importlib.util
import json
import os
import sys

import pytest

from engine.cli.common import add_cache_arguments, cache_config
from engine.features.cache import MEASURED_PATH, CacheConfig, CacheConfigError, estimated_speedup, measured_speedup
from tools.cache_docs import render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(*argv):
    p = argparse.ArgumentParser()
    add_cache_arguments(p)
    return cache_config(p.parse_args(list(argv)))


def test_cli_flags():
    assert parse() is None  # no flag: the environment decides
    assert parse("--cache", "off") == CacheConfig(enabled=False)
    c = parse("--cache-preset", "Fast", "--cache-taylorseer", "off", "--cache-mc", "2")
    assert c.enabled and c.preset_name == "fast" and c.taylorseer is False and c.mc == 2
    assert parse("--cache", "on") == CacheConfig()
    with pytest.raises(CacheConfigError) as err:
        parse("--cache-preset", "turbo")
    assert "--cache-preset='turbo'" in str(err.value) and "balanced" in str(err.value)
    with pytest.raises(CacheConfigError) as err:
        parse("--cache-policy", "never")
    assert "--cache-policy" in str(err.value) and "static, dynamic" in str(err.value)


def test_speedups():
    assert measured_speedup([1.0, 1.0, 1.0, 0.25, 1.0], [True, True, True, False, True]) == pytest.approx(5 / 4.25, abs=1e-3)
    assert measured_speedup([], []) is None
    assert measured_speedup([1.0], [True]) == 1.0
    assert estimated_speedup([True, False], 1, 0, 4) == pytest.approx(2 / 1.25)


def test_docs_are_generated_from_the_code():
    with open(os.path.join(ROOT, "docs", "cache_dit.md")) as f:
        assert f.read() == render(), "docs/cache_dit.md is stale: run python -m tools.cache_docs docs/cache_dit.md"
    text = render()
    for n in (8, 20, 28, 50):
        assert f"{n} steps" in text
    assert "SGLANG_CACHE_DIT_SCM_PRESET" in text and "Below 4 steps every preset computes every step" in text
    assert "cache preset '" not in text  # a run's warning is not pasted in as a sentence


def test_run_line():
    from engine.engine import RunStats
    from engine.features.cache import run_line

    st = RunStats(steps=4, model_calls=4, step_mask=[True, False, True, True], call_seconds=[1.0, 0.1, 1.0, 1.0],
                  cache={"preset": "fast", "computed": 3, "cached": 1, "calls": 4, "mask": "1011", "note": None})
    line = run_line(st)
    assert line.startswith("Cache-DiT fast: 3/4 model calls computed (1 cached), measured 1.2") and "mask 1011" in line
    assert run_line(RunStats(steps=2, model_calls=2, step_mask=[True, True])) == "Cache-DiT off: 2/2 model calls computed"


def test_shipped_preset_figures_are_the_bench_tables():
    """engine/features/cache/measured.json ships (the Cache-DiT node's tooltip reads it; bench/ does not ship):
    it must be what bench/speed/cache_bench.py derives from the committed tables (``--merge`` rewrites it)."""
    spec = importlib.util.spec_from_file_location("cache_bench", os.path.join(ROOT, "bench", "speed", "cache_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules["cache_bench"] = bench  # its dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
        rows = {}
        for name in ("cache_results_random.json", "cache_results_demo.json"):
            with open(os.path.join(ROOT, "bench", "speed", name)) as f:
                rows.update(json.load(f))
        derived = json.loads(json.dumps(bench.measured(rows)))
    finally:
        sys.modules.pop("cache_bench", None)
    with open(MEASURED_PATH) as f:
        assert json.load(f) == derived, ("run: python bench/speed/cache_bench.py --merge bench/speed/cache_results_random.json "
                                              "bench/speed/cache_results_demo.json")
