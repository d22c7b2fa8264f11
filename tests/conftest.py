import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import comfy_server  # noqa: E402  (tests/ is on sys.path: pytest puts a conftest's folder there)


def pytest_collection_modifyitems(config, items):
    """Every test that uses the `comfy` server, itself or through another fixture, is a `server` test
    (docs/testing.md's tiers); tests/test_markers.py checks the marks the rest carry by hand."""
    for item in items:
        if "comfy" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="module")
def comfy(request, tmp_path_factory):
    """A real ComfyUI 0.3.75 server with this pack for the whole test module, stopped (its process group) at
    the end. The module fills the server's base folder with its own ``comfy_base(base)`` (default: the folders
    alone, tests/comfy_server.py make_base_dir) and may give ``COMFY_ARGS`` (extra command-line arguments) and
    ``COMFY_ENV`` (the server's extra environment: a dict, or a function of the base folder giving one)."""
    base = str(tmp_path_factory.mktemp("comfy"))
    getattr(request.module, "comfy_base", comfy_server.make_base_dir)(base)
    env = getattr(request.module, "COMFY_ENV", {})
    server = comfy_server.start_server(base, getattr(request.module, "COMFY_ARGS", ()),
                                       extra_env=env(base) if callable(env) else env)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A tiny random ERNIE-Image checkpoint (real architecture) written to a temp file."""
    from engine.models.random_weights import SIZES, save_random_checkpoint

    path = tmp_path / "tiny-ernie.safetensors"
    save_random_checkpoint(str(path), SIZES["tiny"], seed=0)
    return path
