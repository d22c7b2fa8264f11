#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels that bench/gpu_check.sh installs on the GPU machine, into
# .whl/ (git-ignored; it travels to the GPU machine through the device tool's `carry`).
#
# The GPU machine (an H200: Python 3.12, torch 2.11.0+cu130, triton 3.6.0, no package index) lacks
# these; everything else they need at import is already there:
#   sageattention 1.0.6   the only sageattention on PyPI (Triton kernels, pure Python); needs torch and
#                         triton, both preinstalled.
#   diffusers 0.42.1      the numerical and speed reference (ErnieImageTransformer2DModel). Its
#                         requirements: filelock, huggingface-hub>=1.32 (the machine has 1.33.0), numpy,
#                         regex, requests, safetensors>=0.8.0 (0.8.0 there), Pillow: all preinstalled.
#                         importlib_metadata is only imported on Python < 3.8
#                         (diffusers/utils/import_utils.py), so it is not carried.
#   the HTTP server of the check's serve row (engine/serve under uvicorn), the versions of requirements.txt's
#   lock here: fastapi 0.165.0 (needs starlette, pydantic, typing-inspection, annotated-doc (there),
#   opentelemetry-api, typing-extensions >= 4.16), starlette 1.10.0, pydantic 2.14.4 + pydantic-core 2.50.5
#   (the one compiled wheel: cp312 manylinux2014), annotated-types 0.8.0, typing-inspection 0.4.5, uvicorn
#   0.54.0 (click, h11: there), opentelemetry-api 1.45.2, typing-extensions 4.16.0 (newer than the machine's
#   may be; it only adds names). About 3.3 MiB.
# flash-attn is not carried: PyPI has only its sdist, which compiles CUDA code for far longer than the
# GPU window; its gpu_check row says so. torch and triton are never carried (the machine's stay).
#
#   bash scripts/gpu_wheels.sh          # then, from the session with the GPU:
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=480)
#
# Every wheel but pydantic-core is pure Python (py3-none-any); the platform flags make pip take only wheels
# for CPython 3.12 on x86-64 Linux for it (and for any pin that changes to a compiled package).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in .venv/bin/python python3 python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -m pip --version >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "gpu_wheels: no Python with pip found (set PYTHON)"; exit 1; }

PINS=(sageattention==1.0.6 diffusers==0.42.1
      fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 uvicorn==0.54.0 opentelemetry-api==1.45.2 typing-extensions==4.16.0)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${PINS[@]}"

ls -l "$DEST"/*.whl | awk '{ t += $5; printf "%8.2f MiB  %s\n", $5 / 1048576, $NF }
  END { printf "%8.2f MiB  in all (the device tool carries at most 64 MiB, working tree included)\n", t / 1048576 }'
git check-ignore -q "$DEST/x.whl" || echo "gpu_wheels: WARNING: $DEST is not git-ignored; add it to .gitignore"
