#!/usr/bin/env bash
# Set up everything the tests need (venv, ComfyUI 0.3.75 for the real-server tests) and run them.
# Extra arguments go to pytest. pytest's exit code 5 (no tests collected) is not a failure here.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh --dev || exit 1
bash scripts/comfyui.sh || exit 1
bash scripts/browser.sh || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
[ "$rc" = 5 ] && rc=0
exit $rc
