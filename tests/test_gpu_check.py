"""The GPU check (bench/gpu_check.sh) rehearsed on the CPU, so that it cannot rot between GPU windows:
the same script, rows and code paths as the H200 run (the wheel install, diffusers side by side as shipped and
on ours' kernel, Turbo end to end, cache quality, quantize-on-load from a file, the subprocess per risky row,
offload against resident, LoRA, the HTTP server, incremental reports and the rerun advice), at the tiny
shape; sage and flash need CUDA (tests/test_attention.py checks sage's split with a CPU stand-in kernel).
Also ``sgld bench``'s random model
(built in its dtype, peak stats reset before timing) and the FLOP count the check compares with."""
import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))

import gpu_check  # noqa: E402

STATUSES = ("measured", "skipped", "failed", "n/a")


def make_wheel(folder, name="sgld_probe_wheel", version="0.1"):
    """A real (tiny, pure-Python) wheel for the install step: pip installs it like the carried ones."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "VALUE = 42\n", f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: sgld-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{dist}/RECORD", "".join(f"{k},,\n" for k in files) + f"{dist}/RECORD,,\n")
    return path


def check_env(tmp_path, wheels=None):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path), "PYTHON": sys.executable,
           "PYTHONPATH": ROOT, "GPU_CHECK_WHEELS": str(wheels or tmp_path / "no-wheels")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_check(tmp_path, *args, wheels=None, timeout=600):
    return subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), *args], cwd=ROOT,
                          env=check_env(tmp_path, wheels), capture_output=True, text=True, timeout=timeout)


def read_report(tmp_path):
    out = tmp_path / "out"
    md = (out / "gpu_check.md").read_text()
    recs = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines() if line.strip()]
    return md, recs


def rows_of(recs):
    return [r for r in recs if "row" in r]


def assert_every_row_accounted_for(md, recs, cut_short=False):
    """``cut_short``: the run was killed, maybe between a row's jsonl and md appends (the md one row behind)."""
    rows = rows_of(recs)
    for r in rows:
        assert r["status"] in STATUSES, r
        if r["status"] == "measured":
            assert (r["s_per_step"] is not None or r["s_per_image"] is not None or r["row"] == "build"
                    or r.get("check")), r  # a check row (fuse-quant, a load) has its figures in the notes
        else:
            assert r["notes"].strip(), f"{r['row']} is {r['status']} without a reason"
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| row |")]
    assert [ln.split(" | ")[0][2:] for ln in table] == [r["row"] for r in rows][:len(table)]
    assert len(rows) - len(table) in ((0, 1) if cut_short else (0,))  # md and jsonl carry the same rows


