"""The combination matrix (issue 37, docs/parallel.md "Combinations"): every pair, and the triples users pick,
of the engine's features, each equal to its reference within the tolerance its features imply, for both families
(ERNIE-Image and Z-Image, issue 47: the features reach each through its description alone).

A combination's reference is the plain engine (the dense fp32 file in this process: no weight format, offload,
compile, ranks or batcher) computing what the combination asks for: the same Cache-DiT preset, the LoRA (merged),
the inpainting mask, and a batch as its samples run one at a time (``batch_index``). Its tolerance is the largest
of its features' own (``TOLERANCE``: float rounding for the features that only change how the work is done, a
weight format's noise for the format), as max abs error / max|reference| of the latent. Besides, each
combination shows its defining features took effect (Cache-DiT skipped the preset's calls; the LoRA moved the
result). Tiny random models (2 blocks, hidden 64; Z-Image's with a refiner each), fp32, 8 steps, CFG 3, under
torch.inference_mode() as ComfyUI
runs nodes. Compile is regional torch.compile with the aot_eager backend (the graphs and guards inductor gets,
without its C++ build: tests/test_compile.py times that). The parallel rows share one 2-rank gloo pool (its
start paid once) and one test: engines of every mode load their weights into it in turn.
"""
import itertools
import time

import pytest
import torch

from engine import EngineConfig, open_engine
from engine.features.cache import CacheConfig
from engine.features.compile import compile_blocks
from engine.features.quant import writer_for
from engine.models.random_weights import SIZES, save_random_checkpoint
from engine.serve import Batcher, Job

CFG = SIZES["tiny"]
STEPS = 8
CACHE = CacheConfig(preset="fast")  # a static step mask: the same calls skipped whatever the weights' noise
LORA_STRENGTH = 0.8
FORMATS = ("fp8", "int8", "int4", "q8_0", "nvfp4", "mxfp8", "int8-tensorwise", "convrot-w4a4",
           "asym-w4a8-int8")  # sgld files, GGUF, ComfyUI's
DEFINING = ("cache", "lora", "mask", "batch")  # what is computed: kept in the reference
EXECUTION = ("offload", "compile", "batching")  # how it is computed: the reference has none
PARALLEL = {"cfgp": dict(cfg_parallel=True), "ulysses": dict(ulysses_degree=2), "ring": dict(ring_degree=2),
            "tp": dict(tp=2)}
# max abs error / max|reference| a feature may add. Measured on this model (fp32, 8 steps): the execution features
# <= 6.7e-7 (parallel 1e-4 as tests/test_parallel.py); the formats' worst over all their combinations (TP
# included: int4 re-quantizes the row-parallel slices its groups cross) fp8 0.011, int8 0.0066, int4 0.035, q8_0
# 0.0025, nvfp4 0.044, mxfp8 0.015, int8-tensorwise 0.007, convrot-w4a4 0.049, asym-w4a8-int8 0.028 (with the
# LoRA; 0.01 without): tolerances about 3x those
TOLERANCE = {"offload": 1e-5, "compile": 1e-5, "batching": 1e-5, "cfgp": 1e-4, "ulysses": 1e-4, "ring": 1e-4,
             "tp": 1e-4, "fp8": 0.04, "int8": 0.02, "int4": 0.1, "q8_0": 0.01, "nvfp4": 0.15, "mxfp8": 0.05,
             "int8-tensorwise": 0.02, "convrot-w4a4": 0.15, "asym-w4a8-int8": 0.1}
for _f in DEFINING:
    TOLERANCE[_f] = 1e-5

IN_PROCESS = DEFINING + EXECUTION + FORMATS
PAIRS = [c for c in itertools.combinations(IN_PROCESS, 2) if not set(c) <= set(FORMATS)]  # a model has one format
TRIPLES = [("cache", "offload", "lora"), ("fp8", "compile", "cache"), ("batching", "cache", "lora"),
           ("int4", "offload", "lora"), ("nvfp4", "cache", "lora"), ("mask", "batch", "lora"),
           ("q8_0", "compile", "lora"), ("batching", "mask", "batch")]
