"""Per-request LoRAs in the batcher (engine/features/lora/rows.py, engine/serve/batcher.py), on the tiny model in
fp32: jobs with different LoRA sets (LoRA, LoKr, several at once, none) share each forward, each sample's side
path on its own rows, the base weights untouched; each job's latent equals its own sequential ``Engine.sample``
with its LoRAs merged (``Engine.set_loras``) within TOLERANCE x max|ref|. With the engine's own set merged, a job
without ``lora_set`` gets that set, a job with its own set gets only its own. The distinct LoRAs of one forward
are bounded (the others wait), the cache evicts the least recently used past its budget."""
import pytest
import torch
from lora_files import CFG, make_pairs, tiny_engine, weights_hash, write_lora
from lycoris_files import lycoris_file

from engine import InputError
from engine.features import patching
from engine.serve import Batcher, Job

TOLERANCE = 1e-5
LINEARS = ["layers.0.self_attention.to_q", "layers.1.self_attention.to_out.0", "layers.0.mlp.gate_proj",
           "layers.1.mlp.linear_fc2", "adaLN_modulation.1", "text_proj"]
WAIT = 60


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("row_loras")
    return {"a": write_lora(d / "a.safetensors", make_pairs(LINEARS, seed=1), "diffusers", dtype=torch.float32),
            "b": write_lora(d / "b.safetensors", make_pairs(LINEARS[2:] + ["layers.1.self_attention.to_v"], rank=2, seed=2),
                            "kohya", alpha=1.0, dtype=torch.float32),
            "lokr": lycoris_file(d / "lokr.safetensors", "lokr_decomposed", LINEARS[:4], seed=3)[0],
            "conv": write_lora(d / "conv.safetensors", make_pairs(["x_embedder.proj"], seed=4), "diffusers")}


def job(i, lora_set=None, steps=4, cfg=2.0):
    g = torch.Generator().manual_seed(i)
    cond, uncond = torch.randn(3 + i, CFG.text_in_dim, generator=g), torch.randn(2, CFG.text_in_dim, generator=g)
    return Job(latent=torch.zeros(CFG.in_channels, 4, 4), cond=cond, uncond=uncond, seed=10 + i, steps=steps, cfg=cfg, lora_set=lora_set)


def engine(quant=None):
    """The tiny fp32 engine on one CPU thread (its GEMMs are too small to share; a shared machine's spare core is not
    there to wait for)."""
    eng = tiny_engine(torch.float32, quant=quant)
    eng.threads = 1
    return eng


def sequential(eng, j: Job, loras) -> torch.Tensor:
    """The job alone through Engine.sample with ``loras`` merged."""
    eng.set_loras(loras)
    try:
        return eng.sample(j.latent[None], [j.cond], [j.uncond], seed=j.seed, steps=j.steps, cfg=j.cfg)[0]
    finally:
        eng.set_loras([])


def rel_err(got, ref) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_different_loras_share_forwards_and_each_equals_its_sequential_run(files, quant):
    """fp8: the block linears are quantized, so the sequential runs' LoRAs are the merged set's side path too."""
    eng = engine(quant)
    sets = [[(files["a"], 0.8)], [(files["b"], 1.0), (files["a"], -0.5)], [(files["lokr"], 0.6)], None, []]
    jobs = [job(i, s) for i, s in enumerate(sets)]
    with torch.inference_mode():
        refs = [sequential(eng, job(i), s or []) for i, s in enumerate(sets)]
        plain = [sequential(eng, job(i), []) for i in (0, 2)]
        base = weights_hash(eng.model)
        batcher = Batcher(eng, max_batch=16)
        try:
            got = [f.result(WAIT) for f in batcher.submit_many(jobs)]
            stats = batcher.stats()
        finally:
            batcher.close()
    assert stats["samples_per_forward"] == 10  # five jobs of two rows (CFG) in every forward
    for i, (g, r) in enumerate(zip(got, refs)):
        assert rel_err(g, r) <= TOLERANCE, (i, rel_err(g, r))
    assert rel_err(refs[0], plain[0]) > 1e-3 and rel_err(refs[2], plain[1]) > 1e-3  # the LoRAs change the latents
    assert weights_hash(eng.model) == base  # no merge: the base weights were never touched
    metrics = batcher.loras.metrics()["loras"]
    assert metrics["a.safetensors"]["forwards"] == 4 and metrics["a.safetensors"]["samples"] == 4 * 4


def test_the_engines_merged_set_is_the_default_and_comes_off_for_own_sets(files):
    eng = engine()
    with torch.inference_mode():
        batcher = Batcher(eng, max_batch=16)
        try:
            merged = batcher.loras.read(files["a"])  # the server reads its active set through the cache
            eng.set_loras([(merged, 0.7)])
            got = [f.result(WAIT) for f in batcher.submit_many([job(0), job(1, [(files["b"], 1.0)]), job(2, []),
                                                              job(3, [(files["a"], 0.7)])])]
        finally:
            batcher.close()
        eng.set_loras([])
        refs = [sequential(eng, job(0), [(files["a"], 0.7)]), sequential(eng, job(1), [(files["b"], 1.0)]),
                sequential(eng, job(2), []), sequential(eng, job(3), [(files["a"], 0.7)])]
    for i, (g, r) in enumerate(zip(got, refs)):
        assert rel_err(g, r) <= TOLERANCE, (i, rel_err(g, r))
    counts = batcher.loras.metrics()["loras"]
    # a comes off the rows of jobs 1 and 2 only (job 3 asked for exactly the merged set: no side path on its rows)
    assert counts["a.safetensors"]["samples"] == 4 * 4 and counts["b.safetensors"]["samples"] == 2 * 4


def test_distinct_loras_per_forward_are_bounded_and_the_cache_evicts(files):
    eng = engine()
    with torch.inference_mode():
        probe = Batcher(eng, max_loras=2)
        try:
            with pytest.raises(InputError, match="loras: .*3 distinct LoRAs.*more than the 2"):
                probe.submit(job(0, [(files["a"], 1.0), (files["b"], 1.0), (files["lokr"], 1.0)]))
            with pytest.raises(InputError, match="loras: .*convolution 'x_embedder.proj'"):
                probe.submit(job(0, [(files["conv"], 1.0)]))
            with pytest.raises(InputError, match="loras: .*not a finite number"):
                probe.submit(job(0, [(files["a"], float("nan"))]))
            costs = [probe.loras.entry(files[k]).cost for k in "ab"]  # a file and its resident terms
            budget = max(costs) + 1  # either alone, not both
        finally:
            probe.close()
        ref = [sequential(eng, job(i), [(files[k], 1.0)]) for i, k in enumerate("ab")]
        batcher = Batcher(eng, max_batch=16, max_loras=1, lora_budget_bytes=budget)
        try:
            got = [f.result(WAIT) for f in batcher.submit_many([job(0, [(files["a"], 1.0)]), job(1, [(files["b"], 1.0)])])]
            stats, m = batcher.stats(), batcher.loras.metrics()
        finally:
            batcher.close()
    assert sum(costs) > budget
    assert stats["samples_per_forward"] == 2  # one LoRA per forward: the second job waited, it was not refused
    assert all(rel_err(g, r) <= TOLERANCE for g, r in zip(got, ref))
    assert m["loras"]["a.safetensors"]["evictions"] == 1 and m["loras"]["b.safetensors"]["resident"]
    assert m["resident"] == 1
    assert "lora_rows" not in patching.attached(eng.model) and not any(  # closed: no term left on the model
        patching.feature_state(mod, "lora") for mod in eng.model.modules())
