#!/usr/bin/env bash
# Headless browser for the web-extension test (tests/test_web_extension.py): Debian's chromium
# (/usr/bin/chromium) from apt, driven by the Python `playwright` package (requirements-dev.txt).
# Never downloads a browser (no `playwright install`). Idempotent: a second run only checks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ ! -x /usr/bin/chromium ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends chromium
fi
if [ -x .venv/bin/python ] && ! .venv/bin/python -c "import playwright" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check playwright
fi
/usr/bin/chromium --version 2>/dev/null || true