# At this model's width (hidden 64) a row-parallel rank's inputs cut the rotation / scale groups of ComfyUI's
# 4-bit integer formats, which the loader refuses by name (tests/quant/test_comfy_int4_formats.py tests their splits
# and that refusal; the release's widths split on whole groups).
GROUPED = ("convrot-w4a4", "asym-w4a8-int8")
PARALLEL_PAIRS = [(p, f) for p in PARALLEL for f in DEFINING + ("offload", "batching") + FORMATS
                  if not (p == "tp" and f in GROUPED)]
PARALLEL_TRIPLES = [("tp", "q8_0", "lora"), ("cfgp", "cache", "lora"), ("tp", "fp8", "lora"),
                    ("ulysses", "cache", "offload"), ("ring", "mask", "lora"), ("tp", "batching", "cache")]


class ErnieImage:
    """The tiny ERNIE-Image model of engine/models/random_weights.py; the LoRA's A/B pairs on column-parallel
    (to_q, gate_proj), row-parallel (to_out, fc2) and whole (modulation) layers."""

    channels, text_dim, sides = CFG.in_channels, CFG.text_in_dim, (6, 5)  # odd sequences: sequence-parallel padding
    lora_scale = 0.3  # of the A and B entries
    formats = parallel_formats = FORMATS
    lora_targets = {"layers.0.self_attention.to_q": (CFG.hidden_size, CFG.hidden_size),
                    "layers.1.mlp.gate_proj": (CFG.ffn_hidden_size, CFG.hidden_size),
                    "layers.0.self_attention.to_out.0": (CFG.hidden_size, CFG.hidden_size),
                    "layers.1.mlp.linear_fc2": (CFG.hidden_size, CFG.ffn_hidden_size),
                    "adaLN_modulation.1": (6 * CFG.hidden_size, CFG.hidden_size)}

    @staticmethod
    def write(path):
        save_random_checkpoint(path, CFG, seed=0)


class ZImage:
    """tests/test_zimage.py's small Z-Image (diffusers' model, random weights) in diffusers' names; the LoRA on its
    column-parallel (to_q, w1), row-parallel (to_out, w2) and whole (adaLN) layers."""

    channels, text_dim, sides = 16, 24, (6, 4)  # 2x2 patches: even sides
    lora_scale = 0.8  # its LoRA moves the result well above convrot-w4a4's noise (0.3: 0.08 against 0.1)
    # the formats' code is the one ERNIE-Image's rows run through; what is Z-Image's own is its block linears, shard
    # dims and fused groups, which an sgld file, a GGUF, a grouped integer format and ComfyUI's two kinds (nvfp4,
    # convrot's rotation groups) cover in one process, a GGUF on ranks
    formats = ("fp8", "q8_0", "int4", "nvfp4", "convrot-w4a4")
    parallel_formats = ("q8_0",)
    lora_targets = {"layers.0.attention.to_q": (64, 64), "layers.1.feed_forward.w1": (170, 64),
                    "layers.0.attention.to_out.0": (64, 64), "layers.1.feed_forward.w2": (64, 170),
                    "layers.0.adaLN_modulation.0": (256, 64)}

    @staticmethod
    def write(path):
        from safetensors.torch import save_file
        from test_zimage import reference

        save_file({k: v.contiguous() for k, v in reference(seed=2).state_dict().items()}, path)


FAMILIES = {"ernie-image": ErnieImage, "z-image": ZImage}


@pytest.fixture(scope="module", params=list(FAMILIES))
def setup(request, tmp_path_factory):
    family = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp("matrix")
    dense = str(folder / "tiny.safetensors")
    family.write(dense)
    files = {None: dense}
    for fmt in FORMATS:
        writer = writer_for(fmt)
        files[fmt] = str(folder / f"tiny-{fmt}{writer.suffix}")
        writer.write(dense, files[fmt], fmt)
    g = torch.Generator().manual_seed(1)
    (h, w), c, t = family.sides, family.channels, family.text_dim
    # text of 7 / 4 / 3 tokens: masked text
    inputs = dict(cond=[torch.randn(7, t, generator=g), torch.randn(4, t, generator=g)],
                  uncond=[torch.randn(3, t, generator=g)],
                  image=torch.randn(2, c, h, w, generator=g), zeros=torch.zeros(2, c, h, w),
                  mask=(torch.arange(w) < 3).float().expand(1, 1, h, w).contiguous())
    lora = str(folder / "lora.safetensors")
    _write_lora(lora, family.lora_targets, family.lora_scale)
    with torch.inference_mode():
        plain = open_engine(dense, EngineConfig())
    plain.threads = 1
    return dict(files=files, inputs=inputs, lora=lora, plain=plain, refs={}, family=request.param)


