"""stable-diffusion.cpp side by side with our engine on CPU (issue 50 item 3): the same GGUF bytes, one command.

    .venv/bin/python bench/speed/sdcpp_bench.py [--write] [--steps 2] [--threads 1 2] [--dtypes bf16 fp32]

What it does, all under the git-ignored ``.cache/sdcpp/`` (reused by the next run):
1. stable-diffusion.cpp from the PyPI sdist of ``stable-diffusion-cpp-python`` (``pip download --no-binary``; its
   ``vendor/stable-diffusion.cpp``), built with our own cmake invocation for its best CPU build: Release,
   GGML_NATIVE (-march=native), GGML_LLAMAFILE (its sgemm kernels), GGML_OPENMP. Linked against it: a small driver
   of ours (DRIVER below) that loads a GGUF file as sd.cpp's ``--diffusion-model`` loader does (prefix
   ``model.diffusion_model.``, its own version detection, ``ErnieImageModel``) and times its DiT forward, with no
   text encoder or VAE (sd.cpp's CLI needs both; a step at cfg 1 is one such forward plus an Euler update).
2. A random ERNIE-Image DiT of the real depth at hidden 1024 (36 blocks, heads of 128, ffn 3072: 505M parameters),
   written once and quantized with ``sgld quantize`` into q8_0, q4_k, f16, bf16, f32 GGUF files and our int8 (W8A8).
3. Seconds per step (one DiT forward: 512², 1024 image + 64 text tokens, cfg 1) at 1 thread (process CPU time) and at
   2 threads (wall time), median of ``--steps`` after one warm-up: sd.cpp on each file, ``sgld bench --model FILE``
   with the engine's defaults (no --dtype) and with each ``--dtypes`` (one the defaults already chose is not run
   twice; where the CPU emulates bf16 these cells run at 1 thread, 1 step). The 1-thread engine figures are
   ``sgld bench`` itself with its clock read as process CPU time.
4. Prints the table with ours / sd.cpp ratios; ``--write`` puts it into bench/RESULTS.md between its markers.

The width quirk: sd.cpp's ErnieImageRunner takes the width (hidden size) from ``x_embedder.proj.weight`` but the heads
from ``norm_q`` as width / 128, in the file's tensor order, with its default width 4096 until it has met the real one.
Our GGUF files list tensors by sorted name (x_embedder last), so at any width but the release's 4096 sd.cpp would make
32 heads of 32 and refuse the norm weights. The driver hands the runner the same tensors with x_embedder first; the
bytes are unchanged. Its RoPE axes are fixed too (32, 48, 48): test models keep heads of 128. Nothing here runs in CI.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(ROOT, ".cache", "sdcpp")
PY = os.path.join(ROOT, ".venv", "bin", "python")
SGLD = os.path.join(ROOT, ".venv", "bin", "sgld")
sys.path.insert(0, ROOT)
from bench.results_md import write_section  # noqa: E402

TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> what sgld bench reports
SECTION = "## stable-diffusion.cpp side by side (CPU, issue 50)"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_LLAMAFILE=ON", "-DGGML_OPENMP=ON",
               "-DSD_BUILD_EXAMPLES=OFF", "-DSD_WEBP=OFF", "-DSD_WEBM=OFF"]
INTRO = """`.venv/bin/python bench/speed/sdcpp_bench.py --write` (the command and its flags: its docstring). It builds
stable-diffusion.cpp from the PyPI sdist of `stable-diffusion-cpp-python` under the ignored `.cache/sdcpp/` (minutes
the first time, reused after), writes one random DiT into each format with `sgld quantize`, and times both runtimes on
the same files: sd.cpp's own ERNIE-Image runner through a small driver linked against it (no text encoder or VAE),
ours through `sgld bench --model FILE`. Where the CPU has no AVX-512 BF16 or AMX, torch emulates bf16 and the engine's
default compute dtype is float32 (engine/compute_dtype.py): the defaults column is float32 there, and `--dtype bf16`
shows the emulation's cost. The width quirk (sd.cpp sizes the heads by its default width 4096 when a file lists
`x_embedder` after the blocks, as ours do) is handled in the driver without changing the bytes: see the docstring."""
# rows: (label, the file sd.cpp runs, the file our engine runs)
ROWS = [("q8_0", "q8_0", "q8_0"), ("q4_K", "q4_k", "q4_k"), ("16-bit", "f16", "bf16"),
        ("int8 W8A8 (ours) vs q8_0", "q8_0", "int8"), ("fp32", "f32", "f32")]

DRIVER = r"""// stable-diffusion.cpp's ERNIE-Image DiT alone on a GGUF file, timed per forward (bench/speed/sdcpp_bench.py).
// usage: ernie_dit_bench FILE THREADS WIDTH HEIGHT TEXT_TOKENS REPEAT FLASH_ATTN(0|1)
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include "diffusion_model.hpp"
#include "model.h"
#include "stable-diffusion.h"

