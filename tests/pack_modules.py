"""Import a module of nodes/ without ComfyUI: a stand-in package plays the pack root, so the
node's relative imports (``from ..engine import ...``) resolve and nodes/__init__.py (which needs
ComfyUI) never runs."""
import importlib
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK = "sgld_nodes_test_pack"


def node_module(name: str):
    pack = types.ModuleType(PACK)
    pack.__path__ = [ROOT]
    sub = types.ModuleType(PACK + ".nodes")
    sub.__path__ = [os.path.join(ROOT, "nodes")]
    sys.modules.setdefault(PACK, pack)
    sys.modules.setdefault(PACK + ".nodes", sub)
    return importlib.import_module(f"{PACK}.nodes.{name}")