def _write_lora(path, targets, scale):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    sd = {}
    for m, (o, i) in targets.items():
        sd[f"transformer.{m}.lora_A.weight"] = torch.randn(4, i, generator=g) * scale
        sd[f"transformer.{m}.lora_B.weight"] = torch.randn(o, 4, generator=g) * scale
    save_file(sd, path)


def _request(combo, inputs):
    """The sampling inputs of a combination: one sample or a batch of two (different prompts), text-to-image or
    img2img + inpainting (denoise 0.75, the right columns kept)."""
    b = 2 if "batch" in combo else 1
    kw = dict(seed=3, steps=STEPS, cfg=3.0, cache=CACHE if "cache" in combo else CacheConfig(enabled=False))
    if "mask" in combo:
        kw.update(latent=inputs["image"][:b], noise_mask=inputs["mask"], denoise=0.75)
    else:
        kw.update(latent=inputs["zeros"][:b])
    return dict(kw, cond=inputs["cond"][:b], uncond=inputs["uncond"])


def _sample(eng, combo, inputs):
    req = _request(combo, inputs)
    if "batching" not in combo:
        return eng.sample(req.pop("latent"), req.pop("cond"), req.pop("uncond"), **req)
    other = Job(latent=inputs["zeros"][0], cond=inputs["cond"][1], uncond=inputs["uncond"][0], seed=9, steps=STEPS + 1, cfg=2.0)
    batched = req["latent"].shape[0] > 1
    job = Job(latent=req.pop("latent") if batched else req.pop("latent")[0], cond=req.pop("cond") if batched else req.pop("cond")[0],
              uncond=req.pop("uncond")[0], **req)
    batcher = Batcher(eng, max_batch=8)
    try:
        futures = batcher.submit_many([job, other])  # joined forwards: the other job's rows ride along
        out = futures[0].result(timeout=120)
        futures[1].result(timeout=120)
    finally:
        batcher.close()
    return out if batched else out[None]


def _reference(setup, combo):
    """The plain engine running the combination's defining features (a batch: each sample alone, stacked)."""
    key = tuple(f for f in DEFINING if f in combo)
    if key not in setup["refs"]:
        plain, inputs = setup["plain"], setup["inputs"]
        plain.set_loras([(setup["lora"], LORA_STRENGTH)] if "lora" in key else [])
        req = _request(key, inputs)
        outs = []
        for i in range(req["latent"].shape[0]):
            one = dict(req, batch_index=[i])
            outs.append(plain.sample(one.pop("latent")[i:i + 1], [one.pop("cond")[i]], one.pop("uncond"), **one))
        setup["refs"][key] = torch.cat(outs)
    return setup["refs"][key]


def _check(setup, combo, out, eng):
    ref = _reference(setup, combo)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    tol = max(TOLERANCE[f] for f in combo)
    assert err <= tol, f"{'+'.join(combo)}: error {err:.3g} > {tol:g} against its reference"
    if "cache" in combo and "batching" not in combo:
        assert not all(eng.last_run.step_mask), f"{'+'.join(combo)}: Cache-DiT skipped nothing"
    if "lora" in combo:
        base = _reference(setup, tuple(f for f in combo if f != "lora"))
        moved = ((out - base).abs().max() / base.abs().max()).item()
        assert moved > max(3 * err, 1e-3), f"{'+'.join(combo)}: the LoRA moved the result by {moved:.3g} only"
    return err


def _config(combo):
    kw = dict(offload="layerwise", resident_layers=1) if "offload" in combo else {}
    for p in PARALLEL:
        if p in combo:
            kw.update(PARALLEL[p])
    return EngineConfig(**kw)


