"""ruff, with the project's configuration (pyproject.toml [tool.ruff]), passes on the whole repository."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.subprocess]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ruff(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_ruff_passes():
    r = ruff(".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_configuration_catches_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    r = ruff("--config", os.path.join(ROOT, "pyproject.toml"), str(bad), cwd=str(tmp_path))
    assert r.returncode == 1 and "F401" in r.stdout
