"""The pack's ComfyUI entry point without ComfyUI: importable, registers nothing, imports nothing heavy."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOAD_LIKE_COMFYUI = r"""
import importlib.util, os, sys
root = sys.argv[1]
name = root.replace(".", "_x_")  # ComfyUI's sys.modules key for a pack folder
spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"))
mod = importlib.util.module_from_spec(spec)
sys.modules[name] = mod
spec.loader.exec_module(mod)
assert mod.NODE_CLASS_MAPPINGS == {} and mod.NODE_DISPLAY_NAME_MAPPINGS == {}, mod.NODE_CLASS_MAPPINGS
assert mod.WEB_DIRECTORY == "./web"
heavy = [m for m in ("torch", "numpy", "safetensors") if m in sys.modules]
assert not heavy, heavy
print("ok")
"""


@pytest.mark.subprocess
def test_pack_entry_without_comfyui(tmp_path):
    r = subprocess.run([sys.executable, "-c", LOAD_LIKE_COMFYUI, ROOT], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.subprocess
def test_engine_importable_from_repo_root():
    r = subprocess.run([sys.executable, "-c", "import engine; print(engine.Engine.__name__)"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "Engine", r.stderr


def test_web_directory_exists():
    assert os.path.isdir(os.path.join(ROOT, "web"))


@pytest.mark.subprocess
def test_registry_metadata_as_comfyui_reads_it():
    """pyproject.toml through ComfyUI's own parser (comfy_config, the same rules as comfy-cli)."""
    try:  # tests/ may or may not be a package
        from . import comfy_server as cs
    except ImportError:
        import comfy_server as cs

    comfy_dir = cs.ensure_comfyui()
    code = ("import json, sys; from comfy_config import config_parser; "
            "c = config_parser.extract_node_configuration(sys.argv[1]); "
            "print(json.dumps({'name': c.project.name, 'version': c.project.version, 'repo': c.project.urls.repository, "
            "'publisher': c.tool_comfy.publisher_id, 'display': c.tool_comfy.display_name, 'icon': c.tool_comfy.icon, "
            "'comfyui': c.project.supported_comfyui_version, 'deps': c.project.dependencies}))")
    r = subprocess.run([cs.python(), "-c", code, ROOT], cwd=comfy_dir, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    meta = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("name", "version", "repo", "publisher", "display", "icon", "comfyui"):
        assert meta[key], f"pyproject.toml: {key} is empty ({meta})"
    assert not any(d.split("=")[0].split(">")[0].split("<")[0].strip().lower() in ("torch", "torchvision", "torchaudio")
                   for d in meta["deps"]), meta["deps"]
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        reqs = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    assert not any(r.lower().startswith(("torch", "-r", "-e", "-c", "--")) for r in reqs), reqs


@pytest.mark.subprocess
def test_comfy_cli_node_validate():
    """`comfy node validate` (comfy-cli) if it is installed (.cache/venv-cli or PATH)."""
    import shutil

    import pytest

    cli = os.path.join(ROOT, ".cache", "venv-cli", "bin", "comfy")
    cli = cli if os.path.exists(cli) else shutil.which("comfy")
    if not cli:
        pytest.skip("comfy-cli not installed (python -m venv .cache/venv-cli && .cache/venv-cli/bin/pip install comfy-cli)")
    env = dict(os.environ, DO_NOT_TRACK="1")
    r = subprocess.run([cli, "--skip-prompt", "--no-enable-telemetry", "node", "validate"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_registry_icon_is_in_the_repository():
    import re

    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        m = re.search(r'^Icon\s*=\s*"([^"]+)"', f.read(), re.M)
    assert m, "[tool.comfy] Icon missing"
    url = m.group(1)
    hit = re.match(r"https://raw\.githubusercontent\.com/[^/]+/[^/]+/[^/]+/(.+)$", url)
    if hit:  # served from this repository: the file must exist here
        assert os.path.isfile(os.path.join(ROOT, hit.group(1))), url