def _engine_key(combo):
    """What an engine is opened with: combinations that differ only in what they sample share one engine (as a
    loaded model serves many runs), its LoRA set before the first combination that has it."""
    fmt = next((f for f in FORMATS if f in combo), None)
    return fmt, "offload" in combo, "compile" in combo, tuple(p for p in PARALLEL if p in combo)


def _open(setup, combo):
    fmt = next((f for f in FORMATS if f in combo), None)
    eng = open_engine(setup["files"][fmt], _config(combo))
    eng.threads = 1  # tiny shapes: one thread (as the demo runs); two fight over a busy 2-core machine
    if "compile" in combo:
        compile_blocks(eng.model, "static", backend="aot_eager")
    return eng


def _run_all(setup, combos):
    errors, failures, engines, groups = {}, [], [], {}
    for combo in combos:
        groups.setdefault(_engine_key(combo), []).append(combo)
    for group in groups.values():
        eng = None
        for combo in sorted(group, key=lambda c: "lora" in c):  # the LoRA ones last: set once
            try:
                if eng is None:
                    eng = _open(setup, combo)
                    engines.append(eng)
                if "lora" in combo and not eng.loras:
                    eng.set_loras([(setup["lora"], LORA_STRENGTH)])
                errors[combo] = _check(setup, combo, _sample(eng, combo, setup["inputs"]), eng)
            except AssertionError as e:
                failures.append(str(e))
            except Exception as e:  # every combination's failure in one report
                failures.append(f"{'+'.join(combo)}: {type(e).__name__}: {str(e)[:300]}")
    for eng in engines:
        if eng.runner.model is None:  # ranks: released at the end (each load replaced the weights anyway)
            eng.release()
    return errors, failures


@pytest.mark.slow
def test_pairs_and_triples_in_one_process(setup):
    t0 = time.perf_counter()
    formats = FAMILIES[setup["family"]].formats
    combos = [c for c in PAIRS + TRIPLES if all(f in formats for f in c if f in FORMATS)]
    with torch.inference_mode():
        errors, failures = _run_all(setup, combos)
    torch._dynamo.reset()
    assert not failures, "\n".join(failures)
    assert len(errors) == len(combos) == {"ernie-image": 92, "z-image": 64}[setup["family"]]
    print(f"{len(errors)} combinations in {time.perf_counter() - t0:.1f} s; largest errors: "
          + ", ".join(f"{'+'.join(c)} {e:.2g}" for c, e in sorted(errors.items(), key=lambda kv: -kv[1])[:5]))


@pytest.mark.subprocess
def test_parallel_pairs_and_triples_on_two_gloo_ranks(setup):
    import engine.parallel.pool as pool_mod
    from engine.parallel import shutdown_pools

    saved = pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S
    pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = 120.0, 60.0, 60.0
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            keeper = open_engine(setup["files"][None], EngineConfig(ulysses_degree=2))  # one pool for every engine
            pids = keeper.runner.pids
            formats = FAMILIES[setup["family"]].parallel_formats
            combos = [c for c in PARALLEL_PAIRS + PARALLEL_TRIPLES if all(f in formats for f in c if f in FORMATS)]
            errors, failures = _run_all(setup, combos)
            same_pool = keeper.runner.pids == pids
            keeper.release()
    finally:
        shutdown_pools()
        pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = saved
    assert not failures, "\n".join(failures)
    assert same_pool  # the same two processes served every combination
    assert len(errors) == len(combos) == {"ernie-image": 64, "z-image": 33}[setup["family"]]
    print(f"{len(errors)} parallel combinations in {time.perf_counter() - t0:.1f} s")


