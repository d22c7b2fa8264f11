"""The sampling options declared once (engine/sampling_options.py): one rule says which model a file is and
so its default steps and cfg, and `sgld generate`, `sgld bench`, `sgld serve` (its /v1/models card, read by the
Server Generate node), the torchrun launch and the nodes all get the same defaults from it. Their flags,
request fields and widgets are the declaration's: changing a declared default changes the parser's.

Real parts: the `sgld serve` process with tiny ERNIE-Image files (tests/test_external_files.py builds them),
the Server Generate node's own call against it, torchrun with two gloo ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests
from comfy_server import free_port
from safetensors.torch import load_file, save_file

from engine import options
from engine.cli import build_parser
from engine.cli.bench import run_settings
from engine.cli.generate import check_generate_args, model_source
from engine.cli.serve import SAMPLING as SERVE_SAMPLING
from engine.models import get
from engine.models.demo import DEMO_WEIGHTS
from engine.models.random_weights import SIZES, save_random_checkpoint
from engine.parallel import launch
from engine.sampling import cfg_on, to_sigma, to_timestep
from engine.sampling_options import MODEL_DEFAULTS, SamplingOptions, from_flags, model_defaults, model_kind

try:
    from . import pack_modules
    from .test_serve import Server
except ImportError:
    import pack_modules
    from test_serve import Server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SGLD = os.path.join(os.path.dirname(sys.executable), "sgld")
OUT = os.path.join(ROOT, "tests", "never-written.png")  # --out is checked, not written, by check_generate_args


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny ERNIE-Image checkpoints: one named like Turbo, one whose config says Turbo (the released Turbo
    config's own keys), one plain (Base), and a diffusers-style folder .../ERNIE-Image-Turbo/transformer."""
    d = tmp_path_factory.mktemp("models")
    plain = d / "tiny-ernie.safetensors"
    save_random_checkpoint(str(plain), SIZES["tiny"], seed=0)
    named = d / "ernie-image-turbo.safetensors"
    os.symlink(plain, named)
    by_config = d / "distilled.safetensors"
    save_file(load_file(str(plain)), str(by_config),
              metadata={"ernie_image_config": json.dumps({"lora_rank": 4, "use_lora": False})})
    folder = d / "ERNIE-Image-Turbo" / "transformer"
    folder.mkdir(parents=True)
    os.symlink(plain, folder / "diffusion_pytorch_model.safetensors")
    return {"demo": DEMO_WEIGHTS, "base": str(plain), "turbo_name": str(named), "turbo_config": str(by_config),
            "turbo_folder": str(folder)}


CASES = {"demo": "demo", "base": "base", "turbo_name": "turbo", "turbo_config": "turbo", "turbo_folder": "turbo"}


@pytest.mark.parametrize("case", list(CASES))
def test_one_rule_says_which_model_a_file_is(files, case):
    assert model_kind(files[case]) == CASES[case]
    assert model_defaults(files[case]) == MODEL_DEFAULTS[CASES[case]]


def test_the_defaults_are_the_releases_and_the_demos():
    assert MODEL_DEFAULTS == {"base": {"steps": 50, "cfg": 4.0}, "turbo": {"steps": 8, "cfg": 1.0},
                              "demo": {"steps": 30, "cfg": 3.0}}
    assert model_kind("/nowhere/ernie-image-turbo.safetensors") == "turbo"  # unreadable: its name decides
    assert model_kind("random:tiny") == "base"


def parse(command, *argv):
    return build_parser().parse_args([command, *argv])


def generate_defaults(model):
    """What `sgld generate` runs with (checked before anything loads: nothing is read but the DiT's header)."""
    extra = [] if model == DEMO_WEIGHTS else ["--model", model, "--text-encoder", "te", "--vae", "vae"]
    run = check_generate_args(parse("generate", "--prompt", "p", "--out", OUT, *extra))
    return {"steps": run["steps"], "cfg": run["cfg"]}


def bench_defaults(model):
    return run_settings(parse("bench", "--model", model))


def serve_defaults(model):
    """What `sgld serve` puts on its model card (cli/serve.py's rule; the real server is tested below)."""
    extra = [] if model == DEMO_WEIGHTS else ["--model", model]
    return from_flags(parse("serve", *extra), model_source(parse("serve", *extra)), SERVE_SAMPLING)