static void log_cb(enum sd_log_level_t level, const char* text, void*) {
    if (level >= SD_LOG_WARN || strstr(text, "ernie_image: layers")) fputs(text, stderr);
}

int main(int argc, char** argv) {
    if (argc != 8) { fprintf(stderr, "usage: %s FILE THREADS WIDTH HEIGHT TEXT_TOKENS REPEAT FLASH_ATTN\n", argv[0]); return 2; }
    const int threads = atoi(argv[2]), width = atoi(argv[3]), height = atoi(argv[4]);
    const int tokens = atoi(argv[5]), repeat = atoi(argv[6]), flash = atoi(argv[7]);
    sd_set_log_callback(log_cb, nullptr);
    ModelLoader loader;  // what sd.cpp does with --diffusion-model FILE
    if (!loader.init_from_file(argv[1], "model.diffusion_model.")) { fprintf(stderr, "cannot read %s\n", argv[1]); return 1; }
    loader.convert_tensors_name();
    if (loader.get_sd_version() != VERSION_ERNIE_IMAGE) { fprintf(stderr, "not detected as ERNIE-Image\n"); return 1; }
    auto& storage = loader.get_tensor_storage_map();
    int64_t text_dim = storage.at("model.diffusion_model.text_proj.weight").ne[0];
    int64_t channels = storage.at("model.diffusion_model.x_embedder.proj.weight").ne[2];
    // The width quirk: ErnieImageRunner reads the width from x_embedder.proj.weight but the heads from norm_q as
    // width / head_dim in the file's tensor order, with the default width 4096 until it has seen the real one. Our
    // files (sorted names) put x_embedder last: at any width but 4096 it would make 32 heads. Same bytes, the
    // width's tensor shown first.
    const std::string xkey = "model.diffusion_model.x_embedder.proj.weight";
    String2TensorStorage ordered;
    ordered[xkey] = storage.at(xkey);
    for (const auto& [name, ts] : storage)
        if (name != xkey) ordered[name] = ts;
    ggml_backend_t backend = ggml_backend_cpu_init();
    ErnieImageModel model(backend, false, ordered, "model.diffusion_model");
    model.alloc_params_buffer();
    std::map<std::string, ggml_tensor*> tensors;
    model.get_param_tensors(tensors);
    if (!loader.load_tensors(tensors, {}, threads)) { fprintf(stderr, "load failed\n"); return 1; }
    model.set_flash_attention_enabled(flash != 0);
    std::mt19937 rng(0);
    std::normal_distribution<float> normal;
    sd::Tensor<float> x({width / 16, height / 16, channels, 1}), ctx({text_dim, tokens, 1});
    for (auto& v : x.values()) v = normal(rng);
    for (auto& v : ctx.values()) v = normal(rng);
    sd::Tensor<float> t({1}, {500.f});
    DiffusionParams p;
    p.x = &x; p.timesteps = &t; p.context = &ctx;
    std::string system = sd_get_system_info();  // one line, no " = 0" entries
    for (auto& ch : system) if (ch == '\n') ch = ' ';
    if (system.rfind("System Info:", 0) == 0) system.erase(0, 12);
    std::string flags;
    for (size_t a = 0, b; a < system.size(); a = b + 1) {
        b = system.find('|', a);
        if (b == std::string::npos) b = system.size();
        std::string item = system.substr(a, b - a);
        item.erase(0, item.find_first_not_of(" \n")), item.erase(item.find_last_not_of(" \n") + 1);
        if (!item.empty() && item.find("= 0") == std::string::npos) flags += (flags.empty() ? "" : ", ") + item;
    }
    printf("\n{\"system\": \"%s\", \"cpu_s\": [", flags.c_str());
    std::string wall = "";
    for (int i = 0; i <= repeat; i++) {  // the first: warm-up
        std::clock_t c0 = std::clock();
        auto w0 = std::chrono::steady_clock::now();
        sd::Tensor<float> out = model.compute(threads, p);
        double c = double(std::clock() - c0) / CLOCKS_PER_SEC;
        double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
        if (out.numel() != x.numel()) { fprintf(stderr, "compute failed\n"); return 1; }
        if (i > 0) {
            printf("%s%.4f", i > 1 ? ", " : "", c);
            wall += (i > 1 ? ", " : "") + std::to_string(w);
        }
    }
    printf("], \"wall_s\": [%s]}\n", wall.c_str());
    return 0;
}
"""

WRAPPER = """cmake_minimum_required(VERSION 3.21)
project(sdcpp_ernie_bench C CXX)
add_subdirectory("{src}" sdcpp)
add_executable(ernie_dit_bench ernie_dit_bench.cpp)
target_compile_definitions(ernie_dit_bench PRIVATE GGML_MAX_NAME=128)  # as sd.cpp's own sources
target_link_libraries(ernie_dit_bench PRIVATE stable-diffusion)
target_compile_features(ernie_dit_bench PRIVATE cxx_std_17)
"""

# `sgld bench` with its clock read as this process's CPU time (the 1-thread figures)
CPU_CLOCK = ("import sys, time, types; import engine.cli as c, engine.cli.bench as b; "
             "b.time = types.SimpleNamespace(perf_counter=time.process_time); sys.exit(c.main(sys.argv[1:]))")


def run(cmd, **kw):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def build_sdcpp(version: str) -> str:
    """Download the sdist, build sd.cpp and our driver (reused when built); the driver's path."""
    sdist = os.path.join(CACHE, f"stable_diffusion_cpp_python-{version}.tar.gz")
    if not os.path.exists(sdist):
        run([PY, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             f"stable-diffusion-cpp-python=={version}", "-d", CACHE])
    srcdir = os.path.join(CACHE, f"src-{version}")
    if not os.path.isdir(srcdir):
        with tarfile.open(sdist) as tar:
            tar.extractall(srcdir + ".part", filter="data")
        os.replace(srcdir + ".part", srcdir)
    vendor = glob.glob(os.path.join(srcdir, "*", "vendor", "stable-diffusion.cpp"))[0]
    if not os.path.exists(os.path.join(vendor, "src", "ernie_image.hpp")):
        raise SystemExit(f"blocked: stable-diffusion.cpp in stable-diffusion-cpp-python {version} has no ERNIE-Image")
    drv = os.path.join(CACHE, f"driver-{version}")
    os.makedirs(drv, exist_ok=True)
    for name, text in (("CMakeLists.txt", WRAPPER.format(src=vendor)), ("ernie_dit_bench.cpp", DRIVER)):
        path = os.path.join(drv, name)
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
    build = os.path.join(CACHE, f"build-{version}")
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        run(["cmake", "-S", drv, "-B", build, *CMAKE_FLAGS], stdout=subprocess.DEVNULL)
    run(["cmake", "--build", build, "--target", "ernie_dit_bench", f"-j{os.cpu_count() or 2}"], stdout=subprocess.DEVNULL)
    return os.path.join(build, "ernie_dit_bench")


