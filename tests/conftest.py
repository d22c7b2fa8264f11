import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import comfy_server  # noqa: E402  (tests/ is on sys.path: pytest puts a conftest's folder there)

PROFILE_USERS = pytest.StashKey[dict]()

# The default compute dtype follows the CPU (bf16 with AVX-512 BF16 or AMX, else float32: engine/compute_dtype.py).
# The suite runs as on a CPU without them, so that what a default run computes is the same on every machine it
# runs on (and in every server it starts); tests/test_compute_dtype.py covers both kinds of CPU.
os.environ["SGLD_CPU_BF16"] = "0"
# W8A8's int8 products run through torch._int_mm on every machine the suite runs on (a CPU without VNNI / AMX takes
# the dequantized matmul unless told: engine/features/quant/int8/linear.py), so the int8 tests see its numerics
os.environ["SGLD_CPU_INT8"] = "1"

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1 under pytest-xdist (scripts/test.sh)
if WORKER:
    # Two workers on two cores: one CPU thread each (and in the processes they start), or torch's threads
    # contend and the suite runs slower than on one process.
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def comfy_profile(module) -> tuple:
    """What makes a module's ComfyUI server: its base folder's content ``comfy_base(base)`` (default:
    tests/comfy_server.py shared_base), ``COMFY_ARGS`` (extra command-line arguments) and ``COMFY_ENV`` (the
    server's extra environment: a dict, or a function of the base folder giving one). Modules with the same
    profile share one server. A module may add files of its own (LoRAs, other checkpoints) to its profile's
    base folder with ``comfy_files(base)``: they are there for that module's tests only."""
    env = getattr(module, "COMFY_ENV", {})
    return (getattr(module, "comfy_base", comfy_server.shared_base), tuple(getattr(module, "COMFY_ARGS", ())),
            env if callable(env) else tuple(sorted(env.items())))


def _uses_our_comfy(item) -> bool:
    """The test uses this file's `comfy` (test_inpaint.py and test_sampling.py have a `comfy` of their own:
    ComfyUI imported in-process)."""
    defs = getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get("comfy")
    return bool(defs) and defs[-1].func.__module__ == __name__


def pytest_collection_modifyitems(config, items):
    """Every test that uses the `comfy` server, itself or through another fixture, is a `server` test
    (docs/testing.md's tiers); tests/test_markers.py checks the marks the rest carry by hand."""
    for item in items:
        if "comfy" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.server)
    if WORKER:
        _order_for_workers(items)


# A test's rough cost for ordering the workers' queue (seconds on a 2-core machine, by its marks).
MARK_COST = {"slow": 20.0, "subprocess": 5.0, "server": 2.0}


def _order_for_workers(items) -> None:
    """Under pytest-xdist (scripts/test.sh: ``-n 2 --dist loadfile --no-loadscope-reorder``) a test file runs
    whole on one worker, so its module fixtures are made once. The files are queued costliest first
    (longest-processing-time order, so no long file starts last while the other worker idles), the files of
    one ComfyUI server profile next to each other, so a worker mostly finds its server running."""
    profile_of, cost = {}, {}
    for item in items:
        module = item.module.__name__
        if _uses_our_comfy(item):
            profile_of[module] = comfy_profile(item.module)
        marks = {m.name for m in item.iter_markers()}
        cost[module] = cost.get(module, 0.0) + 0.5 + sum(c for name, c in MARK_COST.items() if name in marks)
        measured = getattr(item.module, "ORDER_COST", None)  # a module's own measured seconds, where marks say too little
        if measured is not None:
            cost[module] = max(cost[module], float(measured))
    group_cost = {}
    for module, c in cost.items():
        group = profile_of.get(module, module)
        group_cost[group] = group_cost.get(group, 0.0) + c
    order = {}
    for module in sorted(cost, key=lambda m: (-group_cost[profile_of.get(m, m)], str(profile_of.get(m, m)), -cost[m])):
        order[module] = len(order)
    items.sort(key=lambda item: order[item.module.__name__])  # stable: a file's tests keep their order


def pytest_collection_finish(session):
    """The modules of each server profile among the tests that will run (after -k / -m), so that the
    profile's server stops after the last of them. Under xdist a worker does not know which of them it will
    run: there it keeps one idle server (ComfyServers.take)."""
    users = session.config.stash.setdefault(PROFILE_USERS, {})
    for item in session.items:
        if _uses_our_comfy(item):
            users.setdefault(comfy_profile(item.module), set()).add(item.module.__name__)


