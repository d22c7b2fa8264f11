#!/usr/bin/env bash
# Create .venv with everything the pack, its CLI (sgld serve included) and (with --dev) its tests need.
# Idempotent: a second run only checks. Works from any folder name.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dev=0
[ "${1:-}" = "--dev" ] && dev=1
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# uv installs the same pinned versions as pip, several times faster (parallel downloads, a shared cache); pip is
# the fallback where uv cannot be had or fails (the same command again). --compile-bytecode: pip writes the .pyc
# files at install, uv only when asked, and where PYTHONDONTWRITEBYTECODE is set nothing writes them later (every
# process would compile torch again: 2 s more per import)
[ -x .venv/bin/uv ] || .venv/bin/pip install -q --disable-pip-version-check uv >/dev/null 2>&1 || true
[ -n "${PIP_CERT:-}" ] && export SSL_CERT_FILE=${SSL_CERT_FILE:-$PIP_CERT}  # the machine's CA bundle, as pip's
pip() {
  if [ -x .venv/bin/uv ] && .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python "$@"; then return 0; fi
  .venv/bin/pip install -q --disable-pip-version-check "$@"
}
stamp=.venv/.sgld-setup
want="base-$(sha1sum requirements.txt pyproject.toml | sha1sum | cut -c1-12)"
if ! grep -qx "$want" "$stamp" 2>/dev/null; then
  # torch 2.14.1 + torchvision 0.29.1 are the versions ComfyUI's requirements resolve to;
  # one torch for the CLI and the ComfyUI tests keeps the two worlds identical.
  # SGLD_TORCH_INDEX_URL: a wheel index with another build of these versions (a CPU-only one: no CUDA libraries)
  pip torch==2.14.1 torchvision==0.29.1 ${SGLD_TORCH_INDEX_URL:+--index-url "$SGLD_TORCH_INDEX_URL"}
  pip -r requirements.txt  # the nodes' imports, as ComfyUI-Manager installs them
  # the `sgld` command with its HTTP server (pyproject.toml's [serve] extra: fastapi, uvicorn, prometheus-client)
  pip -e ".[serve]"
  echo "$want" >> "$stamp"
fi
if [ "$dev" = 1 ]; then
  wantdev="dev-$(sha1sum requirements-dev.txt | cut -c1-12)"
  if ! grep -qx "$wantdev" "$stamp" 2>/dev/null; then
    pip -r requirements-dev.txt
    echo "$wantdev" >> "$stamp"
  fi
fi
