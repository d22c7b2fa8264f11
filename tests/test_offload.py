"""Layer-wise offload on the CPU (engine/features/offload): the CPU is both the storage and the compute
device, so the same code path runs with the stream / event operations as no-ops. Checked: output
bit-equal to the model without offload (plain, Cache-DiT, fp8, compiled), the bytes resident on the
"device" at every block step (peak <= non-block weights + resident_layers x one block), only the
blocks that run are transferred (Cache-DiT skips), the auto choice, config validation, the Engine /
from_file / CLI wiring, release / invalidate / remove, runs under torch.inference_mode (as ComfyUI runs
nodes; also with a LoRA), and that remove() / dropping an engine frees everything without gc.collect().
Tiny models."""
import dataclasses
import gc
import weakref

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.features import offload as O
from engine.features import patching
from engine.features.cache import CacheConfig
from engine.models.random_weights import SIZES, random_model
from engine.router import open_engine

CFG = dataclasses.replace(SIZES["tiny"], num_layers=6)  # more blocks than buffers


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, CFG.in_channels, 6, 6, generator=g)
    text = torch.randn(2, 7, CFG.text_in_dim, generator=g)
    return x, torch.tensor([600.0, 600.0]), text, torch.tensor([7, 4])  # padded text -> key mask


def storage_key(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def resident_probe(model, off):
    """Forward pre-hooks on every block (they run inside the block call, after the offloader made it
    resident) that count, independently of the offloader's own accounting, the bytes held outside the
    CPU masters: every storage that a model parameter points at, plus the allocated slot buffers."""
    masters = {storage_key(s.master) for s in off.stores}
    steps = []

    def hook(block, args):
        storages = {}
        for p in model.parameters():
            storages[storage_key(p)] = p.untyped_storage().nbytes()
        for s in off.slots:
            if s.buf is not None:
                storages[storage_key(s.buf)] = s.buf.untyped_storage().nbytes()
        resident = sum(n for k, n in storages.items() if k not in masters)
        running = patching.state(block)["offload"].index
        bound = [i for i, b in enumerate(model.layers._modules.values())
                 if any(storage_key(p) not in masters for p in b.parameters())]
        steps.append((running, resident, bound))

    handles = [b.register_forward_pre_hook(hook) for b in model.layers._modules.values()]
    return steps, handles


@pytest.mark.parametrize("resident_layers", [1, 2, 3, 6])
def test_bit_equal_and_resident_bytes_at_every_block(resident_layers):
    ref = random_model(CFG, seed=0)
    model = random_model(CFG, seed=0)
    block_dense = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    off = O.apply_layerwise_offload(model, "cpu", resident_layers)
    assert not off.pin  # pinned memory only when the compute device is a CUDA GPU
    steps, handles = resident_probe(model, off)
    x = inputs()
    with torch.no_grad():
        want = ref(*x)
        for _ in range(2):
            assert torch.equal(model(*x), want)
    for h in handles:
        h.remove()
    assert len(steps) == 2 * CFG.num_layers
    one_layer = off.slot_bytes
    assert one_layer <= block_dense + O.ALIGN * 16  # the slot is one block (plus alignment padding)
    bound_limit = off.nonblock_bytes() + resident_layers * one_layer
    assert max(r for _, r, _ in steps) <= bound_limit
    if resident_layers < CFG.num_layers:
        assert max(r for _, r, _ in steps) < off.nonblock_bytes() + off.block_bytes()  # really offloaded
    for running, _, bound in steps:
        assert bound == [running]  # the running block reads device buffers; all others point at the masters
    assert off.resident_bytes() <= bound_limit
    # in order, each block once per forward (+ block 0 prefetched for the next forward when a buffer is
    # free); with 3 buffers block 0 stays in one and two stream; with one buffer per block nothing streams
    order = list(range(CFG.num_layers))
    expected = {1: order * 2, 2: order + [0] + order[1:] + [0], 3: order + order[1:], 6: order}[resident_layers]
    assert list(off.record) == expected
    assert off.fixed == {1: 0, 2: 0, 3: 1, 6: 6}[resident_layers]
    # between forwards every parameter points at the CPU master: state_dict sees the master weights
    assert torch.equal(model.state_dict()["layers.3.mlp.up_proj.weight"], ref.state_dict()["layers.3.mlp.up_proj.weight"])
    assert list(model.state_dict()) == list(ref.state_dict())


def test_direct_block_calls_load_on_demand():
    """A runner that calls blocks by index (no plan) still gets the right weights, one stall each."""
    ref = random_model(CFG, seed=0)
    model = random_model(CFG, seed=0)
    off = O.apply_layerwise_offload(model, "cpu", 2, prefetch_first=False)

    def backwards(m, h, ctx):
        for i in reversed(range(len(m.layers))):
            h = m.layers[i](h, ctx)
        return h

    def planned_backwards(m, h, ctx):
        O.plan_blocks(m, reversed(range(len(m.layers))))
        return backwards(m, h, ctx)

    x = inputs()
    with torch.no_grad():
        ref.block_runner = backwards
        want = ref(*x)
        model.block_runner = backwards
        assert torch.equal(model(*x), want)
        assert off.stalls == CFG.num_layers and list(off.record) == list(reversed(range(CFG.num_layers)))
        off.reset_stats()
        model.block_runner = planned_backwards  # announced: prefetched, one stall (the first block)
        assert torch.equal(model(*x), want)
        assert off.stalls == 1 and list(off.record) == list(reversed(range(CFG.num_layers)))


def test_cache_dit_skipped_blocks_are_not_transferred():
    """Cache-DiT (F1B1, dynamic threshold): the middle blocks are transferred exactly on the computed
    calls; the output is bit-equal to the same cached run without offload. The loop tells the offloader each span
    of blocks it runs, so they are prefetched: a block waits for its load only at the first call and where a
    computed call's decision opens the middle blocks (every load waited before the loop announced its spans)."""
    cache = CacheConfig(fn=1, bn=1, rdt=0.9, warmup=1, mc=2, max_cached_steps=-1, taylorseer=False)
    g = torch.Generator().manual_seed(3)
    cond = [torch.randn(7, CFG.text_in_dim, generator=g)]
    lat = torch.zeros(1, CFG.in_channels, 6, 6)
    outs, engines = [], []
    for offload in ("none", "layerwise"):
        eng = Engine(random_model(CFG, seed=0), EngineConfig(offload=offload))
        outs.append(eng.sample(lat, cond, None, seed=1, steps=8, cfg=1.0, cache=cache))
        engines.append(eng)
    assert torch.equal(outs[0], outs[1])
    eng = engines[1]
    mask = eng.last_run.step_mask
    assert engines[0].last_run.step_mask == mask
    computed, calls = sum(mask), len(mask)
    assert 0 < computed < calls  # some calls were cached
    rec = list(eng.offload.record)
    n = CFG.num_layers
    for k in range(1, n - 1):
        assert rec.count(k) == computed  # middle blocks: only when computed
    assert rec.count(n - 1) <= calls and rec.count(0) <= calls
    assert len(rec) <= computed * n + (calls - computed) * 2 + 1
    assert eng.offload.stalls <= 1 + computed < len(rec), (eng.offload.stalls, computed, len(rec))


def test_fp8_blocks_are_offloaded_as_quantized_bytes():
    x = inputs()
    ref = Engine(random_model(CFG, seed=0), EngineConfig(quant="fp8"))
    eng = Engine(random_model(CFG, seed=0), EngineConfig(quant="fp8", offload="layerwise", resident_layers=2))
    off = eng.offload
    assert off is not None and any("offload: layer-wise" in n for n in eng.notes)
    dense_block = 4 * sum(p.numel() for p in random_model(CFG).layers[0].parameters())  # fp32
    assert off.slot_bytes < dense_block / 2  # the transfer is the fp8 weights + scales
    dtypes = {p.dtype for p in eng.model.layers[0].parameters()}
    assert torch.float8_e4m3fn in dtypes
    with torch.no_grad():
        assert torch.equal(eng.model(*x), ref.model(*x))
    assert off.bytes_transferred == sum(off.stores[i].nbytes for i in off.record)


def test_compiled_blocks_trace_the_computation_not_the_transfers():
    """Regional compile on an offloaded model: one graph for all blocks, no graph break, no recompile
    when blocks are skipped; equal to eager (aot_eager backend: cheap, and bit-exact on CPU)."""
    from engine.features import compile as C

    torch._dynamo.reset()
    ref = random_model(CFG, seed=0)
    model = random_model(CFG, seed=0)
    off = O.apply_layerwise_offload(model, "cpu", 2)
    C.compile_blocks(model, "static", mode=None, backend="aot_eager")
    C.reset_counters()
    x = inputs()
    with torch.no_grad():
        want = ref(*x)
        assert torch.equal(model(*x), want)
        assert torch.equal(model(*x), want)
        model.block_runner = lambda m, h, ctx: m.layers[-1](m.layers[0](h, ctx), ctx)
        model(*x)
    assert C.graph_count() == 1 and C.graph_breaks() == {}
    assert off.transfers > 0
    C.uncompile_blocks(model)


def test_auto_choice():
    gib = O.GiB
    assert O.choose_offload("none", "cuda", 16 * gib, free_bytes=1)[0] == "none"
    assert O.choose_offload("layerwise", "cpu", 1)[0] == "layerwise"
    choice, why = O.choose_offload("auto", "cuda:0", 16 * gib, free_bytes=7 * gib)
    assert choice == "layerwise" and "7.0 GiB free" in why
    assert O.choose_offload("auto", "cuda:0", 16 * gib, free_bytes=40 * gib)[0] == "none"
    # working memory counts: 16 GiB of weights do not run resident in 17 GiB
    assert O.choose_offload("auto", "cuda:0", 16 * gib, free_bytes=17 * gib)[0] == "layerwise"
    # weights already on the device count as available
    assert O.choose_offload("auto", "cuda:0", 16 * gib, free_bytes=4 * gib, resident_bytes=16 * gib)[0] == "none"
    assert O.choose_offload("auto", "cpu", 16 * gib)[0] == "none"  # no GPU: nothing to save
    eng = Engine(random_model(SIZES["tiny"]), EngineConfig(offload="auto"))
    assert eng.offload is None and any("auto:" in n for n in eng.notes)


def test_config_validation():
    c = EngineConfig()
    assert c.offload == "none" and c.resident_layers == 2
    assert EngineConfig(offload="LayerWise").offload == "layerwise"
    assert EngineConfig(offload=None).offload == "none"
    with pytest.raises(ValueError, match=r"EngineConfig.offload 'gpu' is not supported; choose one of none, layerwise, auto"):
        EngineConfig(offload="gpu")
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ValueError, match=r"EngineConfig.resident_layers"):
            EngineConfig(resident_layers=bad)
    assert EngineConfig(offload="layerwise", resident_layers=3).key() != EngineConfig(offload="layerwise").key()
    with pytest.raises(ValueError, match="resident_layers"):
        O.apply_layerwise_offload(random_model(SIZES["tiny"]), "cpu", 0)


