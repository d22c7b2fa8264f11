"""SGLANG_CACHE_DIT_* parsing, CacheConfig validation and precedence."""
import pytest

from engine.features.cache import CacheConfig, CacheConfigError, config_from_dict, from_env, resolve_config


def env(**kw):
    return {"SGLANG_CACHE_DIT_" + k: v for k, v in kw.items()}


def test_off_unless_enabled():
    assert not from_env({}).enabled
    assert not from_env(env(ENABLED="false", SCM_PRESET="fast")).enabled
    assert not from_env(env(ENABLED="0")).enabled


def test_two_variables_switch_a_preset_on():
    c = from_env(env(ENABLED="true", SCM_PRESET="balanced"))
    assert c.enabled and c.preset_name == "balanced"
    r = c.resolve(50, 36)
    assert r.mask is not None and sum(r.mask) == 22 and r.scm_policy == "static" and r.taylorseer


def test_all_knobs():
    c = from_env(env(ENABLED="1", SCM_PRESET="Fast", FN="2", BN="1", WARMUP="6", RDT="0.3", MC="4", TAYLORSEER="yes",
                     TS_ORDER="2", SCM_POLICY="dynamic"))
    r = c.resolve(28, 8)
    assert (r.fn, r.bn, r.warmup, r.rdt, r.mc, r.taylorseer, r.ts_order, r.scm_policy) == (2, 1, 6, 0.3, 4, True, 2, "dynamic")
    assert r.preset == "fast"


def test_defaults_without_preset_are_sglangs():
    r = from_env(env(ENABLED="true")).resolve(50, 36)
    assert (r.fn, r.bn, r.warmup, r.rdt, r.mc, r.taylorseer, r.mask) == (1, 0, 4, 0.24, 3, False, None)


@pytest.mark.parametrize("var,value,allowed", [
    ("ENABLED", "ture", "true, false"),
    ("SCM_PRESET", "turbo", "quality, balanced, fast"),
    ("FN", "abc", "integer >= 1"),
    ("FN", "0", "integer >= 1"),
    ("BN", "-1", "integer >= 0"),
    ("WARMUP", "x", "integer >= 0"),
    ("RDT", "high", "number >= 0"),
    ("RDT", "-0.1", "number >= 0"),
    ("MC", "-5", "-1 = unlimited"),
    ("TAYLORSEER", "maybe", "true, false"),
    ("TS_ORDER", "3", "1, 2"),
    ("SCM_POLICY", "sometimes", "static, dynamic"),
    ("SCM_MASK", "10x1", "0 and 1"),
])
def test_errors_name_the_variable_and_the_allowed_values(var, value, allowed):
    e = env(ENABLED="true")
    e["SGLANG_CACHE_DIT_" + var] = value
    with pytest.raises(CacheConfigError) as err:
        from_env(e)
    msg = str(err.value)
    assert "SGLANG_CACHE_DIT_" + var in msg and repr(value) in msg and allowed in msg


@pytest.mark.parametrize("field,value,allowed", [
    ("preset", "turbo", "quality"), ("fn", 0, ">= 1"), ("rdt", -1.0, ">= 0"), ("ts_order", 3, "1, 2"),
    ("scm_policy", "x", "static, dynamic"), ("mc", -2, ">= -1"),
])
def test_field_errors_name_the_field(field, value, allowed):
    with pytest.raises(CacheConfigError) as err:
        CacheConfig(**{field: value})  # refused when built, as EngineConfig is
    assert repr(field) in str(err.value) and allowed in str(err.value)


def test_fn_bn_must_leave_middle_blocks():
    with pytest.raises(CacheConfigError) as err:
        CacheConfig(fn=2, bn=0).resolve(10, 2)
    assert "'fn'" in str(err.value) and "fn + bn < 2" in str(err.value)


def test_explicit_config_wins_over_env():
    on = env(ENABLED="true", SCM_PRESET="fast")
    assert not resolve_config(CacheConfig(enabled=False), on).enabled
    assert resolve_config(CacheConfig(preset="quality"), on).preset_name == "quality"
    assert resolve_config(None, on).preset_name == "fast"
    with pytest.raises(CacheConfigError):
        resolve_config("fast", on)


def test_explicit_knob_wins_over_preset():
    c = CacheConfig(preset="balanced", taylorseer=False, scm_policy="dynamic", rdt=0.5)
    r = c.resolve(50, 36)
    assert not r.taylorseer and r.scm_policy == "dynamic" and r.rdt == 0.5


def test_from_dict_and_hashable():
    c = config_from_dict({"preset": "fast", "mc": 2})
    assert c.mc == 2 and hash(c) == hash(CacheConfig(preset="fast", mc=2))
    with pytest.raises(CacheConfigError) as err:
        config_from_dict({"presets": "fast"})
    assert "presets" in str(err.value) and "preset" in str(err.value)
    assert "preset=fast" in c.describe() and CacheConfig(enabled=False).describe() == "off"


def test_a_config_is_checked_once_when_built(monkeypatch):
    """Refused at construction (the field and what is allowed), as EngineConfig; a run does not check it again."""
    with pytest.raises(CacheConfigError, match=r"^cache option 'ts_order' = 3 is not supported; choose one of .*1, 2$"):
        CacheConfig(ts_order=3)
    c = CacheConfig(preset="Fast", steps_mask="")  # normalized when built: equal settings compare equal
    assert c == CacheConfig(preset="fast") and c.preset == "fast" and c.steps_mask is None
    import engine.features.cache.config as config_module

    calls = []
    real = config_module.checked
    monkeypatch.setattr(config_module, "checked", lambda obj: calls.append(obj) or real(obj))
    c = CacheConfig(preset="balanced")
    c.resolve(50, 36), resolve_config(c), config_from_dict({"preset": "fast"})
    assert len(calls) == 2  # the two constructions; resolve / resolve_config do not check again


def test_the_pipeline_reads_the_env_once_when_built(monkeypatch):
    """The pipeline is where a run starts from the outside: it reads SGLANG_CACHE_DIT_* when it is built; the
    engine's run does not read it again (here: the variables are gone by then, the cache still runs)."""
    from engine import ErnieImagePipeline

    monkeypatch.setenv("SGLANG_CACHE_DIT_ENABLED", "true")
    monkeypatch.setenv("SGLANG_CACHE_DIT_SCM_PRESET", "fast")
    pipe = ErnieImagePipeline.from_pretrained("demo")
    monkeypatch.delenv("SGLANG_CACHE_DIT_ENABLED")
    monkeypatch.delenv("SGLANG_CACHE_DIT_SCM_PRESET")
    pipe("a large red circle on the left, on a blue background", num_inference_steps=6, seed=0)
    assert pipe.engine.last_run.cache["preset"] == "fast"
