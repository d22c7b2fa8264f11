"""LoRA hardening (issue 17, items 2, 4, 9 and 11).

* A failed or interrupted apply rolls back to the base bit-exactly (SIGALRM -> KeyboardInterrupt at
  random moments, also between row chunks of one layer; an exception injected at each layer), and the
  engine knows which layers are touched at every moment.
* ``alpha_pattern`` keys from a file are plain module-name patterns, never regexes (a ReDoS pattern is
  refused at once, checked in subprocesses with a timeout); plain ones still follow PEFT's semantics.
* Non-finite strengths, alphas and LoRA weights are refused with a message naming the file / key.
* The SGLDiffusion LoRA Loader on a 2-rank (gloo) model in a real ComfyUI server.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from lora_files import BLOCK_LINEARS, CFG, MODULES, inputs, make_pairs, text_features, tiny_engine, write_lora
from safetensors.torch import save_file

import engine.features.lora as lora_mod
import engine.features.lora.peft as peft_mod
import engine.features.lora.records as records_mod
from engine import EngineConfig, open_engine
from engine.features import patching
from engine.features.lora import LoRAError, LoRAState, normalize, parse_spec, read_lora, target_modules
from engine.models.random_weights import random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LORA_DIR = os.path.dirname(lora_mod.__file__)  # the package engine/features/lora
ALL_MODULES = sorted(set(MODULES) | set(BLOCK_LINEARS))


# -- helpers ---------------------------------------------------------------------------------------------------
def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differing(model, ref: dict) -> list:
    """Names of the state_dict entries whose bits differ from ``ref``."""
    return [k for k, v in model.state_dict().items() if not torch.equal(_bits(v), _bits(ref[k]))]


def side_paths(model) -> list:
    """Checkpoint names of the linears with a LoRA side path (a fused q/k/v or gate/up module: its parts')."""
    out = []
    for n, m in model.named_modules():
        side = patching.feature_state(m, "lora")
        if type(m).__name__.endswith("WithLoRA") or side is not None:
            out += list(side.parts if side is not None else [n])
    return out


def assert_base(eng, base: dict):
    """Every weight equals the base bit for bit, no side path, and the engine says no LoRA is active."""
    assert differing(eng.model, base) == []
    assert side_paths(eng.model) == []
    assert patching.get(eng.model, "lora") is None  # no LoRA state: nothing applied, no record, no side path
    assert eng.loras == [] and eng.lora_report == []


def lora_files(tmp_path):
    """Two LoRAs on every block linear and the other adapted layers (ranks 4 and 8, kohya and PEFT)."""
    a = write_lora(tmp_path / "a.safetensors", make_pairs(ALL_MODULES, rank=4, seed=21), "kohya", alpha=8.0)
    b = write_lora(tmp_path / "b.safetensors", make_pairs(ALL_MODULES[::2], rank=8, seed=22), "diffusers")
    return a, b


def engine_for(case: str):
    """``case``: bf16 (UlpDiff records), fp32 (copies), bf16-copy (SGLD_LORA_RESTORE=copy, set by the caller),
    fp8 (side paths on the block linears), offload (layer-wise, bf16)."""
    if case == "fp8":
        return tiny_engine(torch.float32, quant="fp8")
    if case == "offload":
        eng = tiny_engine(torch.bfloat16, offload="layerwise", resident_layers=1)
        assert eng.offload is not None
        return eng
    return tiny_engine(torch.float32 if case == "fp32" else torch.bfloat16)


# -- item 2: transactional apply -------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Hundreds of applies of tiny matrices: one thread is several times faster on the shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Injected(BaseException):
    """Not an Exception: the rollback must handle every BaseException (KeyboardInterrupt, SystemExit...)."""


LAYER_STEPS = ((records_mod, "restore"), (records_mod, "merge"), (LoRAState, "_set_side"), (LoRAState, "_remove_side"))
# what apply does to one layer: the record arithmetic (engine/features/lora/records.py) and LoRAState's side paths


def _patch_layer_steps(monkeypatch, on_call):
    """Wrap the per-layer steps; ``on_call(step, when, state)`` runs before and after each (state: the
    LoRAState for its methods, None for the record functions)."""
    for owner, step in LAYER_STEPS:
        raw = getattr(owner, step)
        if owner is records_mod:
            def wrapper(*a, _orig=raw, _step=step, **k):
                on_call(_step, "before", None)
                out = _orig(*a, **k)
                on_call(_step, "after", None)
                return out
        else:
            def wrapper(self, *a, _orig=raw, _step=step, **k):
                on_call(_step, "before", self)
                out = _orig(self, *a, **k)
                on_call(_step, "after", self)
                return out

        monkeypatch.setattr(owner, step, wrapper)


@pytest.mark.parametrize("switch", [False, True], ids=["from_base", "switch"])
@pytest.mark.parametrize("case", ["bf16", "fp32", "bf16-copy", "fp8", "offload", "bf16-inference"])
def test_exception_at_each_layer_rolls_back_to_the_base(tmp_path, monkeypatch, one_thread, case, switch):
    """An exception injected before and after each layer step (restore of the old set, merge, side path)
    leaves every weight equal to the base bit for bit; the touched layers are always recorded; the state is
    then "no LoRA"; set_loras([]) keeps the base; applying again gives the uninterrupted result."""
    if case == "bf16-copy":
        monkeypatch.setenv("SGLD_LORA_RESTORE", "copy")
    eng = engine_for(case)
    model = eng.model
    ctx = torch.inference_mode if case == "bf16-inference" else torch.no_grad
    a, b = lora_files(tmp_path)
    start = [(a, 1.0)] if switch else []
    target = [(b, 0.7), (a, -0.4)] if switch else [(a, 0.7), (b, 0.3)]
    x = inputs()
    with ctx():
        y_base = model(*x)
        base = snapshot(model)
        eng.set_loras(target)
        merged = snapshot(model)
        y_merged = model(*x)
        eng.set_loras([])
    assert differing(model, base) == [] and not torch.equal(y_merged, y_base)
    # the sequence of layer steps of an uninterrupted apply
    calls = []
    with ctx():
        eng.set_loras(start)
        _patch_layer_steps(monkeypatch, lambda step, phase, st: calls.append(step) if phase == "before" else None)
        eng.set_loras(target)
        monkeypatch.undo()
        eng.set_loras([])
    if case == "bf16-copy":
        monkeypatch.setenv("SGLD_LORA_RESTORE", "copy")
    n_steps = len(calls)
    assert n_steps >= len(ALL_MODULES)
    if case == "fp8":
        assert "_set_side" in calls and "merge" in calls
    if switch and case in ("bf16", "offload", "bf16-inference"):  # the old set's compact records are undone first
        assert "restore" in calls

    for k in range(n_steps):
        for when in ("before", "after"):
            count = {"n": 0}

            def inject(step, phase, st, k=k, when=when, count=count):
                if phase == "before":
                    count["n"] += 1
                if phase == when and count["n"] - 1 == k and not count.get("fired"):
                    count["fired"] = True
                    state = patching.get(model, "lora")
                    changed = {n.rsplit(".", 1)[0] for n in differing(model, base)} | set(side_paths(model))
                    touched = set(state.backups) | set(state.side_paths)  # what the engine knows is touched
                    assert changed <= touched, (k, when, changed - touched)
                    raise Injected(f"layer step {k} ({step}, {when})")

            with ctx():
                eng.set_loras(start)
                _patch_layer_steps(monkeypatch, inject)
                with pytest.raises(Injected):
                    eng.set_loras(target)
                monkeypatch.undo()
                if case == "bf16-copy":
                    monkeypatch.setenv("SGLD_LORA_RESTORE", "copy")
                assert_base(eng, base)
                eng.set_loras([])
                assert_base(eng, base)
                if case == "offload":  # the layer buffers hold the restored masters, not merged weights
                    assert torch.equal(model(*x), y_base)
            assert count.get("fired"), (k, when)
    with ctx():
        eng.set_loras(target)
        assert differing(model, merged) == []
        assert torch.equal(model(*x), y_merged)
        eng.set_loras([])
    assert differing(model, base) == []


class AlarmInterrupt:
    """SIGALRM handler: raises KeyboardInterrupt only when the signal lands inside ``LoRAState.apply`` (or
    what it calls), and notes where: the innermost function of engine/features/lora/, its row index (``i`` in a
    merge, ``lo`` in a restore), and whether the change of the weights had begun (``_change`` running)."""

    def __init__(self):
        self.where = None

    def __call__(self, signum, frame):
        frames, f = [], frame
        while f is not None:
            if os.path.dirname(f.f_code.co_filename) == LORA_DIR:
                frames.append(f)
            f = f.f_back
        names = [fr.f_code.co_name for fr in frames]
        if "apply" in names:
            inner = frames[0]
            self.where = (names[0], inner.f_locals.get("i"), inner.f_locals.get("lo"), "_change" in names)
            raise KeyboardInterrupt
        self.where = None


def _interrupted_set_loras(eng, loras, delay: float, handler: AlarmInterrupt):
    """set_loras with a one-shot SIGALRM after ``delay`` seconds; returns where it was interrupted, or None."""
    previous = signal.signal(signal.SIGALRM, handler)
    handler.where = None
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, delay)
            eng.set_loras(loras)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        assert handler.where is not None
        return handler.where
    finally:
        signal.signal(signal.SIGALRM, previous)
    return None


