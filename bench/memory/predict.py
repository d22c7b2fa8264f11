"""Predicted peak GPU memory of one engine configuration at the ERNIE-Image 8B release shape (or fewer blocks),
from a fake-CUDA rehearsal (rehearse.py) through the engine's own ``open_engine`` and ``Engine.sample``.

A ``Setup`` is what a user switches on (the model's sampling mode, weight format, offload, Cache-DiT, LoRA,
compile); ``predict(setup, pixels)`` builds the DiT with fake weights in the format's real storage dtypes and
shapes, opens the engine on it with a card of ``card_gb``, samples and returns the peak (weights resident at
the start included) and where it happened.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rehearse import GiB, Rehearsal  # noqa: E402

from engine import EngineConfig, open_engine  # noqa: E402
from engine.features.cache import CacheConfig  # noqa: E402
from engine.features.lora.formats import LoRAEntry, LoRAFile  # noqa: E402
from engine.features.offload import choose_offload  # noqa: E402
from engine.features.quant import get_format, parse_format  # noqa: E402
from engine.features.quant.comfy.int4 import rotation_for  # noqa: E402
from engine.loading import estimate_bytes  # noqa: E402
from engine.models import family_of, get  # noqa: E402

PROMPT_TOKENS = 256  # a prompt-enhanced ERNIE-Image prompt (the PE writes a paragraph); the negative "" is 1 token
BASE_CFG, BASE_STEPS = 4.0, 1  # every step of a run has the same memory (offload's buffers are made in the first)
CACHE_MASK = "1010"  # Cache-DiT with a static mask: call 0 computed, call 1 cached, calls 2-3 computed
# formats built from a file's stored tensors (their shapes and dtypes): GGUF's quantizer is numpy; comfy-kitchen's
# W4A8 picks its codebook from the data; AWQ has no quantizer at all (calibrated offline: files only)
PREBUILT = ("q4_k", "q8_0", "asym-w4a8-int8", "awq-w4a16")


@dataclasses.dataclass(frozen=True)
class Setup:
    label: str
    family: str = "ernie-image"  # the DiT family (engine/models), at its release's shape
    model: str = "base"  # "base": CFG batch 2 (prompt + negative); "turbo": cfg 1, batch 1
    quant: Optional[str] = None  # a weight format name (EngineConfig.quant), or None: bf16
    offload: str = "none"  # "none" | "layerwise" | "auto"
    resident_layers: int = 2
    cache: bool = False
    lora_rank: int = 0  # a LoRA of this rank on every block linear (a side path on quantized weights)
    # SGLD_LORA_RESTORE for a merged LoRA: "copy" (host copies of the originals); the default compact record
    # stores the positions where a bit difference does not fit in a byte (``nonzero``: a size only the data
    # knows, which a trace cannot run); both records live in host memory, so the GPU peak is the same
    lora_restore: str = ""
    compile: bool = False
    batch: int = 1
    served: int = 0  # > 0: this many jobs submitted together to the server's batcher (joined in its forwards)
    comfy: bool = False  # one model call of ComfyUI's sampler on the Model Loader's MODEL (nodes/comfy_model.py)
    tp: int = 1  # tensor parallel degree (the prediction is one rank's)
    ulysses: int = 1  # Ulysses sequence parallel degree
    ring: int = 1  # Ring attention sequence parallel degree
    cfg_parallel: int = 1  # 2: a rank holds one CFG branch
    card_free_gib: float = 0.0  # the fake card's free memory (0: predict's ``card_gb``); "auto" and admission read it

    @property
    def ranks(self) -> int:
        return self.tp * self.ulysses * self.ring * self.cfg_parallel

    @property
    def rows(self) -> int:
        """Samples in one forward on one process (CFG branches count): a served batch's jobs joined, or the batch."""
        return (self.served or self.batch) * (2 if self.model == "base" else 1)


@dataclasses.dataclass
class Prediction:
    setup: Setup
    pixels: int
    peak_bytes: int
    weights_bytes: int  # device bytes once the engine is open, before the run
    where: str
    pinned_host_bytes: int
    notes: list

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB


def release_config(family: str = "ernie-image", layers: Optional[int] = None):
    """The family's release configuration (its config class's defaults: ERNIE-Image 8B, Z-Image 6B), with ``layers``
    blocks instead of the release's when given (a quicker trace: every block peaks alike)."""
    cls = get(family).config_class
    return cls() if layers is None else cls(num_layers=layers)


