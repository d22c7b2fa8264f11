#!/usr/bin/env bash
# Set up everything the tests need (venv, ComfyUI 0.3.75 for the real-server tests) and run them.
# Extra arguments go to pytest (`-n 0`: one process). pytest's exit code 5 (no tests collected) is not a failure here.
# Two pytest-xdist workers: a test file runs whole on one of them, the costliest first (tests/conftest.py).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh --dev || exit 1
bash scripts/comfyui.sh || exit 1
bash scripts/browser.sh || exit 1
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
rc=$?
[ "$rc" = 5 ] && rc=0
exit $rc