@pytest.mark.parametrize("switch", [False, True], ids=["from_base", "switch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_keyboard_interrupt_at_random_moments_restores_the_base(tmp_path, monkeypatch, one_thread, dtype, switch):
    """SIGALRM -> KeyboardInterrupt at random moments of an apply (tiny merge chunks, so interrupts land
    between the row chunks of one layer). An interrupt while the weights change: afterwards every weight
    equals the base bit for bit and the engine says no LoRA; set_loras([]) keeps it so; applying again gives
    the uninterrupted result. An interrupt in apply's few statements around the change (before it began or
    after it ended): the engine holds exactly the set it reports (the old one, none or the new one)."""
    monkeypatch.setattr(records_mod, "MERGE_CHUNK_BYTES", 2048)  # 8 rows of 64 float32 per chunk: 8-48 chunks a layer
    eng = tiny_engine(dtype)
    model = eng.model
    a, b = lora_files(tmp_path)
    start = [(a, 1.0)] if switch else []
    target = [(b, 0.7), (a, -0.4)] if switch else [(a, 0.7), (b, 0.3)]
    base = snapshot(model)
    eng.set_loras(start)
    at_start = snapshot(model)
    eng.set_loras(target)
    merged = snapshot(model)
    eng.set_loras([])
    durations = []
    for _ in range(3):
        eng.set_loras(start)
        t0 = time.perf_counter()
        eng.set_loras(target)
        durations.append(time.perf_counter() - t0)
        eng.set_loras([])
    span = sorted(durations)[1]  # the interrupts are spread over one apply's duration
    rng = random.Random(1234)
    handler = AlarmInterrupt()
    during, around = [], []
    trials = 0
    while trials < 200:
        trials += 1
        eng.set_loras(start)
        where = _interrupted_set_loras(eng, target, rng.uniform(1e-4, span), handler)
        if where is None:  # the apply finished first
            assert differing(model, merged) == [] and eng.loras == target
        elif not where[3]:
            around.append(where)
            held = {(): base, tuple(start): at_start, tuple(target): merged}[tuple(eng.loras)]
            assert differing(model, held) == [] and side_paths(model) == []
        else:
            during.append(where)
            assert_base(eng, base)
            eng.set_loras([])
            assert_base(eng, base)
            eng.set_loras(target)
            assert differing(model, merged) == []
        eng.set_loras([])
        assert differing(model, base) == []
        mid_layer = [w for w in during if w[0] == "merge" and w[1]]
        mid_restore = [w for w in during if w[0] == "restore" and w[2]]
        if trials >= 30 and len(mid_layer) >= 5 and (mid_restore or not (switch and dtype == torch.bfloat16)):
            break
    print(f"\n{trials} trials: {len(during)} interrupted while the weights changed ({len(mid_layer)} between row "
          f"chunks of a merge, {len(mid_restore)} of a restore), {len(around)} in apply around the change")
    assert len(mid_layer) >= 5
    if switch and dtype == torch.bfloat16:  # switching restores the old set's compact records first
        assert mid_restore


def test_a_lora_read_against_another_model_is_refused_before_anything_changes(tmp_path):
    """A LoRAFile read against a bigger model, passed to set_loras of a smaller one: a LoRAError naming the
    layer, and nothing changed (the previous set stays active)."""
    import dataclasses

    big = random_model(dataclasses.replace(CFG, hidden_size=128, num_attention_heads=8), seed=0)
    pairs = {"layers.0.self_attention.to_q": (torch.randn(4, 128), torch.randn(128, 4))}
    other = read_lora(write_lora(tmp_path / "big.safetensors", pairs, "diffusers"), big)
    eng = tiny_engine(torch.bfloat16)
    a, _ = lora_files(tmp_path)
    eng.set_loras([(a, 1.0)])
    before = snapshot(eng.model)
    with pytest.raises(LoRAError, match=r"big.safetensors: the update of layer 'layers.0.self_attention.to_q' is "
                                        r"\[128, 128\] but the layer's weight is \(64, 64\)"):
        eng.set_loras([(a, 0.5), (other, 1.0)])
    assert differing(eng.model, before) == [] and eng.loras == [(a, 1.0)]


@pytest.mark.subprocess
def test_parallel_engine_is_the_base_after_a_refused_set(tmp_path):
    """A parallel engine's set_loras: a worker's refusal leaves every rank at the base and the parent says so, so a
    later set of the same LoRAs is sent again (not skipped as "already active")."""
    import engine.parallel.pool as pool_mod
    from engine.models.random_weights import save_random_checkpoint
    from engine.parallel import shutdown_pools

    pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = 120.0, 60.0, 60.0
    path = str(tmp_path / "tiny.safetensors")
    save_random_checkpoint(path, CFG, seed=0)
    a, _ = lora_files(tmp_path)
    bad = str(tmp_path / "bad.safetensors")
    save_file({"diffusion_model.layers.0.self_attention.to_q.lora_A.weight": torch.zeros(4, CFG.hidden_size),
               "diffusion_model.layers.0.self_attention.to_q.lora_B.weight": torch.zeros(2 * CFG.hidden_size, 4)}, bad)
    x = dict(latent=torch.zeros(1, CFG.in_channels, 4, 4), cond=[torch.randn(5, CFG.text_in_dim)])

    def run(e):
        return e.sample(x["latent"], x["cond"], seed=1, steps=2, cfg=1.0)

    single = open_engine(path, EngineConfig())
    ref_base = run(single)
    single.set_loras([(a, 1.0)])
    ref_lora = run(single)
    eng = open_engine(path, EngineConfig(ulysses_degree=2))
    try:
        eng.set_loras([(a, 1.0)])
        with pytest.raises(LoRAError, match="another size"):
            eng.set_loras([(a, 1.0), (bad, 1.0)])
        assert eng.loras == []
        assert (run(eng) - ref_base).abs().max() <= 1e-4 * ref_base.abs().max()
        eng.set_loras([(a, 1.0)])
        assert (run(eng) - ref_lora).abs().max() <= 1e-4 * ref_lora.abs().max()
    finally:
        eng.release()
        shutdown_pools()


# -- item 4: alpha_pattern is never a regex from the file ------------------------------------------------------
REDOS = "(.*.*)*z"


def _peft_file(path, modules, config=None, rank=4, seed=0, dtype=torch.float32):
    """A diffusers/PEFT LoRA (no .alpha tensors) with the PEFT config (if any) in ``lora_adapter_metadata``."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for m, (o, i) in modules.items():
        sd[f"transformer.{m}.lora_A.weight"] = (torch.randn(rank, i, generator=g) * 0.1).to(dtype)
        sd[f"transformer.{m}.lora_B.weight"] = (torch.randn(o, rank, generator=g) * 0.1).to(dtype)
    meta = None if config is None else {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
    save_file(sd, str(path), metadata=meta)
    return str(path)


def _demo_modules():
    from engine.models.demo import load_demo

    return {n: (m.out_features, m.in_features) for n, m in target_modules(load_demo().dit).items()
            if n.startswith("layers.")}


@pytest.mark.subprocess
def test_redos_alpha_pattern_is_refused_by_sgld_generate(tmp_path):
    """The issue's reproduction: ``sgld generate --lora`` with the pattern (.*.*)*z in the file's PEFT metadata
    hung (exponential backtracking in re.fullmatch, holding the GIL). Now: exit 2 with a one-line error naming
    the file, the metadata key and the pattern. Run in a subprocess with a timeout (a hang cannot be stopped
    in-process: the regex engine never releases the GIL)."""
    one = dict(list(_demo_modules().items())[:1])  # one layer of the demo DiT is enough: a small file
    path = _peft_file(tmp_path / "redos.safetensors", one, {"r": 4, "lora_alpha": 4, "alpha_pattern": {REDOS: 8}})
    assert os.path.getsize(path) < 20_000
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--prompt", "a red circle", "--steps", "1",
                           "--out", str(tmp_path / "x.png"), "--lora", path], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert "redos.safetensors" in err and "lora_adapter_metadata" in err and "alpha_pattern" in err
    assert repr(REDOS) in err and "not a plain module-name pattern" in err
    assert not os.path.exists(tmp_path / "x.png")


@pytest.mark.subprocess
def test_redos_alpha_pattern_in_adapter_config_is_refused(tmp_path):
    """The same pattern in an adapter_config.json beside the file (PEFT save_pretrained), read in a
    subprocess with a timeout."""
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    sd = {"base_model.model.layers.0.self_attention.to_q.lora_A.weight": torch.randn(4, CFG.hidden_size),
          "base_model.model.layers.0.self_attention.to_q.lora_B.weight": torch.randn(CFG.hidden_size, 4)}
    save_file(sd, str(peft_dir / "adapter_model.safetensors"))
    (peft_dir / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "alpha_pattern": {REDOS: 2}}))
    script = ("import sys; from engine.features.lora import read_lora, LoRAError; from engine.models.random_weights import SIZES, "
              "random_model\ntry:\n    read_lora(sys.argv[1], random_model(SIZES['tiny']))\nexcept LoRAError as e:\n"
              "    print(e)\n    sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(peft_dir / "adapter_model.safetensors")], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "adapter_config.json" in proc.stdout and "alpha_pattern" in proc.stdout and repr(REDOS) in proc.stdout


@pytest.mark.parametrize("pattern", [r"layers\.(0|1)\.mlp", "to_[qk]", "to_q$", "*", ".*", "a" * 300, "to q", ""])
def test_alpha_patterns_that_are_not_plain_module_names_are_refused(tmp_path, pattern):
    """Patterns that are harmless regexes are refused too (nothing from a file is evaluated as a regex)."""
    path = _peft_file(tmp_path / "p.safetensors", {"layers.0.self_attention.to_q": (CFG.hidden_size, CFG.hidden_size)},
                      {"r": 4, "lora_alpha": 8, "alpha_pattern": {pattern: 2}})
    with pytest.raises(LoRAError, match=r"p.safetensors: metadata 'lora_adapter_metadata' 'alpha_pattern' has the key "
                                        r".*not a plain module-name pattern"):
        read_lora(path, random_model(CFG))


def test_plain_alpha_patterns_follow_peft_semantics(tmp_path):
    """Plain patterns give the alpha PEFT gives: the first key with re.match(rf"(.*\\.)?({key})$", module)
    (peft.utils.other.get_pattern_key; '.' is any character there, so 'to.k' matches 'to_k'), else lora_alpha;
    here the reference formula is evaluated on the model's own (trusted) module names."""
    patterns = {"layers.1.self_attention.to_q": 16, "to.k": 12, "mlp.gate_proj": 6, r"0\.mlp\.up_proj": 3,
                "linear_fc2": 5, "q": 99, "self_attention": 7, "layers.1.mlp.linear_fc2": 1, "1": 2}
    model = random_model(CFG)
    shapes = {n: tuple(m.weight.shape[:2]) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n.startswith("layers.")}
    path = _peft_file(tmp_path / "peft.safetensors", shapes, {"r": 4, "lora_alpha": 8, "alpha_pattern": patterns})
    lf = read_lora(path, model)
    assert sorted(lf.entries) == sorted(shapes)

    def peft_alpha(module):
        for key, alpha in patterns.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return alpha
        return 8

    expected = {m: peft_alpha(m) / 4 for m in shapes}
    assert {m: e.scale for m, e in lf.entries.items()} == expected
    assert len(set(expected.values())) >= 5  # several patterns took part, and some layers fell back to lora_alpha
    assert expected["layers.0.self_attention.to_q"] == 2.0 and expected["layers.1.self_attention.to_q"] == 4.0
    eng = tiny_engine()
    base = snapshot(eng.model)
    eng.set_loras([(path, 1.0)])
    m = "layers.0.self_attention.to_k"
    a, b = (lf.entries[m].down.float(), lf.entries[m].up.float())
    torch.testing.assert_close(eng.model.state_dict()[m + ".weight"], base[m + ".weight"] + 3.0 * b @ a,
                               rtol=1e-5, atol=1e-6)


def test_peft_metadata_is_bounded(tmp_path):
    model = random_model(CFG)
    shapes = {"layers.0.self_attention.to_q": (CFG.hidden_size, CFG.hidden_size)}
    many = {f"layers.{i}.self_attention.to_q": 1 for i in range(peft_mod.MAX_ALPHA_PATTERNS + 1)}
    path = _peft_file(tmp_path / "many.safetensors", shapes, {"r": 4, "lora_alpha": 8, "alpha_pattern": many})
    with pytest.raises(LoRAError, match=r"many.safetensors: .*'alpha_pattern' has 1025 entries; at most 1024"):
        read_lora(path, model)
    path = _peft_file(tmp_path / "huge.safetensors", shapes, {"r": 4, "lora_alpha": 8, "pad": "x" * (1 << 20)})
    with pytest.raises(LoRAError, match=r"huge.safetensors: metadata 'lora_adapter_metadata' is \d+ bytes; a PEFT "
                                        r"config is at most 1048576"):
        read_lora(path, model)
    deep = tmp_path / "deep.safetensors"
    save_file({"transformer.layers.0.self_attention.to_q.lora_A.weight": torch.zeros(4, CFG.hidden_size),
               "transformer.layers.0.self_attention.to_q.lora_B.weight": torch.zeros(CFG.hidden_size, 4)}, str(deep),
              metadata={"lora_adapter_metadata": "[" * 100_000})
    with pytest.raises(LoRAError, match="deep.safetensors: metadata 'lora_adapter_metadata' is not valid JSON"):
        read_lora(str(deep), model)


# -- item 9: non-finite numbers --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "nan", "-inf"])
def test_non_finite_strengths_are_refused(tmp_path, bad):
    eng = tiny_engine()
    a, _ = lora_files(tmp_path)
    with pytest.raises(LoRAError, match=r"a.safetensors: LoRA strength .* is not a finite number"):
        normalize([(a, bad)])
    with pytest.raises(LoRAError, match=r"a.safetensors: LoRA strength .* is not a finite number"):
        eng.set_loras([(a, bad)])
    assert getattr(eng, "loras", []) == []
    with pytest.raises(LoRAError, match=r"the strength '.*' is not a finite number \(FILE:STRENGTH"):
        parse_spec(f"{a}:{bad}")


@pytest.mark.subprocess
def test_non_finite_strength_on_the_cli(tmp_path):
    from engine import cli
    from engine.cli.generate import lora_specs

    a, _ = lora_files(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--prompt", "a red circle", "--steps", "1",
                           "--out", str(tmp_path / "x.png"), "--lora", f"{a}:nan"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    assert "strength 'nan' is not a finite number" in proc.stderr.strip().splitlines()[-1]
    assert not os.path.exists(tmp_path / "x.png")
    assert lora_specs(cli.build_parser().parse_args(["generate", "--prompt", "p", "--lora", f"{a}:-0.5"])) == [(a, -0.5)]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_alpha_tensor_is_refused(tmp_path, value):
    path = write_lora(tmp_path / "alpha.safetensors", make_pairs(MODULES[:2], seed=3), "kohya", alpha=value)
    with pytest.raises(LoRAError, match=r"alpha.safetensors: 'lora_unet_.*\.alpha' is (nan|inf): a LoRA alpha must be "
                                        r"a finite number"):
        read_lora(path, random_model(CFG))


@pytest.mark.parametrize("where", ["metadata", "adapter_config"])
@pytest.mark.parametrize("field", ["lora_alpha", "alpha_pattern", "text"])
def test_non_finite_or_non_number_alpha_in_peft_config_is_refused(tmp_path, where, field):
    """``NaN`` / ``Infinity`` are what Python's json writes for them (and reads back)."""
    value = "8" if field == "text" else float("nan") if field == "lora_alpha" else float("inf")
    cfg = {"r": 4, "lora_alpha": value if field != "alpha_pattern" else 8}
    if field == "alpha_pattern":
        cfg["alpha_pattern"] = {"to_q": value}
    shapes = {"layers.0.self_attention.to_q": (CFG.hidden_size, CFG.hidden_size)}
    if where == "metadata":
        path = _peft_file(tmp_path / "m.safetensors", shapes, cfg)
        name = "m.safetensors: metadata 'lora_adapter_metadata'"
    else:
        peft_dir = tmp_path / "peft"
        peft_dir.mkdir()
        path = _peft_file(peft_dir / "adapter_model.safetensors", shapes)  # no metadata: adapter_config.json
        (peft_dir / "adapter_config.json").write_text(json.dumps(cfg))
        name = "adapter_config.json:"
    what = "'lora_alpha'" if field != "alpha_pattern" else "'alpha_pattern' value of 'to_q'"
    pattern = re.escape(f"{name} {what} is ") + (r"'8', not a number" if field == "text" else r"(nan|inf): it must be "
                                                                                             r"a finite number")
    with pytest.raises(LoRAError, match=pattern):
        read_lora(path, random_model(CFG))


@pytest.mark.parametrize("part", ["lora_A", "lora_B", "diff"])
def test_non_finite_lora_weights_are_refused(tmp_path, part):
    h = CFG.hidden_size
    if part == "diff":
        sd = {"diffusion_model.layers.0.self_attention.to_q.diff": torch.zeros(h, h)}
        sd["diffusion_model.layers.0.self_attention.to_q.diff"][3, 5] = float("inf")
        key = "diffusion_model.layers.0.self_attention.to_q.diff"
    else:
        sd = {f"diffusion_model.layers.0.self_attention.to_q.{p}.weight": torch.randn(4, h) if p == "lora_A"
              else torch.randn(h, 4) for p in ("lora_A", "lora_B")}
        key = f"diffusion_model.layers.0.self_attention.to_q.{part}.weight"
        sd[key] = sd[key].bfloat16()
        sd[key][1, 2] = float("nan")
    save_file(sd, str(tmp_path / "nan.safetensors"))
    eng = tiny_engine()
    base = snapshot(eng.model)
    with pytest.raises(LoRAError, match=re.escape(f"nan.safetensors: '{key}' holds NaN or infinite values")):
        eng.set_loras([(str(tmp_path / "nan.safetensors"), 1.0)])
    assert differing(eng.model, base) == []


def test_lora_loader_node_refuses_a_non_finite_strength(pack):
    """In-process node (ComfyUI's validation lets NaN through a FLOAT with min/max: NaN < min is False)."""
    write_lora(pack.loras / "a.safetensors", make_pairs(MODULES[:2], seed=9), "ai_toolkit")
    base = pack.mc.SGLDModel(pack.path, pack.EngineConfig(), owner="1")
    node = pack.node.SGLDiffusionLoraLoader()
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"SGLDiffusion LoRA Loader: strength is (nan|inf); it must be a finite"):
            node.load(base, "a.safetensors", bad)
    assert node.load(base, "a.safetensors", 0.5)[0].loras[0][1] == 0.5


# -- item 11: the LoRA Loader on a multi-GPU (here 2 gloo ranks) model, in a real ComfyUI server ----------------
@pytest.mark.server
def test_lora_loader_node_on_two_ranks_in_comfyui(tmp_path):
    """ComfyUI 0.3.75, SGLDiffusion Model Loader with num_gpus=2 (Ulysses over 2 gloo worker processes on this
    CPU machine) -> LoRA Loader -> KSampler. The node used to fail (the module check_lora refused a
    ParallelEngine); now it asks the engine, which reads the file on its workers. Reference: Engine.set_loras +
    Engine.sample in this process on one rank, within the tolerance tests/test_parallel.py uses for 2 ranks
    against 1 (fp32 max abs error <= 1e-4 x max|reference|): the ranks compute attention on their share of
    heads and the linears on their share of tokens, so the sums run in another order (not bit-exact)."""
    import comfy_server as cs
    import requests

    if not os.path.exists(os.path.join(cs.COMFY_DIR, ".sgld-ready")):
        pytest.skip("ComfyUI is not installed (scripts/comfyui.sh)")
    base = str(tmp_path / "comfy")
    ckpt = cs.base_with_tiny_model(base)
    a = write_lora(os.path.join(base, "models", "loras", "a.safetensors"), make_pairs(BLOCK_LINEARS, seed=12), "ai_toolkit")
    server = cs.start_server(base)
    try:
        def graph(seed, strength=None, prefix="p"):
            g = cs.tiny_graph("tiny.safetensors", seed=seed, steps=2, width=64, height=64, prefix=prefix,
                              loader_options={"num_gpus": 2})
            if strength is not None:
                g["10"] = {"class_type": "SGLDiffusionLoraLoader",
                           "inputs": {"model": ["1", 0], "lora_name": "a.safetensors", "strength": strength}}
                g["5"]["inputs"]["model"] = ["10", 0]
            return g

        outs = {}
        for key, strength in (("lora", 0.8), ("base", None)):
            entry = server.run(graph(0, strength, prefix=key), timeout=300)
            assert entry["status"]["status_str"] == "success", cs.error_message(entry)
            outs[key] = cs.saved_latent(server, entry)
        loaded = server.get("/sgldiffusion/models").json()["loaded"]
        assert len(loaded) == 1 and loaded[0]["options"]["num_gpus"] == 2
        # NaN as Python's json writes it (requests refuses to send it; ComfyUI's json.loads reads it, and its
        # min/max check lets it through)
        body = json.dumps({"prompt": graph(1, float("nan"), prefix="nan"), "client_id": server.client_id})
        r = requests.post(server.url + "/prompt", data=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 200, r.text[:2000]
        entry = server.wait(r.json()["prompt_id"], timeout=120)
        err = cs.error_message(entry)
        assert entry["status"]["status_str"] == "error" and "strength is nan; it must be a finite number" in err[
            "exception_message"]
    finally:
        server.stop()

    def direct(seed, loras=()):
        eng = open_engine(ckpt)
        eng.set_loras(list(loras))
        return eng.sample(torch.zeros(1, 128, 4, 4), [text_features(1, 7)], [text_features(2, 5)], seed=seed, steps=2,
                          cfg=1.0)

    ref_lora, ref_base = direct(0, [(a, 0.8)]), direct(0)

    def err(x, ref):
        return (x - ref).abs().max().item() / ref.abs().max().item()

    print(f"\n2 ranks in ComfyUI vs 1 rank here: max abs error / max|ref| {err(outs['lora'], ref_lora):.2e} with the "
          f"LoRA, {err(outs['base'], ref_base):.2e} without; the LoRA changes the latent by {err(outs['lora'], ref_base):.2e}")
    assert err(outs["lora"], ref_lora) <= 1e-4 and err(outs["base"], ref_base) <= 1e-4
    assert err(outs["lora"], ref_base) > 1e-3  # the LoRA was applied on the workers (10x the tolerance)
