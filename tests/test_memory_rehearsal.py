"""The engine rehearsed on fake CUDA tensors (bench/memory/, docs/memory.md): every configuration of the table
runs through ``open_engine`` + ``Engine.sample``, the server's batcher, ComfyUI's MODEL call or a parallel rank's
commands (2 blocks where the test is about the mechanism), the 8B release
shape gives the known byte counts, ``offload="auto"`` on each card size gives a configuration whose predicted
peak fits (36 blocks: the number), and what would not run on a GPU fails naming the op, tensor and module.
No stub: fake tensors are torch's own; only the CUDA runtime (engine/device.py's) is swapped, as on purpose."""
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "memory"))

import predict  # noqa: E402
import rehearse  # noqa: E402
import table  # noqa: E402

from engine.features.offload.auto import call_working_bytes  # noqa: E402
from engine.models import get  # noqa: E402
from engine.models.ernie_image import ErnieImageTransformer  # noqa: E402
from engine.models.ernie_image_config import ErnieImageConfig  # noqa: E402

GiB = 2 ** 30


def comfyui_here():
    """nodes/comfy_model.py with ComfyUI, which imports torchvision: a CPU-only torch needs the torchvision built
    for it (PyTorch's CPU wheel index), and where there is none the ComfyUI rows skip, naming the build. A CUDA
    build never skips here (CI has ComfyUI and its torchvision)."""
    try:
        return predict.comfy_model_module()
    except predict.Unavailable as e:
        if torch.backends.cuda.is_built() or "does not import" not in str(e):
            raise
        pytest.skip(f"torch {torch.__version__} (CPU-only build): {e}")


def test_the_device_seam_is_the_only_caller_of_torch_cuda():
    bad = []
    for folder, _, files in os.walk(os.path.join(ROOT, "engine")):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != os.path.join(ROOT, "engine", "device.py"):
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    if re.search(r"torch\.cuda\b|pin_memory=", line):
                        bad.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert bad == []


def test_release_shape_bf16_base_1024():
    """8.03B parameters in bf16 resident (fused: the same bytes), CFG batch 2 at 1024² on top, peak inside a block."""
    p = predict.predict_cached(predict.Setup("bf16"), 1024)
    assert 14.9 * GiB < p.weights_bytes < 15.1 * GiB
    assert p.weights_bytes + 0.5 * GiB < p.peak_bytes < p.weights_bytes + 2 * GiB
    assert p.where.startswith("layers.")
    assert p.pinned_host_bytes == 0


@pytest.mark.parametrize("setup", [s for s, _ in table.ROWS], ids=lambda s: s.label)
def test_every_configuration_runs(setup):
    """Each row at 1024² on two blocks of the release width; a resident single-rank run's activations (its peak
    over the weights) are within the working memory offload "auto" keeps for the family's estimate."""
    if setup.comfy:
        comfyui_here()
    p = predict.predict(setup, 1024, layers=2)
    bf16 = predict.predict_cached(predict.Setup("bf16", setup.family, model=setup.model, batch=setup.batch), 1024,
                                  layers=2)
    assert p.peak_bytes > p.weights_bytes > 0
    if setup.offload != "none":
        assert p.pinned_host_bytes > 0  # the blocks' masters, on the host side
    if setup.quant and setup.offload == "none":
        assert p.weights_bytes < bf16.weights_bytes
    if setup.offload == "none" and setup.ranks == 1:
        cfg, family = predict.release_config(setup.family), get(setup.family)
        cells = 1024 // family.latent.stride
        estimate = family.activation_bytes(cfg, (setup.rows, cfg.in_channels, cells, cells), predict.PROMPT_TOKENS,
                                           torch.bfloat16)
        assert p.peak_bytes - p.weights_bytes <= call_working_bytes(estimate), (p.peak_gib, estimate / GiB)


def test_z_image_at_its_release_shape():
    """The second family traced as the first (6.15B parameters): its bf16 weights are the bytes of the file users
    download (Comfy-Org's z_image_turbo_bf16.safetensors, listed as 11.46: 6.15B parameters in bf16 are 11.46 GiB),
    a Turbo step at 1024² sits on top, and fp8
    halves the blocks."""
    bf16 = predict.predict_cached(predict.Setup("Z-Image Turbo bf16", family="z-image", model="turbo"), 1024)
    assert abs(bf16.weights_bytes / GiB - 11.46) < 0.01, bf16.weights_bytes / GiB  # its listed size, in GiB
    assert bf16.weights_bytes + 0.3 * GiB < bf16.peak_bytes < bf16.weights_bytes + 3 * GiB, bf16.peak_gib
    fp8 = predict.predict_cached(predict.Setup("Z-Image Turbo fp8", family="z-image", model="turbo", quant="fp8"), 1024)
    assert fp8.weights_bytes < 0.6 * bf16.weights_bytes and fp8.peak_bytes < bf16.peak_bytes