def config(hidden: int):
    sys.path.insert(0, ROOT)
    from engine.models.ernie_image import ErnieImageConfig

    return ErnieImageConfig(hidden_size=hidden, num_layers=36, num_attention_heads=hidden // 128, ffn_hidden_size=3 * hidden)


def random_state_dict_shapes(hidden: int):
    import torch

    from engine.models.ernie_image import ErnieImageTransformer

    with torch.device("meta"):
        return list(ErnieImageTransformer(config(hidden)).state_dict().values())


def make_files(hidden: int) -> tuple:
    """The random DiT (fp32 safetensors, seed 0) and each weights file of the table, written once: ({name: path},
    parameters)."""
    sys.path.insert(0, ROOT)
    from engine.models.random_weights import save_random_checkpoint

    folder = os.path.join(CACHE, f"models-h{hidden}")
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, "random-fp32.safetensors")
    if not os.path.exists(base):  # heads of 128: sd.cpp's fixed RoPE axes (32, 48, 48)
        save_random_checkpoint(base + ".part", config(hidden), seed=0)
        os.replace(base + ".part", base)
    files = {}
    # the 16-bit files are 16-bit throughout (--dtype); the others keep the unquantized tensors as stored (F32)
    for fmt, dtype in (("q8_0", None), ("q4_k", None), ("f16", "fp16"), ("bf16", "bf16"), ("f32", None), ("int8", None)):
        path = os.path.join(folder, f"{fmt}.{'safetensors' if fmt == 'int8' else 'gguf'}")
        if not os.path.exists(path):
            run([SGLD, "quantize", base, path, "--format", fmt, *(["--dtype", dtype] if dtype else [])],
                stdout=subprocess.DEVNULL)
        files[fmt] = path
    return files, sum(v.numel() for v in random_state_dict_shapes(hidden))


