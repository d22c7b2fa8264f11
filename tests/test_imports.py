"""The house rules on imports (docs/architecture.md), checked on the source: no import cycle among the
modules of engine/, nodes/ and tools/, engine/ never imports ComfyUI or nodes/, neither imports tools/, and imports sit at the top of a
module except for optional dependencies (a kernel, ComfyUI's own modules, torch._dynamo)."""
from __future__ import annotations

import ast
import os
import re
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engine", "nodes", "tools")
# Imported inside a function on purpose: absent on some machines (kernels, scipy), only there inside a
# running ComfyUI (its modules), or slow to import and needed only by one option (torch._dynamo).
OPTIONAL = ("sageattention", "flash_attn", "scipy", "torch._dynamo", "comfy", "comfy_execution", "server",
            "latent_preview", "folder_paths", "comfyui_version", "aiohttp", "diffusers", "transformers",
            "comfy_kitchen", "ray")  # comfy_kitchen: the [kitchen] extra, for ComfyUI's quantized files (quant/comfy)
# ray: the [cluster] extra (sgld serve --ray)
# Imported exactly (ComfyUI's own top-level ``nodes``), or ours that need ComfyUI's model classes: the Model
# Loader builds its MODEL output only inside a running ComfyUI (tests load the loader with stand-ins).
OPTIONAL_EXACT = ("nodes", "nodes.comfy_model", "engine.serve.ray_app")  # ray_app: Ray Serve's, the [cluster] extra
COMFYUI = ("comfy", "comfy_execution", "server", "latent_preview", "folder_paths", "nodes", "comfyui_version")


def modules() -> Dict[str, str]:
    """Dotted module name -> file, for every module of the packages."""
    found = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                    found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return found


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(name: str, path: str) -> Iterator[Tuple[ast.AST, List[str], bool]]:
    """(node, absolute module names it may import, whether it runs at import time) for every import."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]

    def walk(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                yield child, [a.name for a in child.names], top
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                yield child, [base] + [f"{base}.{a.name}" for a in child.names], top
            else:
                inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, top and not inner)

    yield from walk(tree, True)


def import_graph() -> Dict[str, Set[str]]:
    mods = modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for _, names, top in imports(m, path):
            if top:
                # a module's own packages are imported before it anyway (``from . import x``): not an edge
                graph[m] |= {n for n in names if n in mods and n != m and not m.startswith(n + ".")}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


# The layers of docs/architecture.md, lowest first: a module imports only from its own layer or below.
LAYERS = [("engine.errors", "engine.options", "engine.sampling", "engine.device", "engine.compute_dtype", "engine.models.block_loop",
           "engine.image_parts"), ("engine.models.family", "engine.models.ernie_image_config"), ("engine.io",),
          ("engine.models",), ("engine.features",), ("engine.config", "engine.loading", "engine.runner"),
          ("engine.inputs", "engine.local", "engine.sampling_options", "engine.threads"),
          ("engine.text_to_image",), ("engine.engine",), ("engine.parallel",), ("engine.router",),
          # a rank's process and the torchrun launch are entry points: they open their engine through the router
          ("engine", "engine.cli", "engine.serve", "engine.parallel.worker", "engine.parallel.launch", "nodes"),
          ("tools",)]  # developer tools (not shipped) sit on top: nothing below may import them


def layer(module: str) -> int:
    """The layer of the longest prefix of ``module`` that LAYERS names."""
    best = None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > len(best[1])):
                best = (i, n)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[0]


def test_imports_run_down_the_layers():
    up = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
          for a, targets in import_graph().items() for b in sorted(targets) if layer(b) > layer(a)]
    assert up == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_engine_never_imports_comfyui_or_nodes():
    bad = []
    for m, path in modules().items():
        if m.startswith("engine"):
            for node, names, _ in imports(m, path):
                if names[0].split(".")[0] in COMFYUI:
                    bad.append(f"{path}:{node.lineno}: {names[0]}")
    assert bad == []


def test_the_shipped_packages_never_import_tools():
    """tools/ is in neither the wheel nor the Comfy Registry pack (tests/test_cli_and_packaging.py): engine/ and
    nodes/ must run without it, at import time or inside a function."""
    bad = [f"{os.path.relpath(path, ROOT)}:{node.lineno}: {names[0]}" for m, path in modules().items()
           if not m.startswith("tools") for node, names, _ in imports(m, path) if names[0].split(".")[0] == "tools"]
    assert bad == []


def test_imports_inside_functions_are_optional_dependencies_only():
    bad = []
    for m, path in modules().items():
        for node, names, top in imports(m, path):
            optional = names[0] in OPTIONAL_EXACT or any(names[0] == o or names[0].startswith(o + ".") for o in OPTIONAL)
            if not top and not optional:
                bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {names[0]}")
    assert bad == []


@pytest.mark.parametrize("source, expected", [
    ("import os\ndef f():\n    import json\n", [("os", True), ("json", False)]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import json\n", [("typing", True)]),
    ("from .b import c\n", [("engine.x.b", True)]),
])
def test_the_import_walker_sees_what_python_runs(tmp_path, source, expected):
    path = tmp_path / "a.py"
    path.write_text(source)
    assert [(names[0], top) for _, names, top in imports("engine.x.a", str(path))] == expected


# The HTTP server's packages: pyproject.toml's [serve] extra, never in ComfyUI's environment through requirements.txt.
SERVE_ONLY = ("fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic")


def reachable(start: str) -> Set[str]:
    """The modules ``start``'s modules import at import time, directly or through others."""
    graph, seen = import_graph(), set()
    stack = [m for m in graph if m == start or m.startswith(start + ".")]
    while stack:
        m = stack.pop()
        if m not in seen:
            seen.add(m)
            stack += graph[m]
    return seen


