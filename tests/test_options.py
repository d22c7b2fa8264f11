"""Every option declared once (engine/options.py): the CLI, the Model Loader and Cache-DiT nodes and the
SGLANG_CACHE_DIT_* reader each know exactly the options EngineConfig and CacheConfig declare, every one of
them reaches its field, and a refused value is named as its caller spelled it.

The loader node is imported without ComfyUI: stand-ins for ``folder_paths`` and ``comfy.model_management``
(the two ComfyUI modules it imports) give it a model list and a device; nothing is loaded (the real-server
tests load through it)."""
import argparse
import importlib
import re
import sys
import types

import pytest

from engine.cli import build_parser
from engine.cli.common import add_cache_arguments, cache_config, engine_config
from engine.config import EngineConfig
from engine.features.cache import CacheConfig, CacheConfigError, from_env
from engine.features.quant import choices as quant_choices  # the format table's names
from engine.options import declared, default_of, from_widgets, node_inputs, option, text_choices

try:
    from . import pack_modules
except ImportError:
    import pack_modules

PACK = "sgld_options_test_pack"
NOT_ON_THE_LOADER = {"device"}
DEGREES = {"ulysses_degree", "ring_degree", "tp", "cfg_parallel"}  # the loader runs on ComfyUI's device
# SGLang's names, fixed: a workflow or a shell that sets them must keep working
SGLANG_VARIABLES = {"SGLANG_CACHE_DIT_" + n for n in ("ENABLED", "SCM_PRESET", "FN", "BN", "WARMUP", "RDT", "MC",
                                                       "MAX_CACHED_STEPS", "TAYLORSEER", "TS_ORDER", "SCM_POLICY",
                                                       "SCM_MASK")}
FREE_TEXT = {"device": "cuda:1", "steps_mask": "1101"}  # options without choices or a range: a sample value


def other_text(cls, name) -> str:
    """A value, as text, that the option allows and that is not its default."""
    opt = declared(cls)[name]
    default = default_of(cls, name)
    if opt.choices or opt.kind is bool:
        return next(t for t in text_choices(opt) if t not in (str(default).lower(), "off" if default is False else ""))
    if opt.kind is int:
        return str((default if default is not None else int(opt.low or 0)) + 1)
    if opt.kind is float:
        return "0.5"
    return FREE_TEXT[name]


def other_widget_value(spec):
    kind, extra = spec
    default = extra["default"]
    if isinstance(kind, list):
        return next(v for v in kind if v != default)
    if kind == "BOOLEAN":
        return not default
    if kind == "INT":
        return default + 1
    if kind == "FLOAT":
        return default + 0.5
    return FREE_TEXT["steps_mask"]


def changed_fields(a, b) -> set:
    return {n for n in declared(type(a)) if getattr(a, n) != getattr(b, n)}


# -- the command line ---------------------------------------------------------------------------------------

