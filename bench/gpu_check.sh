#!/usr/bin/env bash
# The one prepared GPU check (bench/gpu/gpu_check.py says what it measures, in which order, and each row's
# estimated seconds): ERNIE-Image 8B shape, random bf16 weights, 1024x1024; the article's headline claims
# first (ours vs diffusers, Turbo end to end, Cache-DiT, FP8, sage, compile), then Base, INT4, the fuse /
# quant order, offload, LoRA, the HTTP server, all-on. Hard stop at $GPU_CHECK_TIMEOUT seconds (default
# 540), set-up included; every finished row is already in $OUT/gpu_check.md and $OUT/gpu_check.jsonl
# (appended and fsync'd as measured), the whole output in $OUT/gpu_check.log, and $OUT/rerun.txt names the
# command for the rows that did not finish.
#
# The 15 minutes of device time (bench/RESULTS.md has the row-by-row plan): the wheels first, here, where
# PyPI is reachable:
#     bash scripts/gpu_wheels.sh          # .whl/: sageattention, diffusers, the server's fastapi/uvicorn, ~9 MiB
#     run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=570)
# The machine's start takes 1-2 minutes, so about 200 s are left after it. The machine stays warm only ~30 s
# after a call and none starts with under 4 minutes left: rerun AT ONCE, while it is warm, with what
# $OUT/rerun.txt says (L = budget_left_s of the reply), e.g.
#     run(command="GPU_CHECK_TIMEOUT=$((L - 40)) bash bench/gpu_check.sh --only all-on", carry=[".whl"], timeout_s=L - 30)
# then give_back. The rehearsal, anywhere (CI runs it: tests/test_gpu_check.py):
#     bash bench/gpu_check.sh --size tiny
#
# Set-up (no network): the first Python that imports torch ($PYTHON, .venv/bin/python, python3,
# python); the machine's torch is never replaced. Wheels in $GPU_CHECK_WHEELS (default .whl/) are
# installed with pip --no-index --no-deps --target into a fresh folder put first on PYTHONPATH,
# whatever torch is there (torch, triton and nvidia-* wheels are refused). Without --size tiny (or
# --device cpu) a machine where torch.cuda.is_available() is False fails here, loudly, instead of
# measuring a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
TOTAL="${GPU_CHECK_TIMEOUT:-540}"
# the device tool gives $OUT; elsewhere a private folder of our own (0700), never a fixed name in a shared /tmp
export OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/sgld_gpu_check.XXXXXX")}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
say() { echo "gpu_check: $*" | tee -a "$LOG"; }
say "the report goes to $OUT"
fail() {  # the reason goes to the report too, so that it comes back with $OUT
  echo "gpu_check: FAILED: $*" | tee -a "$LOG" >&2
  printf '# gpu_check\n\n- **FAILED** (set-up): %s\n' "$*" > "$OUT/gpu_check.md"
  exit 2
}

REHEARSAL=0
prev=""
for a in "$@"; do
  case "$prev $a" in "--size tiny"|"--device cpu") REHEARSAL=1 ;; esac
  case "$a" in --size=tiny|--device=cpu) REHEARSAL=1 ;; esac
  prev="$a"
done

PY=""
for c in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$c" ] || continue
  command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
  if "$c" -c "import torch" >/dev/null 2>&1; then PY="$c"; break; fi
done
[ -n "$PY" ] || fail "no Python that imports torch (tried \$PYTHON, .venv/bin/python, python3, python)"

WHEELS="${GPU_CHECK_WHEELS:-.whl}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE="${TMPDIR:-/tmp}/sgld_gpu_check_site"
  rm -rf "$SITE"
  todo=()
  for f in "$WHEELS"/*.whl; do
    case "$(basename "$f")" in
      torch-*|triton-*|nvidia_*|nvidia-*) say "not installing $(basename "$f"): the machine's torch stack stays" ;;
      *) todo+=("$f") ;;
    esac
  done
  if [ "${#todo[@]}" -gt 0 ]; then
    say "installing ${#todo[@]} carried wheel(s) from $WHEELS into $SITE (no index, no dependencies)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" "${todo[@]}" >>"$LOG" 2>&1 || fail "pip could not install the wheels in $WHEELS (see $LOG)"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export SGLD_GPU_CHECK_SITE="$SITE"
  fi
else
  say "no wheels in $WHEELS: sageattention / diffusers only if this Python has them (bash scripts/gpu_wheels.sh fetches them)"
fi

# one probe (after the wheels: PYTHONPATH is final): exit 3 when CUDA is not available
"$PY" - >>"$LOG.probe" 2>&1 <<'PYEOF'
import sys, torch
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {cuda}"
      + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""))
sys.exit(0 if cuda else 3)
PYEOF
probe=$?
say "$(tail -n 1 "$LOG.probe")"
rm -f "$LOG.probe"
case "$probe" in
  0) ;;
  3) [ "$REHEARSAL" = 1 ] || fail "torch.cuda.is_available() is False on a GPU run ($PY); nothing measured. The CPU rehearsal is: bash bench/gpu_check.sh --size tiny" ;;
  *) fail "$PY could not run the torch probe (exit $probe)" ;;
esac

# A run stopped hard leaves its bf16 file (16 GB at 8B) in a private folder of /dev/shm, which is memory: a GPU
# run removes such folders of this user's before it writes its own (the rehearsal never writes there).
if [ "$REHEARSAL" = 0 ] && [ -d /dev/shm ]; then
  find /dev/shm -maxdepth 1 -type d -name 'gpu_check_ckpt_*' -user "$(id -u)" -exec rm -rf {} + 2>/dev/null
fi

# Inductor / Triton caches outside the checkout; a second run on the same machine reuses the kernels.
CACHE="${TMPDIR:-/tmp}/sgld_gpu_check"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$CACHE/inductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$CACHE/triton}"
export PYTHONUNBUFFERED=1
LEFT=$((TOTAL - SECONDS))
BUDGET=$((LEFT - 30))  # rows start only while this much is left; the rest is for the row in flight
[ "$BUDGET" -gt 0 ] || fail "no time left after set-up (${SECONDS} s of GPU_CHECK_TIMEOUT=${TOTAL})"
say "set-up took ${SECONDS} s; rows get ${BUDGET} s, hard stop in ${LEFT} s"
timeout -k 10 "$LEFT" "$PY" bench/gpu/gpu_check.py --budget "$BUDGET" "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  say "hard stop at ${TOTAL} s: every row that finished is in $OUT/gpu_check.md"
fi
exit "$rc"