def test_a_merged_lora_with_the_compact_record_is_named_untraceable():
    """The default restore record keeps, sparsely, the positions whose bit difference does not fit a byte:
    ``nonzero``, a size only the data knows (and a sync on the GPU). The rehearsal says so, naming the op;
    the table traces the merge with the "copy" record (host memory either way: the same GPU peak)."""
    with pytest.raises(rehearse.RehearsalError, match="nonzero"):
        predict.predict(predict.Setup("merged", lora_rank=8), 512, layers=1)


# fp8 at 2048² on 12 GB: resident at load, moved to host memory for the image (docs/memory.md's auto table has the
# other cards: resident from 16 GB, offloaded at load on 8 GB as bf16 is)
AUTO_CASES = [(card, None, 1024) for card in (8, 12, 16, 24)] + [(12, "fp8", 2048)] \
    + [(12, "fp8", 1024)]


@pytest.mark.parametrize("card,quant,pixels", AUTO_CASES, ids=lambda v: str(v))
def test_auto_offload_fits_each_card(card, quant, pixels):
    """The loader's ``offload="auto"`` on a card of this size (36 blocks: the real bytes), decided at load and
    again at the run's image size: the run's predicted peak fits with the desktop and the CUDA context kept,
    and a model that fits stays resident (no offload's slow-down where none is needed)."""
    p = table.auto_card(card, pixels, quant=quant)
    assert table.fits(p.peak_bytes, card), (card, p.peak_gib, p.notes)
    offloaded = p.pinned_host_bytes > 0
    if quant is None:  # bf16 is 15 GiB: offloaded at load below 24 GB, the blocks in pinned host memory
        assert offloaded == (card < 24) and not table.auto_switched(p), p.notes
        assert p.peak_bytes < 3 * GiB if offloaded else p.weights_bytes > 14.9 * GiB
    else:  # fp8 (7.7 GiB) stays resident at load from 12 GB on; a 2048² run on 12 GB moves it to host memory
        assert offloaded == (card == 8 or (card == 12 and pixels == 2048)), p.notes
        assert table.auto_switched(p) == (card == 12 and pixels == 2048), p.notes


@pytest.mark.parametrize("pixels", [1024, 2048])
def test_the_server_admits_what_fits_a_24_gb_card(pixels):
    """``sgld serve`` (max batch 8) on a 24 GB card with bf16 weights and eight Turbo jobs at once: at 1024² all
    eight share each forward; at 2048² (eight would need 32 GiB) the batcher admits by bytes, so fewer share a
    forward and the peak fits the card (36 blocks: the real bytes)."""
    setup = next(s for s, _ in table.ROWS if s.card_free_gib)
    p = predict.predict(setup, pixels)
    assert table.fits(p.peak_bytes, 24), (p.peak_gib, p.notes)
    held = [n for n in p.notes if n.startswith("admission by bytes")]
    assert bool(held) == (pixels == 2048), p.notes