def _build(r: Rehearsal, cfg, device: str, quant: Optional[str]) -> torch.nn.Module:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with r.all_fake(), torch.device(device):
            model = family_of(cfg).model_class(cfg)
            if quant in PREBUILT:
                _prebuild(model, quant)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def _prebuild(model: torch.nn.Module, quant: str) -> None:
    """A quantized file's layers: each block linear as the format's module over the tensors a file stores."""
    try:
        name, _ = parse_format(quant)
    except ValueError:  # a format only files have (no quantize option: AWQ)
        name = quant
    fmt = get_format(name)
    family = family_of(model)
    for layer, mod in list(model.named_modules()):
        if family.is_block_linear(layer) and isinstance(mod, torch.nn.Linear):
            parent, _, leaf = layer.rpartition(".")
            setattr(model.get_submodule(parent), leaf, fmt.from_stored(_stored(name, tuple(mod.weight.shape))))


def _stored(name: str, shape: tuple) -> dict:
    """What a file of format ``name`` stores for one [out, in] layer (docs/quantization.md), as the reader hands it over."""
    out, cols = shape
    if name == "asym-w4a8-int8":  # 4-bit values, an fp8 scale per 16 inputs, a channel scale, a 16-entry codebook
        return {"weight": torch.empty(out, cols // 2, dtype=torch.int8),
                "weight_s_rel": torch.empty(out, cols // 16, dtype=torch.float8_e4m3fn),
                "weight_s_channel": torch.empty(out), "weight_codebook": torch.empty(16),
                "params": {"group": 16, "rotation": rotation_for(cols)}}
    if name == "awq-w4a16":  # 4-bit values, a scale and a zero point per 64 inputs and output
        return {"weight": torch.empty(out, cols // 2, dtype=torch.int8), "weight_scale": torch.empty(cols // 64, out),
                "weight_zeros": torch.empty(cols // 64, out), "params": {"group": 64}}
    fmt = get_format(name)  # GGUF: the stored uint8 blocks
    return {"weight": torch.empty(fmt.weight_bytes(shape, 0, torch.bfloat16), dtype=torch.uint8), "shape": shape}


def _lora(model: torch.nn.Module, rank: int) -> LoRAFile:
    """A rank-``rank`` LoRA on every block linear (fake factors in bf16, as files ship)."""
    family = family_of(model)
    entries = {}
    for layer, mod in model.named_modules():
        if family.is_block_linear(layer) and hasattr(mod, "in_features"):
            entries[layer] = LoRAEntry(layer, down=torch.empty(rank, mod.in_features, dtype=torch.bfloat16),
                                       up=torch.empty(mod.out_features, rank, dtype=torch.bfloat16), alpha=float(rank))
    return LoRAFile("rehearsal-lora.safetensors", entries)


def assume_kernels(device: str) -> None:
    """The fp8 ``_scaled_mm`` and int8 ``_int_mm`` probes as an sm90 GPU answers them (they compare numbers,
    which fake tensors do not have)."""
    from engine.features.quant.fp8 import numerics as fp8n
    from engine.features.quant.int8 import linear as int8l

    fp8n._scaled_mm_probes[str(torch.device(device))] = (True, "torch._scaled_mm row-wise (assumed: sm90)")
    for rows in (True, False):
        int8l._int_mm_probes[(str(torch.device(device)), rows, True, True)] = True


def assume_ring_kernel(device: str, head_dim: int) -> None:
    """Ring attention's block kernel as an sm90 GPU picks it: sdpa's (torch's flash kernel with its log-sum-exp;
    its once-per-process probe compares numbers against a reference, which fake tensors cannot)."""
    from engine.features.attention import backends, lse

    backends._LSE_KERNELS[("sdpa", torch.device(device).type, torch.bfloat16, head_dim)] = lse._flash_cuda


def auto_decision(card_free_gib: float, layers: Optional[int] = None, quant: Optional[str] = None) -> tuple:
    """The loader's ``offload="auto"`` for a checkpoint of this shape on a card with this much free memory: the
    engine's ``choose_offload`` from the bytes at rest, the free memory read through the device seam."""
    cfg = release_config(layers=layers)
    with Rehearsal(int(card_free_gib * GiB)) as r:
        with r.all_fake():
            at_rest = estimate_bytes(cfg, torch.bfloat16, quant)
        return choose_offload("auto", "cuda:0", at_rest)


@contextlib.contextmanager
def _env(name: str, value: str):
    """``name`` set to ``value`` inside (unset value: left alone)."""
    old = os.environ.get(name)
    if value:
        os.environ[name] = value
    try:
        yield
    finally:
        if value:
            os.environ.pop(name) if old is None else os.environ.__setitem__(name, old)


_cache = {}


def predict_cached(setup: Setup, pixels: int, layers: Optional[int] = None) -> Prediction:
    """``predict`` once per configuration (the label aside) in this process: a trace is deterministic."""
    if setup.offload == "auto":
        raise ValueError("offload 'auto' depends on the card: decide with auto_decision, then predict its choice")
    key = (dataclasses.replace(setup, label=""), pixels, release_config(setup.family, layers).num_layers)
    if key not in _cache:
        _cache[key] = predict(setup, pixels, layers)
    return dataclasses.replace(_cache[key], setup=setup)


def predict(setup: Setup, pixels: int, layers: Optional[int] = None, card_gb: float = 80.0,
            prompt_tokens: int = PROMPT_TOKENS) -> Prediction:
    if setup.ranks > 1:
        return predict_parallel(setup, pixels, layers, prompt_tokens)
    cfg = release_config(setup.family, layers)
    with Rehearsal(int((setup.card_free_gib or card_gb) * GiB)) as r:
        decision = None
        if setup.offload == "auto":  # as the router decides for a file: before loading, from the bytes at rest
            with r.all_fake():
                at_rest = estimate_bytes(cfg, torch.bfloat16, setup.quant)
            decision = choose_offload("auto", "cuda:0", at_rest)
        offloaded = (decision[0] if decision else setup.offload) == "layerwise"
        # the router loads a model that will be offloaded into CPU memory; otherwise straight onto the GPU
        model = _build(r, cfg, "cpu" if offloaded else "cuda", setup.quant)
        r.name_modules(model)
        assume_kernels("cuda:0")
        quant = None if setup.quant in PREBUILT else setup.quant
        config = EngineConfig(device="cuda:0", attention="sdpa", quant=quant, offload=setup.offload,
                              resident_layers=setup.resident_layers, compile="static" if setup.compile else False)
        with r.all_fake():  # a LoRA file's tensors, on the host, named as the checkpoint (before fusing)
            lora = _lora(model, setup.lora_rank) if setup.lora_rank else None
        eng = open_engine(model, config, label=setup.label, offload_decision=decision)
        r.name_modules(model)  # the fused and quantized layers are new modules
        if lora is not None:
            with _env("SGLD_LORA_RESTORE", setup.lora_restore):
                eng.set_loras([(lora, 1.0)])
        weights = r.tracker.live
        r.tracker.reset_peak()
        stride = family_of(cfg).latent.stride
        latent = torch.zeros(setup.batch, cfg.in_channels, pixels // stride, pixels // stride)
        cond = [torch.zeros(prompt_tokens, cfg.text_in_dim)]
        base = setup.model == "base"
        uncond = [torch.zeros(1, cfg.text_in_dim)] if base else None
        cache = CacheConfig(enabled=True, steps_mask=CACHE_MASK, scm_policy="static") if setup.cache else None
        steps = len(CACHE_MASK) if setup.cache else BASE_STEPS
        reads = []
        if setup.comfy:
            reads = [f"host read answered: {x}" for x in _comfy_call(r, eng, latent, cond[0], uncond[0] if uncond else None)]
        elif setup.served:
            joined = _serve(eng, setup.served, latent[0], cond[0], uncond[0] if uncond else None, steps, base)
            assert setup.card_free_gib or joined == setup.rows, f"{setup.served} jobs were joined {joined} samples a forward"
            reads = [] if joined == setup.rows else [f"admission by bytes: {joined:g} samples a forward (of {setup.rows})"]
        else:
            eng.sample(latent, cond, uncond, steps=steps, cfg=BASE_CFG if base else 1.0, seed=0, cache=cache)
        if setup.cache:
            mask = eng.last_run.step_mask
            assert not all(mask) and any(mask), f"the cached run computed {mask}: expected a cached and a computed call"
        peak = r.tracker.peak
        # the load's decision first, then what a call changed (offload "auto" at the image's size), what the
        # trace answered or the server's admission did
        notes = ([decision[1]] if decision else []) + list(eng.warnings) + list(eng.last_run.warnings) + reads
        return Prediction(setup, pixels, peak.bytes, weights, f"{peak.module}: {peak.op}", r.tracker.host_peak, notes)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACK = "sgld_rehearsal_pack"


class Unavailable(RuntimeError):
    """A row needs something this machine lacks (ComfyUI, or a torchvision built for this torch): says what."""


def comfy_model_module():
    """nodes/comfy_model.py with the installed ComfyUI (.cache/ComfyUI, CPU mode) imported in-process. The node
    module is loaded under a stand-in package for the pack root (as tests/pack_modules.py does), whose
    ``engine`` is this process's ``engine`` (the same modules: one family registry for the engine the rehearsal
    opened and the node's checks)."""
    import importlib
    import types

    comfy_dir = os.environ.get("SGLD_COMFYUI_DIR", os.path.join(ROOT, ".cache", "ComfyUI"))
    if not os.path.exists(os.path.join(comfy_dir, "comfy", "model_base.py")):
        raise Unavailable(f"ComfyUI is not installed in {comfy_dir} (scripts/comfyui.sh)")
    if comfy_dir not in sys.path:
        sys.path.insert(0, comfy_dir)
    from comfy.cli_args import args
    args.cpu = True
    for name in ("engine.inputs", "engine.loading", "engine.models.demo.codec", "engine.sampling", "engine.threads",
                 "engine.features.cache", "engine.features.lora", "engine.io.safetensors"):
        importlib.import_module(name)
    for name, path in ((PACK, ROOT), (PACK + ".nodes", os.path.join(ROOT, "nodes"))):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [path]
            sys.modules[name] = mod
    for name, mod in list(sys.modules.items()):
        if name == "engine" or name.startswith("engine."):
            sys.modules.setdefault(f"{PACK}.{name}", mod)
    try:
        return importlib.import_module(PACK + ".nodes.comfy_model")
    except (ImportError, RuntimeError) as e:  # ComfyUI's models import torchvision, whose ops must match this torch
        raise Unavailable(f"ComfyUI in {comfy_dir} does not import with torch {torch.__version__} "
                          f"({type(e).__name__}: {e}); it imports torchvision: install the torchvision release "
                          "built for this torch (a CPU-only torch takes the one from PyTorch's CPU wheel index)") from e


def _comfy_call(r: Rehearsal, eng, latent, cond, uncond) -> list:
    """One model call of ComfyUI's sampler on our MODEL in a registered run (``outer_sample`` registers a
    ``ComfyRun``; ``EngineCall.forward`` is the diffusion model ComfyUI's ``BaseModel._apply_model`` calls), with
    what ComfyUI passes: on the device x and the text in the model's dtype (the text zero-padded by
    ``PaddedText``) and the timesteps; ``text_lens`` as ``TextLengths.concat`` makes them (host ints: ComfyUI
    moves every tensor it passes to the device, and lengths read there are a sync a call); transformer_options with the call's ``sigmas`` and ``cond_or_uncond`` ([1, 0]: negative first, with CFG).
    The run's first call of a branch order also checks the inputs' values (a reduction read on the host: a
    sync once per run, by design); the call rehearsed is a later one. Every call then reads one value on the
    host: the engine's check that the velocity is finite (``ModelCalls``: on the engine's own path the velocity
    is on the host by then; ComfyUI's sampler keeps it on the device). The trace answers it "finite" and
    returns the reads it answered."""
    cm = comfy_model_module()
    call = cm.EngineCall(None, eng)
    order = [1, 0] if uncond is not None else [0]
    texts = ([uncond] if uncond is not None else []) + [cond]
    b = latent.shape[0]
    dev = eng.device
    longest = max(t.shape[0] for t in texts)
    context = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[0]))[None].expand(b, -1, -1)
                         for t in texts]).to(dev, call.dtype)
    lens = cm.TextLengths(torch.tensor([t.shape[0] for t in texts for _ in range(b)])).concat([])
    x = torch.zeros((b * len(texts),) + tuple(latent.shape[1:]), device=dev, dtype=call.dtype)
    sigma = torch.full((b * len(texts),), 0.5, device=dev)
    run = cm.ComfyRun(eng, torch.tensor([1.0, 0.0]), "euler", None)
    run.values_checked.add(tuple(order))
    with cm._runs_lock:
        run_id = next(cm._run_ids)
        cm._runs[run_id] = run
    try:
        options = {"sigmas": sigma, "cond_or_uncond": order, cm.RUN_OPTION: run_id}
        with r.answering() as reads:
            call(x, sigma * 1000.0, context=context, transformer_options=options, text_lens=lens)
        return reads
    finally:
        with cm._runs_lock:
            cm._runs.pop(run_id, None)
        run.finish()


def _serve(eng, jobs: int, latent, cond, uncond, steps: int, base: bool) -> None:
    """``jobs`` runs submitted at once to the server's ``Batcher`` (its default ``max_batch`` 8, CFG branches
    counted), as ``sgld serve`` runs them: each job's sampling loop in a thread of its own, their model calls
    joined in one forward (``joint_velocity``) by the batcher's loop thread, as many as its admission (``max_batch``,
    the device memory beside the weights) lets in. Returns the mean samples a forward."""
    from engine.serve.batcher import Batcher, Job

    batcher = Batcher(eng, max_batch=8)
    try:
        futures = batcher.submit_many([Job(latent=latent, cond=cond, uncond=uncond, seed=i, steps=steps, cfg=BASE_CFG if base else 1.0)
                                       for i in range(jobs)])
        for f in futures:
            f.result()
        return batcher.stats()["samples_per_forward"]
    finally:
        batcher.close()


def predict_parallel(setup: Setup, pixels: int, layers: Optional[int] = None,
                     prompt_tokens: int = PROMPT_TOKENS) -> Prediction:
    """Rank 0 of the setup's CFG x Ring x Ulysses x TP ranks (torch's fake process group: collectives and Ring's
    point-to-point K/V passing shaped, nothing sent): its share of the DiT built as the tensor-parallel load shapes
    it (``shard_skeleton``), opened like a rank opens it, and one model call through the rank's own commands
    (``WorkerState.cmd_begin`` / ``cmd_call``: the parallel forward, Ulysses all-to-alls, Ring's isend / irecv,
    tensor parallel all-reduces, CFG parallel's all-gather). Peak of that rank."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from engine.features.quant.transform import shard_skeleton
    from engine.parallel.comm import build_groups, destroy_groups
    from engine.parallel.forward import ParallelModel
    from engine.parallel.plan import ParallelPlan
    from engine.parallel.wire import pack
    from engine.parallel.worker import WorkerState, worker_config

    cfg = release_config(setup.family, layers)
    tp = setup.tp
    plan = ParallelPlan(tp=tp, ulysses=setup.ulysses, ring=setup.ring, cfg=setup.cfg_parallel)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    worker = WorkerState(0, plan.world_size, "cuda:0")
    try:
        with Rehearsal() as r:
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device("meta"):  # real meta tensors: shapes only, as the sharded load starts
                    model = family_of(cfg).model_class(cfg)
                if tp > 1:
                    shard_skeleton(model, family_of(model), tp)
            finally:
                torch.set_default_dtype(old)
            with r.all_fake():
                model = model.to_empty(device="cuda:0").eval().requires_grad_(False)
                if setup.quant in PREBUILT:
                    _prebuild(model, setup.quant)
            assume_kernels("cuda:0")
            if plan.ring > 1:
                assume_ring_kernel("cuda:0", cfg.hidden_size // cfg.num_attention_heads)
            config = EngineConfig(device="cuda:0", attention="sdpa", tp=tp, ulysses_degree=plan.ulysses,
                                  ring_degree=plan.ring, cfg_parallel=plan.cfg > 1,
                                  quant=None if setup.quant in PREBUILT else setup.quant)
            worker.groups = build_groups(plan, 0)
            worker.engine = open_engine(model, worker_config(config, "cuda:0"), label=setup.label)
            worker.parallel = ParallelModel(worker.engine.model, worker.groups)
            r.name_modules(worker.engine.model)
            weights = r.tracker.live
            r.tracker.reset_peak()
            base = setup.model == "base"
            rows = 2 * setup.batch if base else setup.batch
            stride = family_of(cfg).latent.stride
            text = torch.zeros(rows, prompt_tokens, cfg.text_in_dim)
            lens = torch.tensor([prompt_tokens] * setup.batch + [1] * (rows - setup.batch))
            worker.cmd_begin(pack(text), pack(lens), base, None, 2 if base else 1)
            x = torch.zeros(rows, cfg.in_channels, pixels // stride, pixels // stride)
            worker.cmd_call(pack(x), pack(torch.full((rows,), 0.5)))
            worker.cmd_end()
            peak = r.tracker.peak
            return Prediction(setup, pixels, peak.bytes, weights, f"{peak.module}: {peak.op}", 0,
                              list(worker.engine.warnings))
    finally:
        if worker.parallel is not None:
            worker.parallel.close()
        destroy_groups(worker.groups)
        dist.destroy_process_group()