def test_from_file_release_invalidate_remove(tiny_checkpoint):
    path = str(tiny_checkpoint)
    x = (torch.randn(1, 16, 4, 4), torch.tensor([500.0]), torch.randn(1, 5, 48), torch.tensor([5]))
    plain = open_engine(path)
    eng = open_engine(path, EngineConfig(offload="layerwise", resident_layers=1))
    off = eng.offload
    from engine.features.quant import weight_bytes
    from engine.loading import estimate_bytes

    assert estimate_bytes(path) == weight_bytes(plain.model)
    assert estimate_bytes(path, quant="fp8") < weight_bytes(plain.model)
    with torch.no_grad():
        want = plain.model(*x)
        assert torch.equal(eng.model(*x), want)
        assert eng.release() > 0 and all(s.buf is None for s in off.slots)
        assert torch.equal(eng.model(*x), want)  # buffers come back at the next forward
        # weights changed in place (as a LoRA merge does): the masters change, invalidate() refills
        plain.model.layers[1].mlp.linear_fc2.weight.mul_(1.5)
        with off.updating():
            eng.model.layers[1].mlp.linear_fc2.weight.mul_(1.5)
        want2 = plain.model(*x)
        assert not torch.equal(want2, want)
        assert torch.equal(eng.model(*x), want2)
    off.remove()
    assert O.get_offload(eng.model) is None and type(eng.model.layers[0]).__name__ == "ErnieImageBlock"
    assert type(eng.model.layers) is torch.nn.ModuleList
    with torch.no_grad():
        assert torch.equal(eng.model(*x), want2)