def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flags_of(parser) -> set:
    return {s for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_every_engine_option_is_a_flag_that_reaches_its_field(command):
    decl = declared(EngineConfig)
    assert all(opt.flag for opt in decl.values()), [n for n, o in decl.items() if not o.flag]
    parser = subparser(command)
    assert {o.flag for o in decl.values()} <= flags_of(parser)
    base = engine_config(parser.parse_args(["--prompt", "p"] if command == "generate" else []))
    assert base == EngineConfig()  # no flag: the declared defaults
    for name, opt in decl.items():
        argv = [opt.flag] if opt.kind is bool and not opt.optional else [opt.flag, other_text(EngineConfig, name)]
        args = parser.parse_args((["--prompt", "p"] if command == "generate" else []) + argv)
        assert changed_fields(engine_config(args), base) == {name}, (name, argv)


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_sglangs_flag_spellings_reach_the_same_field(command):
    """SGLang's production command says --tp 1 --sp 1: --sp is --ulysses-degree."""
    lead = ["--prompt", "p"] if command == "generate" else []
    config = engine_config(subparser(command).parse_args(lead + ["--sp", "2", "--tp", "1"]))
    assert config.ulysses_degree == 2 and changed_fields(config, EngineConfig()) == {"ulysses_degree"}


def test_every_cache_option_is_a_flag_that_reaches_its_field():
    decl = declared(CacheConfig)
    assert all(opt.flag for opt in decl.values())
    assert {o.flag for o in decl.values()} <= flags_of(subparser("generate"))
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    assert cache_config(parser.parse_args([])) is None  # no flag: the environment decides
    base = cache_config(parser.parse_args(["--cache", "on"]))
    assert base == CacheConfig()
    assert cache_config(parser.parse_args(["--cache", "off"])) == CacheConfig(enabled=False)
    for name, opt in decl.items():
        if name != "enabled":
            got = cache_config(parser.parse_args([opt.flag, other_text(CacheConfig, name)]))
            assert changed_fields(got, base) == {name}, name


# -- the environment ----------------------------------------------------------------------------------------

def test_the_environment_reader_knows_exactly_the_declared_cache_options():
    decl = declared(CacheConfig)
    assert {opt.env for opt in decl.values()} == SGLANG_VARIABLES
    on = {"SGLANG_CACHE_DIT_ENABLED": "true"}
    base = from_env(on)
    assert base == CacheConfig() and from_env({}) == CacheConfig(enabled=False)
    for name, opt in decl.items():
        if name != "enabled":
            got = from_env({**on, opt.env: other_text(CacheConfig, name)})
            assert changed_fields(got, base) == {name}, name
            # switched off, the other variables are not read (a stale bad value does not break the run)
            assert from_env({opt.env: "?bad?"}) == CacheConfig(enabled=False)


# -- the nodes ----------------------------------------------------------------------------------------------

@pytest.fixture
def loader(monkeypatch):
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.folder_names_and_paths = {"diffusion_models": ([], set())}
    folder_paths.get_filename_list = lambda folder: []
    folder_paths.get_folder_paths = lambda folder: []
    folder_paths.get_full_path = lambda folder, name: None
    comfy = types.ModuleType("comfy")
    comfy.__path__ = []
    mm = types.ModuleType("comfy.model_management")
    mm.get_torch_device = lambda: "cpu"
    comfy.model_management = mm
    for name, mod in (("folder_paths", folder_paths), ("comfy", comfy), ("comfy.model_management", mm)):
        monkeypatch.setitem(sys.modules, name, mod)
    pack_modules.install_pack(monkeypatch, PACK)
    yield importlib.import_module(PACK + ".nodes.loader")
    for name in [n for n in sys.modules if n.startswith(PACK)]:
        sys.modules.pop(name)


def test_the_loader_node_knows_exactly_the_declared_engine_options(loader):
    decl = declared(EngineConfig)
    inputs = loader.SGLDiffusionModelLoader.INPUT_TYPES()
    widgets = {**inputs["required"], **inputs["optional"]}
    assert set(widgets) - {"unet_name"} == {o.widget for o in decl.values() if o.widget}
    assert {n for n, o in decl.items() if not o.widget} == NOT_ON_THE_LOADER
    engine_config_type = sys.modules[PACK + ".engine.config"].EngineConfig
    base = loader.engine_config("model.safetensors", {})
    assert base == engine_config_type(offload="auto", num_gpus=1)  # the widgets' defaults
    for name, opt in decl.items():
        if opt.widget:
            value = other_widget_value(widgets[opt.widget])
            # a degree of 2 needs num_gpus 2 (the widget's default 1 counts: the degrees must multiply to it)
            extra = {"num_gpus": 2} if name in DEGREES else {}
            got = loader.engine_config("model.safetensors", {opt.widget: value, **extra})
            assert changed_fields(got, base) == {name, *extra}, (name, value)
    with pytest.raises(ValueError, match=re.escape("SGLDiffusion Model Loader field 'quant'='nf4' is not supported; "
                                                   f"choose one of {', '.join(quant_choices())}, none")):
        loader.engine_config("model.safetensors", {"quant": "nf4"})
    with pytest.raises(ValueError, match="SGLDiffusion Model Loader: unknown input 'qaunt'"):
        loader.engine_config("model.safetensors", {"qaunt": "fp8"})


def test_the_cache_node_knows_exactly_the_declared_cache_options():
    module = pack_modules.node_module("cache_dit")
    node, Cache = module.SGLDiffusionCacheDiT, module.CacheConfig  # the pack's own copy of the engine
    inputs = node.INPUT_TYPES()
    widgets = {**inputs["required"], **inputs["optional"]}
    decl = declared(Cache)
    assert set(widgets) - {"advanced"} == {o.widget for o in decl.values()}
    assert list(inputs["required"]) == ["enabled", "preset", "advanced"]  # saved workflows list the values in order
    assert node_inputs(Cache)["optional"].keys() == inputs["optional"].keys()
    (base,) = node().build(True, "balanced", True)
    assert base == Cache(preset="balanced")
    (off,) = node().build(False, "balanced", True)
    assert not off.enabled
    for name, opt in decl.items():
        if name not in ("enabled", "preset"):
            (got,) = node().build(True, "balanced", True, **{opt.widget: other_widget_value(widgets[opt.widget])})
            assert changed_fields(got, base) == {name}, name
    (fast,) = node().build(True, "fast", True)
    assert changed_fields(fast, base) == {"preset"}


# -- the declaration helper ---------------------------------------------------------------------------------

def test_refusals_name_the_spelling_the_caller_used():
    with pytest.raises(CacheConfigError, match=r"^cache option 'fn' = 0 is not supported; choose an integer >= 1$"):
        CacheConfig(fn=0)
    with pytest.raises(CacheConfigError, match=r"^--cache-fn='0' is not supported; choose an integer >= 1$"):
        parser = argparse.ArgumentParser()
        add_cache_arguments(parser)
        cache_config(parser.parse_args(["--cache-fn", "0"]))
    with pytest.raises(CacheConfigError, match=r"^SGLANG_CACHE_DIT_FN='0' is not supported; choose an integer >= 1$"):
        from_env({"SGLANG_CACHE_DIT_ENABLED": "1", "SGLANG_CACHE_DIT_FN": "0"})
    with pytest.raises(CacheConfigError, match=r"^SGLDiffusion Cache-DiT field 'Fn'='0' is not supported; choose an "
                                               r"integer >= 1$"):
        from_widgets(CacheConfig, {"Fn": 0}, "SGLDiffusion Cache-DiT")
    with pytest.raises(ValueError, match=r"^--offload='gpu' is not supported; choose one of none, layerwise, auto$"):
        engine_config(subparser("bench").parse_args(["--offload", "gpu"]))


def test_values_are_normalized_once_for_every_spelling():
    assert EngineConfig(compile="on").compile is True and EngineConfig(compile="OFF").compile is False
    assert EngineConfig(quant="none").quant is None and EngineConfig(quant="INT4").quant == "int4"
    assert EngineConfig(dtype="default").dtype is None and EngineConfig(dtype="float16").dtype == "fp16"
    bench = subparser("bench")
    assert engine_config(bench.parse_args(["--compile"])).compile == "static"
    assert engine_config(bench.parse_args(["--dtype", "BF16", "--quant", "none"])) == EngineConfig(dtype="bf16")
    # a number is not a string, False is not 0, and NaN is no number
    for bad in (dict(resident_layers="2"), dict(cfg_parallel=0), dict(offload=0)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    with pytest.raises(CacheConfigError, match="rdt"):
        CacheConfig(rdt=float("nan"))
    assert CacheConfig(rdt=float("inf")).rdt == float("inf")  # >= 1: always cache
    assert CacheConfig(preset="Fast", steps_mask="", taylorseer="from preset") == CacheConfig(preset="fast")


def test_a_declared_dataclass_gets_its_flags_widgets_and_variables():
    from dataclasses import dataclass

    from engine import options

    @dataclass
    class Knobs:
        size: int = option(4, int, "how many", low=1, high=8, flag="--size", env="KNOBS_SIZE", widget="Size")
        mode: str = option("a", str, "which", choices=("a", "b"), any_case=True, flag="--mode", widget="mode")

    parser = argparse.ArgumentParser()
    options.add_arguments(parser, Knobs)
    assert options.from_args(Knobs, parser.parse_args(["--size", "8", "--mode", "B"])) == {"size": 8, "mode": "b"}
    assert options.from_env(Knobs, {"KNOBS_SIZE": " 3 "}) == {"size": 3}
    with pytest.raises(ValueError, match=r"^KNOBS_SIZE='9' is not supported; choose an integer from 1 to 8$"):
        options.from_env(Knobs, {"KNOBS_SIZE": "9"})
    assert options.node_inputs(Knobs) == {"required": {}, "optional": {
        "Size": ("INT", {"default": 4, "min": 1, "max": 8}), "mode": (["a", "b"], {"default": "a"})}}
    assert options.checked(Knobs(mode="B")) == {"size": 4, "mode": "b"}
    with pytest.raises(ValueError, match=r"^Knobs.size 0 is not supported; choose an integer from 1 to 8$"):
        options.checked(Knobs(size=0))
