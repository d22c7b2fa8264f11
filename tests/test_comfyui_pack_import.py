"""The pack's ComfyUI entry point without ComfyUI: importable, registers nothing, imports nothing heavy."""
import os
import subprocess
import sys

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


def test_pack_entry_without_comfyui(tmp_path):
    r = subprocess.run([sys.executable, "-c", LOAD_LIKE_COMFYUI, ROOT], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_engine_importable_from_repo_root():
    r = subprocess.run([sys.executable, "-c", "import engine; print(engine.Engine.__name__)"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "Engine", r.stderr


def test_web_directory_exists():
    assert os.path.isdir(os.path.join(ROOT, "web"))