def launch_defaults(model):
    run = from_flags(launch.build_parser().parse_args(["--model", model, "--random-text", "4"]), model, launch.SAMPLING)
    return {"steps": run["steps"], "cfg": run["cfg"]}


@pytest.mark.parametrize("case", list(CASES))
def test_every_command_gets_the_same_defaults_for_the_same_file(files, case):
    """Before: `sgld generate` and `sgld bench` gave every ERNIE-Image file Base's 50 / 4 (bench 8 / 1) and only
    `sgld serve` looked at the name; the launch always 50 / 4."""
    model, expected = files[case], MODEL_DEFAULTS[CASES[case]]
    got = {"generate": generate_defaults(model), "serve": serve_defaults(model), "launch": launch_defaults(model)}
    if case != "demo":
        got["bench"] = bench_defaults(model)
    assert got == {k: expected for k in got}


def test_a_changed_per_model_default_reaches_every_command(files, monkeypatch):
    monkeypatch.setitem(get("ernie-image").sampling_defaults, "turbo", {"steps": 6, "cfg": 1.5})  # its description
    model = files["turbo_config"]
    assert generate_defaults(model) == bench_defaults(model) == serve_defaults(model) == launch_defaults(model) == {
        "steps": 6, "cfg": 1.5}


def flags_of(parser) -> dict:
    return {s: a for a in parser._actions for s in a.option_strings}


def test_the_flags_are_the_declarations():
    decl = options.declared(SamplingOptions)
    subs = build_parser()._subparsers._group_actions[0].choices
    wanted = {"generate": ("seed", "steps", "cfg", "sampler", "scheduler", "shift"), "serve": ("steps", "cfg"),
              "bench": ("steps", "cfg")}
    for command, names in wanted.items():
        flags = flags_of(subs[command])
        for name in names:
            action = flags[decl[name].flag]
            assert action.help == decl[name].help, (command, name)
            unset = decl[name].flag_default  # --shift: unset means the release's (then the declared default)
            assert action.default == (options.default_of(SamplingOptions, name) if unset is options.UNSET else unset), \
                (command, name)
    launch_flags = flags_of(launch.build_parser())
    assert all(launch_flags[decl[n].flag].help == decl[n].help for n in launch.SAMPLING)


def test_a_changed_declared_default_changes_the_parsers(monkeypatch):
    field = SamplingOptions.__dataclass_fields__["sampler"]
    monkeypatch.setattr(field, "default", "heun")
    assert parse("generate", "--prompt", "p").sampler == "heun"
    assert launch.build_parser().parse_args(["--size", "tiny", "--random-text", "4"]).sampler == "heun"
    assert check_generate_args(parse("generate", "--prompt", "p", "--out", OUT))["sampler"] == "heun"
    monkeypatch.setattr(SamplingOptions.__dataclass_fields__["seed"], "default", 7)
    assert parse("generate", "--prompt", "p").seed == 7
    remote = pack_modules.node_module("server_nodes")  # the pack's own copy of the engine (its relative imports)
    monkeypatch.setattr(remote.SamplingOptions.__dataclass_fields__["seed"], "default", 7)
    assert remote.SGLDiffusionServerGenerate.INPUT_TYPES()["required"]["seed"][1]["default"] == 7


def test_the_launch_has_every_engine_flag():
    """Before: the launch declared seven engine flags by hand, without --sp, --quant, --offload, --compile."""
    from engine.config import EngineConfig

    flags = flags_of(launch.build_parser())
    for opt in options.declared(EngineConfig).values():
        assert opt.flag in flags and all(a in flags for a in opt.flag_aliases), opt.flag
    args = launch.build_parser().parse_args(["--size", "tiny", "--random-text", "4", "--sp", "2", "--quant", "int4",
                                             "--offload", "layerwise", "--compile"])
    assert options.from_args(EngineConfig, args) == {**options.from_args(EngineConfig, args), "ulysses_degree": 2,
                                                     "quant": "int4", "offload": "layerwise", "compile": "static"}