@pytest.mark.subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rehearsal; a GPU machine runs the real check")
def test_cpu_rehearsal_runs_every_row_of_the_gpu_check(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    make_wheel(wheels)
    (wheels / "torch-0.0.1-py3-none-any.whl").write_text("never opened: the machine's torch stays")
    t0 = time.perf_counter()
    # a device-side fault cannot be made on a CPU: --crash-row makes the sage worker abort instead (sage cannot run
    # here anyway); the parent reports the death and the subprocess rows after it still run, each in a fresh process
    proc = run_check(tmp_path, "--size", "tiny", "--crash-row", "sage", wheels=wheels)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md, recs = read_report(tmp_path)
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    print(f"rehearsal wall time {wall:.0f} s")

    # the environment comes first, with the carried wheel installed (and the torch wheel refused)
    assert md.startswith("# gpu_check") and "env" in recs[0]
    env = recs[0]["env"]
    assert env["torch"] == torch.__version__ and "versions" in env
    assert env["carried"] == ["sgld_probe_wheel 0.1"]
    assert "carried wheels installed in" in md and "sgld_probe_wheel 0.1" in md
    assert "not installing torch-0.0.1-py3-none-any.whl" in log

    assert_every_row_accounted_for(md, recs)
    rows = rows_of(recs)
    by_name = {}
    for r in rows:
        by_name.setdefault(r["row"], []).append(r)
    assert list(by_name) == list(gpu_check.ALL_ROWS)  # in the plan's order: the article's headline claims first
    assert gpu_check.ALL_ROWS[:9] == ("build", "eager", "diffusers", "turbo", "turbo-quality", "turbo-balanced",
                                      "turbo-fast", "fp8", "sage") and gpu_check.ALL_ROWS[9] == "compiled"
    not_here = {"flash", "comfy"}  # not installed, not carried
    measured = {n for n, rs in by_name.items() if any(r["status"] == "measured" for r in rs)}
    assert measured == set(gpu_check.ALL_ROWS) - not_here - {"sage"}, {n: [r["notes"] for r in rs]
                                                                       for n, rs in by_name.items()}
    assert all(by_name[n][0]["status"] == "n/a" for n in not_here)
    sage = by_name["sage"]  # its worker died: reported by the parent
    assert len(sage) == 1 and sage[0]["status"] == "failed" and "SIGABRT" in sage[0]["notes"], sage
    assert sage[0]["process"] == "main"
    assert "not carried" in by_name["comfy"][0]["notes"]
    # issue 46: the parts around the DiT (text encoder placed as auto, VAE decode) measured; their GPU peaks beside
    # bench/memory/parts.py's prediction on a GPU (none on a CPU, said so)
    parts = by_name["parts"][0]
    assert "text encoder (tiny, auto) + VAE decode 64²" in parts["what"] and "no memory figure on a CPU" in parts["notes"]
    from gpu_check_parts import predicted
    assert set(predicted()) == {"text encoder auto", "vae 1024"}  # the figures a GPU run is compared with

    # diffusers side by side: ours, diffusers as shipped and diffusers on ours' kernel, shared weights, all agree
    d = {r["what"]: r for r in by_name["diffusers"]}
    assert len(d) == 3
    shipped = next(r for w, r in d.items() if "as shipped" in w)
    same = next(r for w, r in d.items() if "ours' attention kernel" in w)
    ours = next(r for w, r in d.items() if "ours, interleaved" in w)
    assert shipped["ratio"] > 0 and shipped["parity"] < 2e-2 and "shared storage" in shipped["notes"]
    assert same["parity"] < 2e-2 and ours["ratio_same_kernel"] > 0 and "same attention kernel" in ours["notes"]
    # Turbo end to end against diffusers in the same loop; every cache preset with its quality
    assert by_name["turbo"][0]["diffusers_s"] > 0 and "the speed of diffusers" in by_name["turbo"][0]["notes"]
    for base in ("turbo", "base"):
        for p in ("quality", "balanced", "fast"):
            q = by_name[f"{base}-{p}"][0]["quality"]
            assert q["rel_err"] >= 0 and q["psnr_db"] > 20, (base, p, q)
    for p in ("quality", "balanced", "fast"):  # the presets on fp8 weights too, against fp8's own uncached image
        q = next(r for r in by_name["fp8"] if r["what"].endswith("Cache-DiT " + p))
        assert q["speedup"] > 0 and q["quality"]["psnr_db"] > 20, q
    # fp8 / int4 / int8 / gguf opened from a file: the load (quantize-on-load) first, then inference with its own window
    for fmt in ("fp8", "int4", "int8", "gguf"):
        what = [r["what"] for r in by_name[fmt]]
        assert "quantize-on-load" in what[0] and "inference memory" in what[1], what
        assert by_name[fmt][0]["load_s"] >= 0
    assert "W8A8: torch._int_mm" in by_name["int8"][1]["notes"]  # this CPU runs the int8 kernel
    assert "GGUF Q8_0 layers" in by_name["gguf"][1]["notes"]  # the tiny model's inputs are 32-value blocks
    assert "the same tensors" in by_name["fuse-quant"][0]["notes"] and "raised" not in by_name["fuse-quant"][0]["notes"]
    # the risky rows ran in subprocesses of their own, the ones after the dead sage worker too
    for name in ("compiled", "all-on"):
        assert all(r["process"].startswith("worker pid") for r in by_name[name]), by_name[name]
    assert "sdist" in by_name["flash"][0]["notes"]
    compiled = by_name["compiled"]
    assert len(compiled) == 4  # the forward, the Turbo pair, which wins, Turbo with Cache-DiT fast
    assert "vs eager** (interleaved" in compiled[0]["notes"] and "wins" in compiled[2]["notes"]
    # offload: every ratio against a resident run of this process; remove() timed
    eng = by_name["off-engine"]
    assert "resident" in eng[0]["what"] and eng[1]["slowdown"] > 0 and "target <= 1.3x" in eng[1]["notes"]
    assert "pinned" in by_name["off-bf16"][2]["notes"] and "remove()" in by_name["off-bf16-8buf"][0]["notes"]
    # LoRA and the HTTP server
    assert {"apply_s", "switch_s", "remove_s"} <= set(by_name["lora"][0])
    assert [r["clients"] for r in by_name["serve"]] == [1, 4, 8, 8] and all(r["images_per_s"] > 0 for r in by_name["serve"])
    assert by_name["serve"][-1]["loras"] == 8  # 8 clients, each its own LoRA, through the server
    dp, = by_name["serve-dp"]  # issue 48: two CPU replicas here (one per GPU on a lend), 16 clients, beside serve's 8
    assert (dp["replicas"], dp["clients"]) == (2, 16) and dp["images_per_s"] > 0 and "of one server" in dp["notes"]
    assert recs[-2].get("footer", "").startswith("rerun (1 row(s) not measured)")  # the dead worker's row
    assert recs[-2]["footer"].endswith("Rows not measured: sage") and recs[-1].get("footer", "").startswith("wall time")
    assert (tmp_path / "out" / "rerun.txt").read_text() == recs[-2]["footer"] + "\n"


@pytest.mark.subprocess
def test_a_gpu_run_without_cuda_fails_loudly(tmp_path):
    """Without --size tiny the check is a GPU run: no CUDA means a clear failure, not a CPU run."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_check(tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "FAILED: torch.cuda.is_available() is False on a GPU run" in proc.stderr
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "FAILED" in md and "| eager |" not in md  # nothing was measured
    direct = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu", "gpu_check.py"), "--size", "small",
                             "--out", str(tmp_path / "direct")], capture_output=True, text=True, timeout=120,
                            env=check_env(tmp_path))
    assert direct.returncode == 2 and "torch.cuda.is_available() is False" in direct.stderr


@pytest.mark.subprocess
def test_a_run_cut_short_keeps_every_finished_row(tmp_path):
    """Kill the whole check (bash, timeout, python, tee) once a few rows are in: they are all on disk."""
    jsonl = tmp_path / "out" / "gpu_check.jsonl"
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--size", "tiny"], cwd=ROOT,
                            env=check_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if jsonl.exists() and '"row": "turbo"' in jsonl.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the check ended before it could be cut short"
    finally:
        kill_tree(proc)
    md, recs = read_report(tmp_path)
    assert "env" in recs[0] and "torch" in md.splitlines()[2]
    names = [r["row"] for r in rows_of(recs)]
    assert names[:4] == ["build", "eager", "diffusers", "diffusers"] and "turbo" in names
    assert not any("footer" in r for r in recs)  # it really was cut short
    assert_every_row_accounted_for(md, recs, cut_short=True)


def kill_tree(proc):
    """SIGKILL the check and everything under it, by process id (``timeout`` puts python in a process
    group of its own, so the group of bash would not reach it)."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(procs, timeout=10)
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_forward_flops_count_every_gemm_and_the_attention():
    """The physical-limit figure's FLOPs: 2 x in x out per token for every linear layer of the model
    (counted from the module tree here) plus QK^T and PV; 77 TFLOP at 8B, 1024x1024, 128 text tokens."""
    from engine.io.load import build_model
    from engine.models.random_weights import SIZES

    for size, n_img, n_txt in (("8b", 4096, 128), ("small", 256, 32)):
        cfg = SIZES[size]
        model = build_model(cfg, "meta")
        s = n_img + n_txt
        gemm = 0
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
                gemm += 2 * s * mod.in_features * mod.out_features
        gemm += 2 * n_img * cfg.in_channels * cfg.hidden_size + 2 * n_img * cfg.hidden_size * cfg.out_channels
        gemm += 2 * n_txt * cfg.text_in_dim * cfg.hidden_size
        attn = cfg.num_layers * 2 * 2 * s * s * cfg.head_dim * cfg.num_attention_heads
        assert gpu_check.forward_flops(cfg, n_img, n_txt) == gemm + attn
        assert gpu_check.attention_flops(cfg, n_img, n_txt) == attn
    assert 76e12 < gpu_check.forward_flops(SIZES["8b"], 4096, 128) < 78e12


@pytest.mark.subprocess
def test_the_wheels_folder_is_ignored_by_git():
    """.whl/ (about 6 MiB of carried wheels) travels with `carry`, never in a commit."""
    r = subprocess.run(["git", "check-ignore", "-q", ".whl/diffusers-0.42.1-py3-none-any.whl"], cwd=ROOT)
    assert r.returncode == 0


# -- sgld bench's random model (issue 18 point 4) -------------------------------------------------------------
def test_bench_random_model_is_built_in_its_dtype_without_a_float32_copy():
    """Every tensor the build makes (watched through torch's dispatcher, not patched) is bf16 or small:
    the old path drew float32 weights and cast them, 2x the model's bytes (32 GB at 8B)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from engine.cli.bench import _random_engine
    from engine.config import EngineConfig

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [(t.dtype, t.numel()) for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.device.type != "meta"]
            return out

    with Allocations() as seen:
        eng = _random_engine("small", "bf16", "cpu", EngineConfig(dtype="bf16"))
    params = list(eng.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    biggest = max(p.numel() for p in params)
    assert sum(n for dt, n in seen.made if dt == torch.bfloat16) >= sum(p.numel() for p in params)
    big_fp32 = [n for dt, n in seen.made if dt == torch.float32 and n >= biggest // 16]
    assert not big_fp32, f"float32 tensors of {big_fp32[:5]} elements were made during the build"
    x = torch.ones(1, eng.model.config.in_channels, 4, 4)
    with torch.no_grad():  # the weights are real numbers, not the empty memory of to_empty
        out = eng.model(x, torch.tensor([500.0]), torch.ones(1, 3, eng.model.config.text_in_dim), torch.tensor([3]))
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_bench_resets_the_peak_memory_window_after_the_build_and_warm_up(monkeypatch, capsys):
    """``peak_vram_gb`` is the timed part's peak, not the build's. CUDA's peak counters do not exist on a
    CPU, so the test watches the seam that resets them (``_reset_peak_memory``, a no-op off CUDA): it must
    run once, after the model exists and the warm-up forward ran, before every timed forward."""
    from engine import cli
    from engine.cli import bench as bench_command
    from engine.models.ernie_image import ErnieImageTransformer

    forwards, resets = [], []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda mod, inp: forwards.append(1) if isinstance(mod, ErnieImageTransformer) else None)
    real = bench_command._reset_peak_memory
    monkeypatch.setattr(bench_command, "_reset_peak_memory", lambda dev: (resets.append(len(forwards)), real(dev)))
    try:
        assert cli.main(["bench", "--size", "tiny", "--steps", "2", "--repeat", "3", "--json"]) == 0
    finally:
        handle.remove()
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resets == [1]  # after the build and the one warm-up forward
    assert len(forwards) == 1 + 3 + 2  # warm-up, the timed forwards, the 2-step run: all inside the window
    assert res["forward_ms_min"] > 0


# -- issue 29: what each figure measures (the seams the CPU can watch; CUDA's memory counters need a GPU) ------
def rehearsal_ctx(tmp_path, *argv):
    import gpu_check_core

    args = gpu_check.parse_args(["--size", "tiny", "--out", str(tmp_path / "out"), *argv])
    dev = gpu_check.with_defaults(args)
    args.ref = str(tmp_path / "ref.safetensors")
    return gpu_check_core.Ctx(args, dev, gpu_check.SIZES["tiny"], gpu_check_core.Report(args.out))


@pytest.mark.parametrize("fmt", ["fp8", "int4", "int8", "gguf"])
def test_quantized_rows_open_the_file_and_start_the_inference_window_after_quantization(tmp_path, monkeypatch, fmt):
    """Point 1: the fp8 / int4 rows open the bf16 file through open_engine with quant= (quantize-on-load, its own
    memory window opened with nothing of the model allocated) and time inference in a window opened after the
    model is quantized: no window opens while a bf16 model is alive, and the inference window opens after the
    load. The windows are watched through Ctx.start_window (on CUDA it resets the peak counters)."""
    import gpu_check_core
    import gpu_check_rows

    monkeypatch.setenv("SGLD_GPU_CHECK_CKPT_DIR", str(tmp_path))  # the bf16 file the row writes and opens
    ctx = rehearsal_ctx(tmp_path)
    gpu_check_rows.row_build(ctx)
    gpu_check_rows.row_eager(ctx)
    events = []
    real_window, real_open = gpu_check_core.Ctx.start_window, gpu_check_rows.open_engine

    def window(self):
        m = self.state.get("model")
        events.append(("window", None if m is None else Q.model_quant_format(m)))
        return real_window(self)

    def opened(path, config):
        events.append(("open", os.path.basename(path), config.quant))
        eng = real_open(path, config)
        events.append(("loaded", Q.model_quant_format(eng.model)))
        return eng

    from engine.features import quant as Q

    monkeypatch.setattr(gpu_check_core.Ctx, "start_window", window)
    monkeypatch.setattr(gpu_check_rows, "open_engine", opened)
    gpu_check_rows.opened(fmt)(ctx)
    assert events[0] == ("window", None) and "model" not in ctx.state  # nothing of the bf16 model left
    quant = gpu_check_rows.gguf_type(ctx.cfg) if fmt == "gguf" else fmt
    assert events[1][0] == "open" and events[1][1].endswith(".safetensors") and events[1][2] == quant
    assert events[2] == ("loaded", quant) and events[3][0] == "window"  # inference window after quantization
    rows = ctx.report.rows_named(fmt)
    assert "quantize-on-load" in rows[0]["what"] and "inference memory" in rows[1]["what"]


def test_rows_that_did_not_finish_are_named_in_the_rerun_advice(tmp_path):
    """Point 8: rows skipped for the budget or failed (not build / eager, which every run makes, nor rows left out
    on purpose) are named in the command of rerun.txt, with when it can run: at once while the machine is warm
    (~30 s), or after a fresh start (1-2 minutes) only with 6 minutes left."""
    ctx = rehearsal_ctx(tmp_path, "--skip", "lora")
    rep = ctx.report
    rep.header(["test"], {})
    rep.row("build", "skipped", notes="budget")
    rep.row("turbo", "measured", s_step=0.1)
    rep.row("sage", "n/a", notes="needs CUDA")
    rep.row("compiled", "failed", notes="the worker was stopped")
    rep.row("serve", "skipped", notes="3 s of the budget left")
    rep.row("lora", "skipped", notes="--skip")
    advice = gpu_check.rerun_advice(ctx, ["build", "eager", "turbo", "sage", "compiled", "serve", "lora", "all-on"])
    assert "--only compiled,serve,all-on" in advice
    assert "warm" in advice and "L >= 360" in advice and "budget_left_s" in advice


