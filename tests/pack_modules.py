"""Import a module of nodes/ without ComfyUI: a stand-in package plays the pack root, so the
node's relative imports (``from ..engine import ...``) resolve and nodes/__init__.py (which needs
ComfyUI) never runs."""
import importlib
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK = "sgld_nodes_test_pack"


def _stand_ins(pack: str):
    """The stand-in pack root and its ``nodes`` package, as (name, module) pairs."""
    out = []
    for name, path in ((pack, ROOT), (pack + ".nodes", os.path.join(ROOT, "nodes"))):
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        out.append((name, mod))
    return out


def node_module(name: str):
    for mod_name, mod in _stand_ins(PACK):
        sys.modules.setdefault(mod_name, mod)
    return importlib.import_module(f"{PACK}.nodes.{name}")


def install_pack(monkeypatch, pack: str) -> None:
    """Register a stand-in pack named ``pack`` through pytest's monkeypatch (undone after the test),
    for tests that also put stand-ins for ComfyUI's own modules in place first."""
    for mod_name, mod in _stand_ins(pack):
        monkeypatch.setitem(sys.modules, mod_name, mod)