def test_auto_moves_a_resident_model_for_a_larger_image_with_its_lora():
    """The switch itself on two blocks of the release width and a 4 GiB card: resident at load; a 2048² call
    needs more than is left, so the blocks move to host memory first (a LoRA side path on fp8 re-attached); the
    next, smaller call finds it offloaded. A compiled model is not moved: a warning says what to set."""
    from engine import EngineConfig, open_engine
    from engine.features.lora import active_loras
    from engine.features.offload import get_offload

    with rehearse.Rehearsal(4 * GiB) as r:
        cfg = ErnieImageConfig(num_layers=2)
        model = predict._build(r, cfg, "cuda", None)
        predict.assume_kernels("cuda:0")
        with r.all_fake():
            lora = predict._lora(model, 8)
        eng = open_engine(model, EngineConfig(device="cuda:0", attention="sdpa", quant="fp8", offload="auto"))
        eng.set_loras([(lora, 1.0)])
        assert get_offload(eng.model) is None and len(active_loras(eng.model)) == 1
        assert eng.make_room((2, 128, 64, 64), 256) is None  # 1024²: fits beside the weights
        with torch.inference_mode():
            moved = eng.make_room((2, 128, 128, 128), 256)
        assert moved.startswith("offload auto: this call needs 5.9 GiB") and "switched to layer-wise" in moved
        assert get_offload(eng.model) is not None and len(active_loras(eng.model)) == 1
        assert r.tracker.host > 0 and r.tracker.live < 1 * GiB
        assert eng.make_room((2, 128, 128, 128), 256) is None

        model = predict._build(r, cfg, "cuda", None)
        eng = open_engine(model, EngineConfig(device="cuda:0", attention="sdpa", offload="auto", compile="static"))
        msg = eng.make_room((2, 128, 128, 128), 256)
        assert "compiled model stays resident" in msg and "'layerwise'" in msg and get_offload(eng.model) is None
        assert msg in eng.warnings


def test_a_tensor_on_the_wrong_device_is_named():
    with rehearse.Rehearsal() as r:
        with r.all_fake(), torch.device("cuda"):
            model = ErnieImageTransformer(ErnieImageConfig(hidden_size=256, num_layers=1, num_attention_heads=2,
                                                           ffn_hidden_size=512, text_in_dim=32))
        r.name_modules(model)
        with r.all_fake():
            model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.empty(512, 256), requires_grad=False)
        x = torch.zeros(1, 128, 4, 4, device="cuda")
        text = torch.zeros(1, 3, 32, device="cuda")
        with pytest.raises(rehearse.RehearsalError) as e, torch.no_grad():
            model(x, torch.tensor([500.0], device="cuda"), text, torch.tensor([3]))
    msg = str(e.value)
    assert "layers.0.mlp.up_proj" in msg and "on cpu" in msg and "aten." in msg


def test_a_host_read_of_a_device_value_is_named():
    with rehearse.Rehearsal() as r, pytest.raises(rehearse.RehearsalError) as e:
        t = torch.zeros(3, device="cuda")
        r.name_modules(torch.nn.Module())
        bool(t.any())
    assert "_local_scalar_dense" in str(e.value) and "FakeTensor[] bool on cuda:0" in str(e.value)


def test_the_tracker_counts_live_bytes_and_the_peak():
    with rehearse.Rehearsal() as r:
        a = torch.empty(1000, device="cuda")  # 4000 bytes -> 4096 (512-byte blocks)
        b = torch.empty(2 ** 20, dtype=torch.uint8, device="cuda")
        view = b[10:]  # a view: no new bytes
        assert r.tracker.live == 4096 + 2 ** 20
        del b, view
        assert r.tracker.live == 4096 and r.tracker.peak.bytes == 4096 + 2 ** 20
        host = rehearse.device_rt.host_buffer(5000, pin=True)
        assert r.tracker.host == 5120 and r.tracker.live == 4096
        del a, host
        assert r.tracker.live == 0 and r.tracker.host == 0


def test_the_table_regenerates_into_its_page(tmp_path):
    text = table.table(layers=1, rows=table.ROWS[:1], pixels=(512,), log=lambda m: None)
    assert text.splitlines()[0].startswith("| configuration |") and "| Base bf16 | 512² |" in text
    page = tmp_path / "memory.md"
    page.write_text(f"intro\n{table.START}\nold\n{table.END}\nafter\n")
    table.write_page(text, str(page))
    doc = page.read_text()
    assert "old" not in doc and "| Base bf16 | 512² |" in doc and doc.endswith("after\n")


def test_the_gpu_check_prints_measured_beside_predicted(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))
    import gpu_check_predicted as gp

    page = tmp_path / "memory.md"
    page.write_text("| Base bf16 | 1024² | 16.04 | 14.96 |\n| Base bf16 | 2048² | 19.06 | 14.96 |\n"
                    "| Base bf16, offload 2 buffers | 1024² | 2.22 | 0.74 |\n")
    records = [{"row": "off-bf16", "what": "resident, Base step (CFG, batch 2), bf16", "peak_gib": 16.5},
               {"row": "off-bf16", "what": "resident, Turbo step (batch 1), bf16", "peak_gib": 15.5},
               {"row": "off-bf16", "what": "offload, 2 buffers (0 kept), Base step (CFG, batch 2), bf16", "peak_gib": 2.5}]
    line = gp.beside(records, str(page))
    assert "Base bf16: measured 16.50 GiB, predicted 16.04 GiB" in line
    assert "Base bf16, offload 2 buffers: measured 2.50 GiB, predicted 2.22 GiB" in line and "15.5" not in line
    assert gp.predicted()["Base bf16, offload 2 buffers"] > 0  # the committed page has the rows


