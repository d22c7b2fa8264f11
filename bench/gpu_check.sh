#!/usr/bin/env bash
# The one prepared GPU check (bench/gpu_check.py): ERNIE-Image 8B shape, random weights, 1024x1024;
# s/step and peak VRAM for bf16 eager, sage, flash, fp8, int4, bf16 compiled, and whole Turbo (8 steps)
# and Base (50 steps, cfg 4) runs, in under 8 minutes. Prints a markdown table (also $OUT/gpu_check.md).
#
#   bash bench/gpu_check.sh                 # on a GPU machine, from a fresh checkout
#   bash bench/gpu_check.sh --size tiny     # anywhere (CPU smoke run)
#   bash bench/gpu_check.sh --offload       # only the layer-wise offload figures (resident vs offload,
#                                           # bf16/fp8, Turbo/Base step, peak VRAM; ~2-3 min on an H200)
#
# Set-up needs no network: it uses the first Python that imports torch ($PYTHON, .venv, python3,
# python); when none does, it tries pip with --no-index from local wheel folders ($WHEELS,
# $PIP_FIND_LINKS, ~/wheels, /wheels, /opt/wheels). Optional kernels (sageattention, flash-attn,
# triton) are used when that Python has them and reported as missing otherwise. The engine itself
# needs only torch.
set -u
cd "$(dirname "$0")/.."

has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }

PY=""
for c in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$c" ] || continue
  command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
  if has_torch "$c"; then PY="$c"; break; fi
done

if [ -z "$PY" ]; then
  BASE=$(command -v python3 || command -v python || true)
  if [ -z "$BASE" ]; then echo "gpu_check: no Python found"; exit 1; fi
  for d in "${WHEELS:-}" "${PIP_FIND_LINKS:-}" "$HOME/wheels" /wheels /opt/wheels; do
    [ -n "$d" ] && [ -d "$d" ] || continue
    echo "gpu_check: installing torch from local wheels in $d (no network)"
    "$BASE" -m venv --system-site-packages "${TMPDIR:-/tmp}/sgld_gpu_check_venv" >/dev/null 2>&1 || true
    VPY="${TMPDIR:-/tmp}/sgld_gpu_check_venv/bin/python"; [ -x "$VPY" ] || VPY="$BASE"
    "$VPY" -m pip install --no-index --find-links "$d" torch >/dev/null 2>&1 || true
    for extra in sageattention flash-attn triton; do
      "$VPY" -m pip install --no-index --find-links "$d" "$extra" >/dev/null 2>&1 || true
    done
    if has_torch "$VPY"; then PY="$VPY"; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no Python with torch on this machine and no local torch wheel; nothing measured"
  exit 1
fi

"$PY" - <<'PYEOF'
import torch
print(f"gpu_check: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
PYEOF

# Inductor / Triton caches outside the checkout; a second run on the same machine reuses the kernels.
CACHE="${TMPDIR:-/tmp}/sgld_gpu_check"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$CACHE/inductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$CACHE/triton}"
# hard stop a little under 8 minutes, whatever happens inside
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-470}" "$PY" bench/gpu_check.py "$@"