def test_no_node_module_imports_the_servers_packages():
    """Neither at import time nor inside a function, in nodes/ or in what they import of engine/."""
    mods, bad = modules(), []
    for m in sorted(reachable("nodes")):
        for node, names, _ in imports(m, mods[m]):
            if names[0].split(".")[0] in SERVE_ONLY:
                bad.append(f"{os.path.relpath(mods[m], ROOT)}:{node.lineno}: {names[0]}")
    assert bad == []
    assert "engine.serve" not in reachable("nodes") and "engine.cli" not in reachable("nodes")



def test_no_private_names_imported_across_modules():
    """A name starting with _ is its module's own (issue 26 item 5: serve/remote.py took protocol.py's _Strict): a
    relative ``from .x import _name`` in engine/ or nodes/ is refused."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.ImportFrom) and node.level:
                found += [f"{name}: from {'.' * node.level}{node.module or ''} import {a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found


# -- model facts live with the model (issue 34 item 1) ---------------------------------------------------------
# The generic layers (engine/ and nodes/ outside engine/models/) read a DiT family's facts through
# engine/models/family.py (``family_of(model)``, ``detect(keys)``); they never import a family's module nor name
# its modules, keys or classes. Checked on the AST: imports, string constants (docstrings too; an f-string is read
# with ``{}`` for its values), attribute names and identifiers. The product's name in prose ("ERNIE-Image") and
# user-facing class names (``ErnieImagePipeline``) stay allowed, and so do the word "layers" (counts in summaries) and a
# bare "layers." (a key fragment of other architectures in LoRA messages); a key "layers.N..." and ``model.layers``
# are internals.
FAMILY_MODULES = ("engine.models.ernie_image", "engine.models.zimage")
INTERNAL_WORDS = re.compile(r"\b(self_attention|adaLN\w*|x_embedder|text_proj|final_linear|final_norm|time_embedding|"
                            r"gate_proj|up_proj|gate_up|linear_fc2|to_q|to_k|to_v|to_out|norm_q|norm_k|"
                            r"all_x_embedder|all_final_layer|feed_forward|noise_refiner|context_refiner|cap_embedder|"
                            r"cap_pad_token|x_pad_token|attention_norm\d|ffn_norm\d)\b")
INTERNAL_CLASSES = re.compile(r"ErnieImage(Config|Transformer|Block)|ZImage(Config|Transformer|Block|Context)")
# modules not yet ported (test_the_pending_list_only_names_violators keeps this list honest)
PENDING: Set[str] = set()


def _internal_string(text: str) -> str:
    """What in ``text`` names a family's internals, or ''."""
    m = INTERNAL_WORDS.search(text) or INTERNAL_CLASSES.search(text)
    if m:
        return m.group(0)
    # "ErnieImage": ComfyUI's name of the model (comfy.supported_models), the family's ``comfy_model``
    if text == "ErnieImage" or (text.startswith("layers.") and len(text) > len("layers.")):
        return text[:20]
    return ""