def test_a_served_batch_is_joined_and_costs_what_the_same_batch_costs():
    """The server's Batcher under the rehearsal (its loop and job threads on the fake device): 4 Turbo jobs are
    joined in one forward (``_serve`` asserts 4 samples a forward) and cost about Turbo at batch 4 (each job's
    own embed and unembed on top), more than one job."""
    served = predict.predict(predict.Setup("served", model="turbo", served=4), 512, layers=2)
    batch = predict.predict_cached(predict.Setup("bf16", model="turbo", batch=4), 512, layers=2)
    one = predict.predict_cached(predict.Setup("bf16", model="turbo"), 512, layers=2)
    assert served.weights_bytes == batch.weights_bytes
    assert batch.peak_bytes <= served.peak_bytes < batch.peak_bytes + 0.1 * GiB, (served.peak_gib, batch.peak_gib)
    assert served.peak_bytes > one.peak_bytes + 0.2 * GiB


def test_threads_started_in_a_rehearsal_run_on_its_fake_device():
    """Several threads allocating on the fake device at once (the batcher's jobs): every tensor is fake CUDA and
    counted, under inference_mode too (there ``Tensor.to`` reaches the modes as ``aten.to``)."""
    import threading

    out = []
    with rehearse.Rehearsal() as r:
        def job():
            with torch.inference_mode():
                for _ in range(50):
                    t = torch.zeros(4, 256, dtype=torch.bfloat16, device="cuda")
                    t[0] = torch.ones(256).to(device="cuda", dtype=torch.bfloat16)
                    out.append(t.device.type)
        threads = [threading.Thread(target=job) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert r.tracker.peak.bytes >= 2048
    assert out == ["cuda"] * 150


def test_the_comfyui_model_call_reads_only_its_finite_check_on_the_host():
    """One call of ComfyUI's sampler on our MODEL (nodes/comfy_model.py EngineCall in a registered ComfyRun, x and
    the text on the device): the text lengths reach the engine on the host (ComfyUI moves tensors to the device;
    ``TextLengths`` hands them over as ints), so the one host read is the engine's per-call finite check; the
    peak is Base's CFG batch 2."""
    comfyui_here()
    p = predict.predict(predict.Setup("comfy", comfy=True), 512, layers=2)
    base = predict.predict_cached(predict.Setup("bf16"), 512, layers=2)
    reads = [n for n in p.notes if n.startswith("host read answered")]
    assert len(reads) == 1 and "bool on cuda:0 in EngineCall" in reads[0], p.notes
    assert base.peak_bytes <= p.peak_bytes < base.peak_bytes + 0.05 * GiB, (p.peak_gib, base.peak_gib)


def test_comfyuis_apply_model_leaves_the_text_lengths_on_the_host():
    """ComfyUI's own ``BaseModel._apply_model`` casts every tensor extra cond to the device; the lengths our
    model's ``extra_conds`` adds come out of ComfyUI's batching as host ints, which it passes as they are."""
    cm = comfyui_here()
    import comfy.model_base

    lens = cm.TextLengths(torch.tensor([256, 256])).concat([cm.TextLengths(torch.tensor([1, 1]))])
    assert lens == (256, 256, 1, 1)
    assert comfy.model_base.convert_tensor(lens, torch.bfloat16, torch.device("meta")) is lens


@pytest.mark.parametrize("kw", [dict(ring=2), dict(ring=2, ulysses=2), dict(cfg_parallel=2)], ids=str)
def test_ring_and_cfg_parallel_ranks_hold_less_activation(kw):
    """Ring passes K/V point-to-point (torch's fake process group shapes isend / irecv) and reads its blocks'
    valid lengths from the host copy of the key mask (CFG's padded negative: no device read); a CFG-parallel
    rank holds one branch. Every rank keeps all the weights; its peak is below the single GPU's."""
    p = predict.predict(predict.Setup("sp", **kw), 512, layers=2)
    one = predict.predict_cached(predict.Setup("bf16"), 512, layers=2)
    assert p.weights_bytes == one.weights_bytes
    assert p.weights_bytes < p.peak_bytes < one.peak_bytes, (p.peak_gib, one.peak_gib)


def test_a_cpu_only_build_dispatches_as_a_cuda_build():
    """The ops a CUDA build runs by their CUDA kernel where a CPU-only build runs their composite (the fake mode
    would see, and the tracker count, its pieces: F.rms_norm's float32 copies) are the ones cpu_build gives a
    stand-in CUDA kernel; checked on the CUDA build (CI), where a new torch could add one."""
    import cpu_build

    cpu_build.as_cuda_build()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    both = [n for n in torch._C._dispatch_get_all_op_names() if has(n, "CompositeImplicitAutograd") and has(n, "CUDA")]
    assert sorted(both) == sorted(cpu_build.WITH_COMPOSITE)


# What a CPU-only build lacks that can be taken from a CUDA build: c10's CUDA device guard, which torch's bindings
# for ``t[i]``, ``t[i] = v``, ``Tensor.copy_`` and ``Tensor.to("cuda")`` hold even on a fake CUDA tensor. (Its
# other lack, a CUDA kernel for ``_fused_rms_norm``, cannot be unregistered: the test above checks the op list.)
WITHOUT_CUDA_GUARD = r"""
import sys
sys.path.insert(0, "bench/memory")
import torch
import cpu_build
from torch._subclasses.fake_tensor import FakeTensorMode

cpu_build.registry()[int(torch._C._autograd.DeviceType.CUDA)] = None
try:
    with FakeTensorMode():
        torch.empty(2, device="cuda")[0]
    sys.exit("CUDA's device guard is still there: not what a CPU-only build has")
except RuntimeError as e:
    assert "not linked with support for cuda devices" in str(e), e
import predict
for setup in [predict.Setup(*a, **kw) for a, kw in SETUPS]:
    print(predict.predict(setup, 256, layers=1).peak_bytes)
"""


@pytest.mark.subprocess
def test_the_rehearsal_runs_without_a_cuda_device_guard():
    """What a CPU-only torch lacks, taken away from this one in a fresh process: the rehearsal still runs every
    kind of step (resident, offloaded blocks copied in, a served batch's threads) and predicts the same bytes."""
    import subprocess

    setups = [(("bf16",), {}), (("offload",), dict(offload="layerwise")), (("served",), dict(model="turbo", served=2))]
    run = subprocess.run([sys.executable, "-c", f"SETUPS = {setups!r}\n{WITHOUT_CUDA_GUARD}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    here = [predict.predict(predict.Setup(*a, **kw), 256, layers=1).peak_bytes for a, kw in setups]
    assert [int(n) for n in run.stdout.split()] == here


def test_the_whole_pipeline_fits_the_cards_the_readme_names():
    """Issue 46: the text encoder (Ministral 3 3B text tower, bf16) and the Flux2 VAE traced at their real shapes
    beside the DiT (bench/memory/parts.py). The README's GPU table is these traces' output: per card, the loader's
    DiT and ``sgld generate`` / ``serve`` / the pipeline at 1024² with the default text encoder placement (on the GPU
    only while it encodes) fit it (Turbo bf16 24 GB, fp8 16, fp8 + offload 12, bf16 + offload 2 buffers 8 with the
    encoder on the CPU), or ``card_table`` raises; the VAE's tiles keep larger pictures small."""
    import parts

    from bench.results_md import section

    te = parts.text_encoder("auto")
    assert te.weights_bytes == 0 and 6.3 * GiB < te.peak_bytes < 6.7 * GiB, te  # 3.4B parameters in bf16
    # tiles above 1024 px: 1536² (4 tiles; 2048² is 9, in bench/RESULTS.md) peaks as 1024² does
    assert parts.vae(1536, tiled=True).peak_bytes < 1.1 * parts.vae(1024, tiled=True).peak_bytes < 4 * GiB
    assert section("cards", parts.README) == parts.card_table()  # regenerate: python bench/memory/parts.py
    bf16 = predict.Setup("Turbo bf16", model="turbo")
    assert not table.fits(parts.whole(bf16, 1024, "resident").peak_bytes, 24)  # what auto saves: the encoder
    assert parts.whole(bf16, 1024, "auto").phase == "encode"  # the text encoder beside the loaded DiT sets the peak