def time_sdcpp(driver: str, path: str, threads: int, args) -> float:
    """sd.cpp's seconds per step: median process CPU time at 1 thread, wall time otherwise."""
    out = run([driver, path, str(threads), str(args.size), str(args.size), str(args.text_tokens), str(args.steps),
               "1" if args.sdcpp_flash_attn else "0"], capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    time_sdcpp.system = r["system"].replace(" = 1", "")
    return statistics.median(r["cpu_s"] if threads == 1 else r["wall_s"])


def time_engine(path: str, threads: int, dtype, steps: int, args) -> tuple:
    """``sgld bench --model path`` (its clock read as process CPU time at 1 thread): (seconds per step, dtype)."""
    flags = ["bench", "--model", path, "--threads", str(threads), "--width", str(args.size), "--height",
             str(args.size), "--text-tokens", str(args.text_tokens), "--repeat", str(steps), "--steps", "0",
             "--json", *(["--dtype", dtype] if dtype else [])]
    cmd = [PY, "-c", CPU_CLOCK, *flags] if threads == 1 else [SGLD, *flags]
    r = json.loads(run(cmd, capture_output=True, text=True, cwd=ROOT).stdout.strip().splitlines()[-1])
    return r["forward_ms_median"] / 1000, r["dtype"]


def machine() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
                platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{os.cpu_count()}-core {name} ({', '.join(simd)}; {'no ' if 'avx512_bf16' not in flags else ''}AVX-512 BF16)"


def engine_commit() -> str:
    """The checkout the engine ran from (others may edit it during a run: say when engine/ differs from it)."""
    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted engine/ changes" if git("status", "--porcelain",
                                                                                           "engine") else "")


