"""Time to apply, switch and remove a rank-32 LoRA at the ERNIE-Image 8B shape on the CPU (random weights).

The whole 8B model in bf16 is 16 GB (plus up to 8 GB of restore record, 16 GB with ``--restore copy``,
while a LoRA covering every linear is on), more than a shared 24 GiB machine can spare. So the model is built with the 8B widths
(hidden 4096, FFN 12288, text 3072) and only ``--layers`` blocks (default 1 and 3), every weight real
and random; the time is measured for each depth and extrapolated linearly to the release's 36 blocks:
t(36) = t(a) + (36 - a) * (t(b) - t(a)) / (b - a). The LoRA targets the 7 linears of every block
(to_q/k/v, to_out.0, gate/up_proj, linear_fc2) plus the non-block linears (text_proj, time_embedding,
adaLN_modulation.1, final_norm.linear, final_linear): the widest coverage trainers produce.

Each timing is the median of ``--repeat`` runs of ``Engine.set_loras`` (engine/features/lora):
  apply       base -> LoRA at strength 1 (fp32 merge a block of rows at a time, int8 restore record)
  strength    LoRA at 1 -> the same LoRA at 0.5 (restore, then merge again)
  switch      LoRA A -> LoRA B (same layers)
  remove      LoRA -> base (bit-exact restore; checked by a hash of every touched weight)
  read        reading the LoRA file (safetensors) and matching its keys

    .venv/bin/python bench/speed/lora_bench.py [--layers 1 3] [--threads 1] [--repeat 3] [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

RANK = 32
FULL_LAYERS = 36


def lora_state_dict(model, rank: int, seed: int) -> dict:
    from engine.features.lora import target_modules

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in target_modules(model).items():
        if getattr(m, "in_features", None) is None:  # a conv; linears, quantized ones and fused parts (RowView) stay
            continue
        sd[f"diffusion_model.{name}.lora_A.weight"] = (torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5).to(torch.bfloat16)
        sd[f"diffusion_model.{name}.lora_B.weight"] = (torch.randn(m.out_features, rank, generator=g) * 1e-3).to(torch.bfloat16)
    return sd


def digest(model, names) -> str:
    h = hashlib.sha256()
    for n in names:
        h.update(model.get_submodule(n).weight.view(torch.uint8).reshape(-1).numpy().tobytes())
    return h.hexdigest()


def measure(layers: int, repeat: int, tmp: str) -> dict:
    from safetensors.torch import save_file

    from engine import open_engine
    from engine.features import patching
    from engine.features.lora import read_lora
    from engine.io.load import build_model
    from engine.models.ernie_image import ErnieImageConfig

    cfg = ErnieImageConfig(num_layers=layers)
    torch.manual_seed(0)
    model = build_model(cfg, "cpu").to(torch.bfloat16).eval().requires_grad_(False)  # random init, the 8B widths
    eng = open_engine(model)
    paths = []
    for seed in (1, 2):
        p = os.path.join(tmp, f"lora{layers}_{seed}.safetensors")
        save_file(lora_state_dict(model, RANK, seed), p)
        paths.append(p)
    t = time.perf_counter()
    files = [read_lora(p, model) for p in paths]
    read_s = (time.perf_counter() - t) / 2
    touched = sorted(files[0].entries)
    h0 = digest(model, touched)
    times = {"apply": [], "strength": [], "switch": [], "remove": []}
    backup = 0
    for _ in range(repeat):
        for key, spec in (("apply", [(files[0], 1.0)]), ("strength", [(files[0], 0.5)]), ("switch", [(files[1], 1.0)]),
                          ("remove", [])):
            t = time.perf_counter()
            eng.set_loras(spec)
            times[key].append(time.perf_counter() - t)
            state = patching.get(model, "lora")  # None once the base is back
            backup = max(backup, state.backup_bytes if state is not None else 0)
        assert digest(model, touched) == h0, "the base did not come back bit-exactly"
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"layers": layers, "read_s": read_s, **{k: statistics.median(v) for k, v in times.items()},
            "weight_bytes": weight_bytes, "backup_bytes": backup, "lora_bytes": files[0].nbytes,
            "touched_layers": len(touched)}


def extrapolate(a: dict, b: dict, key: str) -> float:
    slope = (b[key] - a[key]) / (b["layers"] - a["layers"])
    return a[key] + (FULL_LAYERS - a["layers"]) * slope


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs=2, default=[1, 3], help="two block counts to measure (default 1 3)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--restore", choices=["compact", "copy"], default="compact",
                    help="SGLD_LORA_RESTORE: int8 restore record (default) or a copy of each original")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ["SGLD_LORA_RESTORE"] = args.restore
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, args.repeat, tmp) for n in args.layers]
    a, b = rows
    keys = ("read_s", "apply", "strength", "switch", "remove", "weight_bytes", "backup_bytes", "lora_bytes")
    full = {k: extrapolate(a, b, k) for k in keys}
    result = {"rank": RANK, "restore": args.restore, "threads": torch.get_num_threads(), "cpu": os.cpu_count(), "measured": rows,
              "extrapolated_36_layers": full}
    if args.json:
        print(json.dumps(result))
        return result
    gib = 2 ** 30
    print(f"rank-{RANK} LoRA on every linear, 8B widths, bf16, CPU ({result['threads']} threads), restore {args.restore}; "
          f"median of {args.repeat}")
    print("| blocks | weights GiB | LoRA MiB | read s | apply s | strength s | switch s | remove s | kept to restore GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows + [dict(full, layers=f"{FULL_LAYERS} (extrapolated)")]:
        print(f"| {r['layers']} | {r['weight_bytes'] / gib:.2f} | {r['lora_bytes'] / 2 ** 20:.0f} | {r['read_s']:.2f} | "
              f"{r['apply']:.2f} | {r['strength']:.2f} | {r['switch']:.2f} | {r['remove']:.2f} | {r['backup_bytes'] / gib:.2f} |")
    return result


if __name__ == "__main__":
    main()