def test_inference_mode_and_no_grad_mix():
    """ComfyUI loads and samples under torch.inference_mode; the CLI and tests under no_grad. Masters and
    buffers are normal tensors either way, so runs can alternate and weights can still be updated."""
    ref = random_model(CFG, seed=0)
    model = random_model(CFG, seed=0)
    x = inputs()
    with torch.inference_mode():
        off = O.apply_layerwise_offload(model, "cpu", 2)
        want = ref(*x)
        assert torch.equal(model(*x), want)
    with torch.no_grad():
        assert torch.equal(model(*x), want)
        with off.updating():
            model.layers[2].mlp.up_proj.weight.mul_(1.0)
        assert torch.equal(model(*x), want)


def test_cli_bench_offload_flags(capsys):
    import json

    from engine.cli import main

    assert main(["bench", "--size", "tiny", "--offload", "layerwise", "--resident-layers", "1", "--steps", "1",
                 "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["offload"]["resident_layers"] == 1 and out["offload"]["transfers"] > 0



# -- stream / event ordering, checked on the CPU with recording fakes ------------------------------------------
class _FakeEvent:
    def __init__(self, log):
        self.log, self.tag = log, None  # tag: (slot, "ready" | "free"), set when the slot is loaded

    def record(self, stream):
        self.log.append(["record", stream.name, self, None])


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(["wait", self.name, event, None])


class _FakeStreams:
    """Stands in for the CUDA streams: records every event record / wait in issue order (the copies
    themselves still run, on the CPU)."""

    cuda = True

    def __init__(self):
        self.log = []
        self.copy = _FakeStream("copy", self.log)
        self._compute = _FakeStream("compute", self.log)

    def event(self):
        return _FakeEvent(self.log)

    def compute(self):
        return self._compute

    def on_copy(self):
        import contextlib

        return contextlib.nullcontext()

    def synchronize(self):
        self.log.append(["sync", None, None, None])


def check_stream_order(log):
    """Race check of a recorded schedule, as CUDA runs it: ops run in issue order on their stream; a
    ``wait`` orders its stream after the event's latest ``record`` issued before it; ``sync`` waits for
    everything. Checked: a block computes from a slot only after the copy of THAT block into the slot
    (read after write), and a copy into a slot starts only after every earlier compute that read the
    slot (write after read). A copy is complete at the "ready" record that follows it on the copy stream."""
    preds, last_on, last_record, ops = [], {}, {}, []

    def add(stream, kind, payload, extra=()):
        k = len(ops)
        ops.append((kind, payload))
        preds.append(set(extra))
        if stream in last_on:
            preds[k].add(last_on[stream])
        last_on[stream] = k
        return k

    barrier = None
    for kind, stream, ev, info in log:
        extra = {barrier} if barrier is not None else set()
        if kind == "record":
            slot, which = ev.tag
            op = ("copy", (slot, info)) if which == "ready" else ("free", slot)
            last_record[id(ev)] = add(stream, *op, extra=extra)
        elif kind == "wait":
            if id(ev) in last_record:
                extra.add(last_record[id(ev)])
            add(stream, "wait", None, extra=extra)
        elif kind == "compute":
            add("compute", "compute", info, extra=extra)
        elif kind == "sync":
            barrier = add("host", "sync", None, extra=set(last_on.values()))
            last_on.clear()

    anc = []
    for k in range(len(ops)):  # predecessors always have smaller indices
        a = set()
        for p in preds[k]:
            a.add(p)
            a |= anc[p]
        anc.append(a)
    written, reads, checked = {}, {}, 0
    for k, (kind, payload) in enumerate(ops):
        if kind == "copy":
            slot, block = payload
            for r in reads.get(slot, []):
                assert r in anc[k], f"copy of block {block} into slot {slot} may overwrite it while op {r} reads it"
            written[slot], reads[slot] = (k, block), []
        elif kind == "compute":
            slot, block = payload
            w, wblock = written[slot]
            assert wblock == block, f"block {block} computed from slot {slot}, which holds block {wblock}"
            assert w in anc[k], f"block {block} may read slot {slot} before its copy finished"
            reads[slot].append(k)
            checked += 1
    return checked


@pytest.mark.parametrize("resident_layers", [2, 3])
def test_stream_event_schedule_has_no_races(resident_layers):
    """The CUDA ordering (copy stream + events) for plain, planned, unplanned, Cache-DiT-like runs and a
    buffer release in between, recorded with fake streams and checked for read-after-write and
    write-after-read races; the copy stream never blocks compute more than it must (prefetches are
    issued ahead: the compute of a planned block waits on a copy issued before the previous block ran)."""
    from engine.models.family import run_blocks

    model = random_model(CFG, seed=0)
    off = O.apply_layerwise_offload(model, "cpu", resident_layers)
    fake = off.streams = _FakeStreams()
    log = fake.log
    orig_load = off._load

    def load(i, slot):
        orig_load(i, slot)
        slot.ready.tag, slot.free.tag = (slot.index, "ready"), (slot.index, "free")
        assert log[-1][0] == "record" and log[-1][2] is slot.ready
        log[-1][3] = i  # this ready record completes the copy of block i

    off._load = load

    def hook(block, args):
        i = patching.state(block)["offload"].index
        slot = next(s for s in off.slots if s.block == i and s.busy)
        log.append(["compute", "compute", None, (slot.index, i)])

    for b in model.layers._modules.values():
        b.register_forward_pre_hook(hook)
    n = CFG.num_layers

    def cache_like(skip):
        def runner(m, h, ctx):
            for b in m.layers[:1]:
                h = b(h, ctx)
            if not skip:
                for b in m.layers[1:n - 1]:
                    h = b(h, ctx)
            for b in m.layers[n - 1:]:
                h = b(h, ctx)
            return h
        return runner

    def backwards(m, h, ctx):
        for i in reversed(range(n)):
            h = m.layers[i](h, ctx)
        return h

    x = inputs()
    with torch.no_grad():
        for runner in (run_blocks, run_blocks, cache_like(True), cache_like(False), cache_like(True),
                       backwards, run_blocks):
            model.block_runner = runner
            model(*x)
        off.release_buffers()
        model.block_runner = run_blocks
        model(*x)
    assert check_stream_order(log) == 5 * n + 2 + (n - 2) + 2 + 2
    # prefetch really is ahead: apart from the first block of a run (and every block of the unplanned
    # backwards run), a block's copy was issued before the previous block computed
    stalls = off.stalls
    assert stalls <= 8 + n  # 8 runs' first blocks at most + the backwards run


# -- torch.inference_mode (ComfyUI runs every node under it) ----------------------------------------------------
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def write_tiny_lora(path, model, rank=2, seed=0):
    """A diffusers-format LoRA on two block linears and one non-block linear of ``model``."""
    from safetensors.torch import save_file

    from engine.features.lora import target_modules

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name in ("layers.1.self_attention.to_q", "layers.4.mlp.up_proj", "text_proj"):
        target = target_modules(model)[name]  # checkpoint names (a fused q/k/v part too)
        out_f, in_f = target.out_features, target.in_features
        sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
        sd[f"transformer.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
    save_file(sd, str(path))  # a 640-byte header: starts like pickle magic (test_checkpoint_validation)
    return str(path)


def sample(eng, seed=1):
    g = torch.Generator().manual_seed(7)
    cond = [torch.randn(7, CFG.text_in_dim, generator=g)]
    uncond = [torch.randn(4, CFG.text_in_dim, generator=g)]
    return eng.sample(torch.zeros(1, CFG.in_channels, 6, 6), cond, uncond, seed=seed, steps=2, cfg=2.5)


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("built_under", list(MODES))
def test_offload_under_inference_mode_equals_resident(tmp_path, quant, built_under):
    """ComfyUI loads the file and samples inside torch.inference_mode, the CLI under no_grad. Built
    under either, an offloaded engine samples under both (alternating), bit-equal to the resident one,
    also with a LoRA applied while offloaded (merged into the masters, or an fp8 side path) and removed.
    Old code: a model loaded under inference mode has inference-tensor Parameters; pointing their
    ``.data`` at the offload buffers left them without a version counter, and F.linear raised
    "Inference tensors do not track version counter"."""
    from engine.models.random_weights import save_random_checkpoint

    path = str(tmp_path / "six-blocks.safetensors")
    save_random_checkpoint(path, CFG, seed=0)
    with MODES[built_under]():
        ref = open_engine(path, EngineConfig(quant=quant))
        eng = open_engine(path, EngineConfig(quant=quant, offload="layerwise", resident_layers=2))
    assert eng.offload is not None
    for p in eng.model.parameters():  # normal tensors, whatever mode the model was loaded in
        assert not p.is_inference() and p._version >= 0
    base = None
    for run in ("inference_mode", "no_grad", "inference_mode"):
        with MODES[run]():
            want = sample(ref)
            assert torch.equal(sample(eng), want), run
        assert base is None or torch.equal(want, base)
        base = want
    lora = write_tiny_lora(tmp_path / "lora.safetensors", eng.model)
    with torch.inference_mode():  # as the KSampler node applies the loader's LoRAs
        for e in (ref, eng):
            e.set_loras([(lora, 0.8)])
    for run in ("inference_mode", "no_grad"):
        with MODES[run]():
            want = sample(ref)
            assert torch.equal(sample(eng), want), run
            assert not torch.equal(want, base)
    with torch.inference_mode():
        for e in (ref, eng):
            e.set_loras([])
        assert torch.equal(sample(eng), base)


# -- memory is given back by reference counting (no gc.collect() needed) ---------------------------------------
def storage_ref(t):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


@pytest.fixture
def no_gc():
    """Garbage collection off: what is freed here is freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_remove_frees_buffers_masters_and_the_offloader_without_gc(no_gc):
    """remove(): the device slots and the (pinned, on a GPU) masters are freed at once, the offloader
    as soon as its last reference goes; the model runs as before, its blocks in plain CPU tensors.
    Old code: the offloader referenced itself (torch.compiler.disable wrappers of its own bound methods
    stored on it) and the model referenced it back, and the blocks kept pointing into the masters."""
    ref = random_model(CFG, seed=0)
    model = random_model(CFG, seed=0)
    x = inputs()
    with torch.inference_mode():
        want = ref(*x)
        off = O.apply_layerwise_offload(model, "cpu", 2)
        assert torch.equal(model(*x), want)
    slots = [storage_ref(s.buf) for s in off.slots]
    masters = [storage_ref(s.master) for s in off.stores]
    assert len(slots) == 2 and len(masters) == CFG.num_layers
    assert not any(w.expired() for w in slots + masters)
    gone = weakref.ref(off)
    off.remove()
    assert all(w.expired() for w in slots + masters)
    del off
    assert gone() is None
    assert O.get_offload(model) is None and type(model.layers) is torch.nn.ModuleList
    with torch.inference_mode():
        assert torch.equal(model(*x), want)
    with torch.no_grad():
        assert torch.equal(model(*x), want)
    O.apply_layerwise_offload(model, "cpu", 3)  # and it can be offloaded again
    with torch.no_grad():
        assert torch.equal(model(*x), want)


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("with_lora", [False, True], ids=["", "lora"])
def test_released_and_dropped_engine_frees_everything_without_gc(no_gc, quant, with_lora, tmp_path):
    """What the ComfyUI model cache does: Engine.release(), then drop the engine. The offloader, the
    model, the slots and the masters are freed by reference counting, without gc.collect(); also with a
    LoRA applied (the model holds its LoRA state, which must not hold the model back)."""
    with torch.inference_mode():
        eng = Engine(random_model(CFG, seed=0), EngineConfig(quant=quant, offload="layerwise"))
        if with_lora:
            eng.set_loras([(write_tiny_lora(tmp_path / "l.safetensors", eng.model), 1.0)])
        sample(eng)
    off = eng.offload
    refs = [weakref.ref(off), weakref.ref(eng.model), weakref.ref(eng)]
    storages = [storage_ref(s.buf) for s in off.slots] + [storage_ref(s.master) for s in off.stores]
    del off
    assert eng.release() > 0
    del eng
    assert [r() for r in refs] == [None] * len(refs)
    assert all(w.expired() for w in storages)


FRESH_PROCESS = """
import gc, sys, weakref, torch
sys.path.insert(0, {root!r})
from engine.features import offload as O
from engine.models.random_weights import SIZES, random_model
assert "torch._dynamo" not in sys.modules
gc.disable()
model = random_model(SIZES["tiny"], seed=0)
off = O.apply_layerwise_offload(model, "cpu", 1)
refs = [weakref.ref(off), weakref.ref(model)]
del off, model
print([r() is None for r in refs])
"""


@pytest.mark.subprocess
def test_first_offload_in_a_process_is_freed_without_gc():
    """The first offload of a process imports torch._dynamo (for torch.compiler.disable); torch's import
    code leaves frames in reference cycles, which would hold the caller's frame (and the model) until the
    next gc: the import runs on a thread of its own. Checked in a fresh interpreter, gc disabled."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS.format(root=root)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[True, True]", out.stdout