def cell(t, ref) -> str:
    """Seconds and the ratio to stable-diffusion.cpp's, or a dash where not run."""
    return "–" if t is None else f"{t:.2f} ({t / ref:.2f}×)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.4.7", help="stable-diffusion-cpp-python sdist version")
    ap.add_argument("--hidden", type=int, default=1024, help="DiT width (36 blocks, heads of 128, ffn 3x)")
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (latent side / 16)")
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per cell, after one warm-up")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"],
                    help="explicit --dtype columns (one equal to what the defaults chose is not run again)")
    ap.add_argument("--dtype-threads", type=int, nargs="*", default=None,
                    help="thread counts of the explicit --dtype cells (default: all; the first only where the CPU "
                         "emulates bf16, several times slower)")
    ap.add_argument("--dtype-steps", type=int, default=None,
                    help="timed steps of those cells (default: --steps; 1 where the CPU emulates bf16)")
    ap.add_argument("--rows", nargs="*", default=None, help="labels' first words: q8_0 q4_K 16-bit int8 fp32")
    ap.add_argument("--sdcpp-flash-attn", action="store_true", help="sd.cpp's --diffusion-fa (off: its default)")
    ap.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from engine.compute_dtype import cpu_bf16

    if not cpu_bf16()[0]:  # emulated bf16 (~100 s a step at hidden 1024): keep the run within about 40 minutes
        args.dtype_threads = args.dtype_threads or args.threads[:1]
        args.dtype_steps = args.dtype_steps or 1
    t0, load0, commit = time.time(), os.getloadavg()[0], engine_commit()
    driver = build_sdcpp(args.version)
    files, params = make_files(args.hidden)
    rows = [r for r in ROWS if args.rows is None or r[0].split()[0] in args.rows]
    sd, ours = {}, {}  # (file, threads) -> s/step; (file, threads, dtype) -> (s/step, dtype that ran)
    for threads in args.threads:
        for _, theirs, mine in rows:
            if (theirs, threads) not in sd:
                sd[theirs, threads] = time_sdcpp(driver, files[theirs], threads, args)
            ours[mine, threads, None] = time_engine(files[mine], threads, None, args.steps, args)
            for dt in args.dtypes if args.dtype_threads is None or threads in args.dtype_threads else ():
                if TORCH_NAMES[dt] != ours[mine, threads, None][1]:
                    ours[mine, threads, dt] = time_engine(files[mine], threads, dt, args.dtype_steps or args.steps, args)
            print(f"{threads} thread(s) {mine}: sd.cpp {sd[theirs, threads]:.2f}, ours "
                  f"{ {k[2]: v for k, v in ours.items() if k[:2] == (mine, threads)} }", file=sys.stderr, flush=True)
    import torch

    defaults = sorted({v[1] for k, v in ours.items() if k[2] is None})
    cols = [dt for dt in args.dtypes if TORCH_NAMES[dt] not in defaults]
    goal = {1: 0.4, 2: 0.45}
    fa = "on (--sdcpp-flash-attn)" if args.sdcpp_flash_attn else "off, its default (on: slower here)"
    explicit = (f": threads {', '.join(map(str, args.dtype_threads or args.threads))}, median of "
                f"{args.dtype_steps or args.steps} step(s)")
    lines = [
        f"{datetime.date.today().isoformat()} · {machine()} · torch {torch.__version__} · engine at {commit} · "
        "stable-diffusion.cpp of "
        f"stable-diffusion-cpp-python {args.version}'s sdist, our cmake: {' '.join(f[2:] for f in CMAKE_FLAGS[:4])} "
        f"(ggml: {time_sdcpp.system}; its flash attention {fa}) · random ERNIE-Image "
        f"DiT, 36 blocks, hidden {args.hidden}, heads of 128, ffn {3 * args.hidden}, {params / 1e6:.0f}M parameters "
        f"· {args.size}² ({(args.size // 16) ** 2} image + {args.text_tokens} text tokens), cfg 1: a step is one "
        f"forward · median of {args.steps} steps after a warm-up · load average {load0:.1f} → "
        f"{os.getloadavg()[0]:.1f} · {(time.time() - t0) / 60:.0f} min",
        "",
        "Seconds per step (1 thread: process CPU time; 2 threads: wall time), (×) ours / stable-diffusion.cpp. Goal "
        f"with defaults: ≤ {goal[1]}× at 1 thread, ≤ {goal[2]}× at 2. The engine's defaults computed in "
        f"{' / '.join(defaults)} here" + (f"; explicit --dtype cells{explicit}." if cols else "."),
        "",
        "| weights | files (sd.cpp / ours) | threads | stable-diffusion.cpp | engine defaults | goal met "
        + "".join(f"| engine `--dtype {dt}` " for dt in cols) + "|",
        "|---|---|---|---|---|---|" + "---|" * len(cols),
    ]
    for threads in args.threads:
        for label, theirs, mine in rows:
            ref, (t, _) = sd[theirs, threads], ours[mine, threads, None]
            lines.append(f"| {label} | {theirs} / {mine} | {threads} | {ref:.2f} | {cell(t, ref)} | "
                         f"{'yes' if t / ref <= goal.get(threads, goal[2]) else 'no'} | "
                         + "".join(f"{cell(ours.get((mine, threads, dt), (None,))[0], ref)} | " for dt in cols))
    table = "\n".join(lines)
    print(table)
    if args.write:
        write_section("sdcpp_bench", table, f"{SECTION}\n\n{INTRO}")

if __name__ == "__main__":
    main()
