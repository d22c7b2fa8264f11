"""The test tiers (docs/testing.md) stay honest: every mark used in tests/ is registered in pyproject.toml
(and ``--strict-markers`` refuses the rest), and a test that starts a server, a browser or another process
carries the mark that keeps it out of the quick tier. Read from the modules' source (ast), not by running them.

A test "reaches" what it calls itself, what the module's own helpers, classes and fixtures it names call
(transitively), and a ``comfy`` argument (tests/conftest.py's ComfyUI server: conftest marks those ``server``).
"""
from __future__ import annotations

import ast
import glob
import os

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIER_MARKS = ("server", "browser", "subprocess", "gpu", "slow")
BUILTIN_MARKS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
# What each mark stands for, as the source shows it: names called (functions, classes, attributes).
SERVER_CALLS = {"start_server", "Server"}  # tests/comfy_server.py; tests/test_serve.py's `sgld serve` process
BROWSER_CALLS = {"sync_playwright", "launch_persistent_context"}
PROCESS_CALLS = {("subprocess", "run"), ("subprocess", "Popen"), ("subprocess", "check_output"),
                 ("subprocess", "check_call"), ("subprocess", "call")}
# A mark covers what it implies: a server is another process, a browser runs against a server.
IMPLIED = {"subprocess": ("subprocess", "server", "browser"), "server": ("server",), "browser": ("browser",)}


def _mark_names(decorators) -> set[str]:
    """`pytest.mark.X` and `pytest.mark.X(...)` among decorators or in a pytestmark value."""
    names = set()
    for node in decorators:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                names.add(sub.attr)
    return names


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return _mark_names([node.value])
    return set()


def _direct_needs(fn, server_classes: set[str]) -> tuple[set[str], set[str]]:
    """The marks a function's own body calls for, and the module-level names it refers to."""
    needs, refs = set(), set()
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    if any(a.arg == "comfy" for a in args):
        needs.add("server")
    refs.update(a.arg for a in args)  # fixtures of the module by name
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            refs.add(node.id)
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in SERVER_CALLS or name in server_classes:
            needs.add("server")
        if name in BROWSER_CALLS:
            needs.add("browser")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in PROCESS_CALLS:
            needs.add("subprocess")
            if f.attr == "Popen" and any(isinstance(c, ast.Constant) and c.value == "serve" for c in ast.walk(node)):
                needs.add("server")  # a `sgld serve` process
    return needs, refs


def missing_marks(source: str, folder: str | None = None) -> dict[str, set[str]]:
    """{test name: the tier marks its source calls for and it does not carry} for one test module; names it
    imports from another test module in ``folder`` (a shared fixture, a server class) count as that module's."""
    tree = ast.parse(source)
    if folder:
        tree.body[:0] = _imported_defs(tree, folder)
    module = _module_marks(tree)
    server_classes = {c.name for c in tree.body if isinstance(c, ast.ClassDef)
                      and any(isinstance(b, ast.Name) and b.id in SERVER_CALLS for b in c.bases)}
    defs = {}  # module-level functions, and classes as the union of their methods
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            fns = [node] if isinstance(node, ast.FunctionDef) else [
                m for m in node.body if isinstance(m, ast.FunctionDef)]
            needs, refs = set(), set()
            for fn in fns:
                n, r = _direct_needs(fn, server_classes)
                needs |= n
                refs |= r
            defs[node.name] = (node, needs, refs)

    def reach(name, seen):
        if name in seen or name not in defs:
            return set()
        seen.add(name)
        _, needs, refs = defs[name]
        return needs.union(*(reach(r, seen) for r in refs))

    out = {}
    for name, (node, _, _) in defs.items():
        if not (name.startswith("test_") and isinstance(node, ast.FunctionDef)):
            continue
        carried = module | _mark_names(node.decorator_list)
        if _uses_comfy(node, defs):
            carried.add("server")  # tests/conftest.py marks every test that uses `comfy`
        needed = reach(name, set())
        missing = {m for m in needed if not any(c in carried for c in IMPLIED.get(m, (m,)))}
        if missing:
            out[name] = missing
    return out


def _imported_defs(tree: ast.Module, folder: str) -> list:
    """The definitions `from test_x import a, b` brings in, read from folder/test_x.py."""
    found = []
    for node in ast.walk(tree):
        path = os.path.join(folder, f"{getattr(node, 'module', '')}.py")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("test_") and os.path.isfile(path):
            names = {a.name for a in node.names}
            with open(path) as f:
                other = ast.parse(f.read())
            found += [d for d in other.body if isinstance(d, (ast.FunctionDef, ast.ClassDef)) and d.name in names]
    return found


def _uses_comfy(node, defs) -> bool:
    """Whether the test asks for `comfy`, itself or through the module's fixtures (conftest marks those)."""
    todo, seen = [node], set()
    while todo:
        fn = todo.pop()
        args = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        if "comfy" in args:
            return True
        for a in args:
            if a in defs and a not in seen and isinstance(defs[a][0], ast.FunctionDef):
                seen.add(a)
                todo.append(defs[a][0])
    return False


def _test_modules():
    return sorted(glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True))


def test_the_tier_marks_are_registered_and_strict():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        ini = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert sorted(m.split(":")[0] for m in ini["markers"]) == sorted(TIER_MARKS)
    assert "--strict-markers" in ini["addopts"].split()


def test_every_mark_used_is_registered():
    used = {}
    for path in _test_modules():
        with open(path) as f:
            tree = ast.parse(f.read())
        for name in _mark_names([n for n in ast.walk(tree) if isinstance(n, ast.Attribute)]):
            used.setdefault(name, os.path.basename(path))
    unknown = {m: where for m, where in used.items() if m not in BUILTIN_MARKS and m not in TIER_MARKS}
    assert not unknown, f"marks not registered in pyproject.toml: {unknown}"


def test_tests_that_start_servers_browsers_or_processes_carry_their_marks():
    wrong = {}
    for path in _test_modules():
        with open(path) as f:
            for test, marks in missing_marks(f.read(), os.path.dirname(path)).items():
                wrong[f"{os.path.basename(path)}::{test}"] = sorted(marks)
    assert not wrong, f"tests missing their tier marks (docs/testing.md): {wrong}"


def test_the_check_finds_a_missing_mark():
    """The checker itself: an unmarked server, browser and CLI run are found, through helpers and fixtures."""
    source = '''
import subprocess, pytest
from test_serve import Server

class ArticleServer(Server):
    pass

def helper():
    return subprocess.run(["sgld"])

def test_serve_process():
    subprocess.Popen(["sgld", "serve", "--port", "0"])

@pytest.fixture
def served():
    return ArticleServer("log")

def test_cli():
    helper()

def test_served(served):
    pass

def test_page(comfy):
    from playwright.sync_api import sync_playwright
    sync_playwright().start()

@pytest.mark.subprocess
def test_marked():
    helper()

def test_plain():
    pass
'''
    assert missing_marks(source) == {"test_cli": {"subprocess"}, "test_served": {"server"},
                                     "test_page": {"browser"}, "test_serve_process": {"server", "subprocess"}}
    module_marked = source.replace("import subprocess, pytest", "import subprocess, pytest\npytestmark = [pytest.mark.server]")
    assert missing_marks(module_marked) == {"test_page": {"browser"}}