FILE_FOLDERS = ("models", "input")  # where comfy_files may add


def _tree(base: str) -> dict:
    """{path: (size, mtime) or None for a folder} of what is under ``base``'s FILE_FOLDERS."""
    found = {}
    for top in FILE_FOLDERS:
        for folder, dirs, files in os.walk(os.path.join(base, top)):
            for name in dirs:
                found[os.path.join(folder, name)] = None
            for name in files:
                st = os.stat(os.path.join(folder, name))
                found[os.path.join(folder, name)] = (st.st_size, st.st_mtime_ns)
    return found


def _add_files(base: str, comfy_files) -> list:
    """Run a module's ``comfy_files(base)``; the paths it added under FILE_FOLDERS. It may add, never change
    what is there (the other modules of the profile rely on it)."""
    before = _tree(base)
    comfy_files(base)
    after = _tree(base)
    changed = [p for p, st in before.items() if st is not None and after.get(p) != st]
    if changed:
        raise AssertionError(f"comfy_files may only add files to the shared base folder; it changed {changed}")
    return [p for p in after if p not in before]


class ComfyServers:
    """The session's ComfyUI servers, one per profile (comfy_profile), started for the first module that
    needs one and stopped after the last (the modules collected with that profile), or at the session's end;
    under xdist, when the worker needs another profile's."""

    def __init__(self, tmp_path_factory, users: dict):
        self.tmp, self.users, self.running, self.added = tmp_path_factory, users, {}, {}

    def take(self, module) -> comfy_server.ComfyServer:
        profile = comfy_profile(module)
        server = self.running.get(profile)
        if server is not None and server.alive():
            server.reset()  # the module before left its history, caches and models
        else:
            if WORKER:  # memory: each server holds about 1.3 GB; the users of the idle ones are unknown here
                self.stop_all()
            fill_base, args, env = profile
            base = str(self.tmp.mktemp("comfy"))
            fill_base(base)
            server = comfy_server.start_server(base, args, extra_env=env(base) if callable(env) else dict(env))
            self.running[profile] = server
        if hasattr(module, "comfy_files"):
            self.added[module.__name__] = _add_files(server.base, module.comfy_files)
        return server

    def release(self, module) -> None:
        for path in sorted(self.added.pop(module.__name__, ()), reverse=True):  # files before their folders
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)
        profile = comfy_profile(module)
        users = self.users.get(profile, set())
        users.discard(module.__name__)
        if not users and profile in self.running:
            self.running.pop(profile).stop()

    def stop_all(self) -> None:
        while self.running:
            self.running.popitem()[1].stop()


@pytest.fixture(scope="session")
def comfy_servers(request, tmp_path_factory):
    servers = ComfyServers(tmp_path_factory, request.config.stash.get(PROFILE_USERS, {}))
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture(scope="module")
def comfy(request, comfy_servers):
    """A real ComfyUI 0.3.75 server with this pack for the test module: the one of the module's profile
    (comfy_profile), shared with the other modules of that profile, reset (ComfyServer.reset) between them
    and stopped (its process group) after the last. A module that changes what a server is (its base
    folder's models, its process) declares a profile of its own. While the module runs, this process computes
    on the server's CPU thread count, so its in-process references are bit-comparable."""
    import torch

    server = comfy_servers.take(request.module)
    threads = torch.get_num_threads()
    torch.set_num_threads(comfy_server.server_threads())  # the module's in-process runs compute as the server
    try:
        yield server
    finally:
        torch.set_num_threads(threads)
        comfy_servers.release(request.module)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A tiny random ERNIE-Image checkpoint (real architecture) written to a temp file."""
    from engine.models.random_weights import SIZES, save_random_checkpoint

    path = tmp_path / "tiny-ernie.safetensors"
    save_random_checkpoint(str(path), SIZES["tiny"], seed=0)
    return path


@pytest.fixture(scope="module")
def eng():
    """The demo's engine in fp32, one per module that asks (a module may define its own ``eng``)."""
    import torch

    from engine import EngineConfig, open_engine

    with torch.inference_mode():
        return open_engine("demo", EngineConfig(dtype="fp32"))


@pytest.fixture
def sgld_in_process(capsys):
    """``sgld`` run in this process: (exit code, stdout, stderr). For what needs no process boundary of its own
    (refusals, a small picture): an interpreter start costs seconds; cli.main's thread setting is undone."""
    import torch

    from engine.cli import main
    threads = torch.get_num_threads()

    def run(*argv):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # --help, argparse's refusals
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err
    yield run
    torch.set_num_threads(threads)