def family_internals(path: str, root: str = ROOT) -> List[str]:
    """'line: what' for every place the module at ``path`` (under ``root``) names a family's internals."""
    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
    found = [f"{node.lineno}: imports {names[0]}" for node, names, _ in imports(name, path)
             if any(n == f or n.startswith(f + ".") for n in names for f in FAMILY_MODULES)]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    in_fstring = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        what = ""
        if isinstance(node, ast.JoinedStr):
            what = _internal_string("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring:
            what = _internal_string(node.value)
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
            if INTERNAL_WORDS.fullmatch(node.attr) or (node.attr == "layers" and owner == "model"):
                what = f"{owner}.{node.attr}"
        elif isinstance(node, (ast.Name, ast.alias)):
            ident = node.id if isinstance(node, ast.Name) else node.name
            what = INTERNAL_CLASSES.search(ident) and ident or ""
        if what:
            found.append(f"{node.lineno}: {what}")
    return found


def generic_modules() -> Dict[str, str]:
    return {m: p for m, p in modules().items() if m.split(".")[0] in ("engine", "nodes") and not m.startswith("engine.models")}


def test_generic_layers_name_no_family_internals():
    bad = {m: family_internals(p) for m, p in generic_modules().items() if m not in PENDING}
    assert {m: found for m, found in bad.items() if found} == {}


def test_z_image_costs_one_registry_line_outside_its_folder():
    """Issue 47: what the second family added to the generic code is the import that registers it
    (engine/models/__init__.py); the rest of engine/ and nodes/ reaches it through its description alone."""
    importers = sorted({m for m, p in modules().items() if m.split(".")[0] in ("engine", "nodes")
                        and not m.startswith("engine.models.zimage")
                        for _, names, _ in imports(m, p) if any("zimage" in n for n in names)})
    assert importers == ["engine.models"]


def test_the_pending_list_only_names_violators():
    mods = generic_modules()
    assert sorted(m for m in PENDING if m not in mods or not family_internals(mods[m])) == []


@pytest.mark.parametrize("source, caught", [
    ("from ..models.ernie_image import Attention\n", True),
    ("from ..models import ernie_image\n", True),
    ("x = model.layers\n", True),
    ("def f(block):\n    return block.self_attention.heads\n", True),
    ("k = f'layers.{i}.{name}'\n", True),
    ("SIG = ('layers.0.adaLN_sa_ln.weight',)\n", True),
    ("native = getattr(comfy.supported_models, 'ErnieImage', None)\n", True),
    ("'''Swap diffusers' ErnieImageTransformer2DModel.'''\n", True),
    ("from ..models.zimage.model import ZImageContext\n", True),
    ("k = 'noise_refiner.0.feed_forward.w1.weight'\n", True),
    ("from ..models.family import family_of\nblocks = family_of(model).blocks_of(model)\n", False),
    ("'''Runs ERNIE-Image; see ErnieImagePipeline.'''\nFRAG = ('layers.', 'Lumina2')\nn = {'layers': len(plan.layers)}\n", False),
])
def test_the_family_scan_catches_internals(tmp_path, source, caught):
    path = tmp_path / "engine" / "features" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert bool(family_internals(str(path), str(tmp_path))) is caught


# -- the demo is a description too (issue 47) --------------------------------------------------------------------
# The embedded demo registers a ``Bundle`` (engine/models/bundle.py) and the generic layers ask the registry: none may
# import engine.models.demo or name it in an identifier (prose and its "demo" model name in strings stay allowed).
# The modules below still do (test_the_demo_pending_list_only_names_violators keeps the list honest); each one ported
# leaves it.
DEMO_PENDING: Set[str] = {
    "engine",  # the public API: open_demo and DEMO (docs/python.md)
    "nodes", "nodes.demo"}  # the demo's own ComfyUI nodes


def demo_mentions(path: str, root: str = ROOT) -> List[str]:
    """'line: what' for every place the module at ``path`` imports the demo's package or names the demo in an
    identifier (a variable, attribute, function, class or imported name)."""
    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
    found = [f"{node.lineno}: imports {n}" for node, names, _ in imports(name, path) for n in names[1:] or names
             if n == "engine.models.demo" or n.startswith("engine.models.demo.")]
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        ident = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                 else node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.alias))
                 else None)
        if ident and "demo" in ident.lower():
            found.append(f"{node.lineno}: {ident}")
    return found


def test_generic_layers_ask_the_demos_description():
    bad = {m: demo_mentions(p) for m, p in generic_modules().items() if m not in DEMO_PENDING}
    assert {m: found for m, found in bad.items() if found} == {}


def test_the_demo_pending_list_only_names_violators():
    mods = generic_modules()
    assert sorted(m for m in DEMO_PENDING if m not in mods or not demo_mentions(mods[m])) == []


MAX_LINES = 450  # a module that says one thing stays readable in one sitting (issue 34)


def test_no_module_is_over_the_line_limit():
    long = {}
    for m, path in modules().items():
        with open(path, encoding="utf-8") as f:
            count = sum(1 for _ in f)
        if count > MAX_LINES:
            long[m] = count
    assert long == {}, f"split these modules by subject (at most {MAX_LINES} lines): {long}"