def test_full_difference_lora_on_every_weight_format(setup, tmp_path):
    """A ``.diff`` LoRA (a full weight difference) on a quantized layer is a side path (it was refused): it equals
    the low-rank LoRA whose B @ A is that difference, on every format."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    family = FAMILIES[setup["family"]]
    m, h = next(iter((k, o) for k, (o, i) in family.lora_targets.items() if "to_out" in k))
    a, b = torch.randn(4, h, generator=g) * 0.3, torch.randn(h, 4, generator=g) * 0.3
    diff, pair = str(tmp_path / "diff.safetensors"), str(tmp_path / "pair.safetensors")
    save_file({f"diffusion_model.{m}.diff": b @ a}, diff)
    save_file({f"diffusion_model.{m}.lora_A.weight": a, f"diffusion_model.{m}.lora_B.weight": b}, pair)
    x = (torch.randn(1, family.channels, 4, 4, generator=g), torch.tensor([500.0]),
         torch.randn(1, 5, family.text_dim, generator=g), torch.tensor([5]))
    with torch.inference_mode():
        for fmt in FORMATS:
            eng = open_engine(setup["files"][fmt], EngineConfig())
            base = eng.model(*x)
            eng.set_loras([(pair, 0.7)])
            want = eng.model(*x)
            eng.set_loras([(diff, 0.7)])
            got = eng.model(*x)
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, fmt
            assert ((want - base).abs().max() / base.abs().max()).item() > 1e-3, fmt
            eng.set_loras([])
            assert torch.equal(eng.model(*x), base), fmt


def test_a_tensor_parallel_rank_keeps_its_slice_of_every_kind_of_update():
    """engine/features/lora/shard.py on each kind of update: the rank's entry makes exactly its rows (column
    parallel) or columns (row parallel) of the whole dW; a LoKr cut between whole blocks of its second factor stays
    a Kronecker product, one cut inside them becomes a full term."""
    from engine.features.lora import LoRAEntry
    from engine.features.lora import lycoris as L
    from engine.features.lora.shard import cut_entry

    g = torch.Generator().manual_seed(3)

    def rnd(*s):
        return torch.randn(*s, generator=g)

    def delta(e):
        if e.diff is not None:
            return e.diff.reshape(e.diff.shape[0], -1).float()
        if e.lycoris is not None:
            return e.lycoris.rows(torch.device("cpu"))(0, e.lycoris.out_features) * e.scale
        return e.up.float() @ e.down.float() * e.scale

    out, inp = 12, 8
    entries = {
        "low_rank": LoRAEntry("m", down=rnd(3, inp), up=rnd(out, 3), alpha=1.5),
        "diff": LoRAEntry("m", diff=rnd(out, inp)),
        "lokr_kron": LoRAEntry("m", lycoris=L.build("lokr", 0, {"lokr_w1": rnd(2, 2), "lokr_w2": rnd(6, 4)}, None, (out, inp))),
        "lokr_full_term": LoRAEntry("m", lycoris=L.build("lokr", 2, {"lokr_w1": rnd(3, 2), "lokr_w2_a": rnd(4, 2),
                                                                     "lokr_w2_b": rnd(2, 4)}, 3.0, (out, inp))),
        "loha": LoRAEntry("m", lycoris=L.build("loha", 2, {"hada_w1_a": rnd(out, 2), "hada_w1_b": rnd(2, inp),
                                                           "hada_w2_a": rnd(out, 2), "hada_w2_b": rnd(2, inp)}, 1.0, (out, inp))),
        "loha_tucker": LoRAEntry("m", lycoris=L.build("loha", 2, {
            "hada_w1_a": rnd(2, out), "hada_w1_b": rnd(2, inp), "hada_t1": rnd(2, 2, 1, 1),
            "hada_w2_a": rnd(2, out), "hada_w2_b": rnd(2, inp), "hada_t2": rnd(2, 2, 1, 1)}, 1.0, (out, inp))),
    }
    for kind, e in entries.items():
        whole = delta(e)
        for dim in (0, 1):
            for index in range(2):
                part = cut_entry(e, (dim, 2, index))
                want = whole.chunk(2, dim=dim)[index]
                assert torch.allclose(delta(part), want, rtol=1e-5, atol=1e-5), (kind, dim, index)
                if kind.startswith("lokr") and dim == 0:  # 6 rows a rank: whole blocks of w2's 6 rows, or not (4)
                    assert part.lycoris.t["lokr_w1"].shape == ((1, 2) if kind == "lokr_kron" else (1, 1))