@pytest.mark.subprocess
def test_the_launch_refuses_a_bad_flag_in_one_line():
    for argv, message in ((["--quant", "int9"], "--quant='int9' is not supported; choose one of fp8, int4"),
                          (["--steps", "0"], "--steps must be an integer from 1 to 10000 (got 0)")):
        r = subprocess.run([sys.executable, "-m", "engine.parallel.launch", "--size", "tiny", "--device", "cpu",
                            "--random-text", "4", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT})
        assert r.returncode == 2 and message in r.stderr.splitlines()[-1] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.subprocess
def test_the_launch_runs_the_engine_flags_and_the_models_defaults_on_two_ranks(files):
    """torchrun, two gloo ranks: --sp 2 --quant int4 --offload layerwise reach the ranks, and the Turbo file runs
    its 8 steps without CFG (one model call a step)."""
    r = subprocess.run([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
                        "engine.parallel.launch", "--model", files["turbo_config"], "--device", "cpu", "--sp", "2",
                        "--quant", "int4", "--offload", "layerwise", "--random-text", "4", "--width", "64", "--height",
                        "64"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["parallel"] == "2 ranks (ulysses=2)" and out["quant"] == "int4" and out["offload"]["mode"] == "layerwise"
    assert (out["steps"], out["cfg"], out["model_calls"]) == (8, 1.0, 8)


def test_request_fields_are_the_declarations():
    pytest.importorskip("fastapi")
    from engine.serve.protocol import SAMPLING_FIELDS, ImageRequest

    decl = options.declared(SamplingOptions)
    assert SAMPLING_FIELDS == {n: o.api for n, o in decl.items() if o.api}
    assert SAMPLING_FIELDS == {"seed": "seed", "steps": "num_inference_steps", "cfg": "guidance_scale"}
    assert set(SAMPLING_FIELDS.values()) <= set(ImageRequest.model_fields)


def test_cfg_on_and_the_timestep_scale_are_one_rule_each():
    assert cfg_on(4.0, []) and not cfg_on(1.0, []) and not cfg_on(4.0, None) and cfg_on(0.0, [])
    assert to_timestep(0.5) == 500.0 and to_sigma(to_timestep(0.25)) == 0.25


def test_server_generate_widgets_are_the_declarations():
    remote = pack_modules.node_module("server_nodes")
    widgets = remote.SGLDiffusionServerGenerate.INPUT_TYPES()["required"]
    declared = options.node_inputs(SamplingOptions)["required"]
    assert widgets["seed"] == declared["seed"] and widgets["seed"][1]["control_after_generate"] is True
    for name in ("steps", "cfg"):
        assert widgets[name][0] == declared[name][0]
        assert widgets[name][1]["default"] == widgets[name][1]["min"] == remote.SERVER_DEFAULT
        assert widgets[name][1]["max"] == declared[name][1]["max"]


@pytest.fixture(scope="module")
def ernie_parts(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    from test_external_files import write_text_encoder, write_vae

    d = tmp_path_factory.mktemp("parts")
    return {"te": str(write_text_encoder(d / "text_encoder", SIZES["tiny"].text_in_dim)),
            "vae": str(write_vae(d / "vae", SIZES["tiny"].in_channels))}


@pytest.mark.server
def test_the_server_and_the_server_generate_node_use_the_same_defaults(files, ernie_parts, tmp_path):
    """A real `sgld serve` of the file whose config says Turbo (no 'turbo' in its name): its card says 8 / 1
    (before: Base's 50 / 4), a request without steps runs 8 steps, and the Server Generate node left at 0 takes
    them (its own call to the server)."""
    server = Server(tmp_path / "serve.log", "--model", files["turbo_config"], "--text-encoder", ernie_parts["te"],
                    "--vae", ernie_parts["vae"]).wait_ready(120)
    url = server.url
    try:
        card = requests.get(url + "/v1/models", timeout=10).json()["data"][0]
        assert (card["default_steps"], card["default_guidance_scale"]) == (8, 1.0) == tuple(
            generate_defaults(files["turbo_config"]).values())
        r = requests.post(url + "/v1/images/generations", json={"prompt": "a red cat", "size": "32x32"}, timeout=120)
        assert r.status_code == 200 and (r.json()["num_inference_steps"], r.json()["model_calls"]) == (8, 8), r.text
        remote = pack_modules.node_module("server_nodes")
        assert remote._with_server_defaults(url, "", 0, 0, 0, 0)[2:] == (8, 1.0)
    finally:
        assert server.stop() == 0
