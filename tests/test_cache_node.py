"""The SGLDiffusion Cache-DiT node (imported without ComfyUI: it needs only the engine)."""
import pytest

try:
    from . import pack_modules
except ImportError:
    import pack_modules


@pytest.fixture(scope="module")
def node_module():
    return pack_modules.node_module("cache_dit")


def test_mappings(node_module):
    assert node_module.NODE_CLASS_MAPPINGS == {"SGLDiffusionCacheDiT": node_module.SGLDiffusionCacheDiT}
    assert node_module.NODE_DISPLAY_NAME_MAPPINGS == {"SGLDiffusionCacheDiT": "SGLDiffusion Cache-DiT"}
    cls = node_module.SGLDiffusionCacheDiT
    assert cls.RETURN_TYPES == ("SGLD_CACHE",)
    inputs = cls.INPUT_TYPES()
    assert inputs["required"]["preset"][0][:3] == ["balanced", "quality", "fast"]
    assert set(inputs["required"]) == {"enabled", "preset", "advanced"}


def test_preset_only(node_module):
    (cfg,) = node_module.SGLDiffusionCacheDiT().build(True, "fast", False, Fn=3, residual_diff_threshold=0.9)
    assert cfg.enabled and cfg.preset_name == "fast" and cfg.fn is None and cfg.rdt is None  # advanced off: ignored
    (off,) = node_module.SGLDiffusionCacheDiT().build(False, "fast", False)
    assert not off.enabled


def test_advanced(node_module):
    node = node_module.SGLDiffusionCacheDiT()
    (cfg,) = node.build(True, "none", True, Fn=2, Bn=1, warmup=6, residual_diff_threshold=0.12, max_continuous_cached=2,
                        max_cached_steps=-1, taylorseer="on", taylorseer_order=2, mask_policy="dynamic", steps_mask="")
    r = cfg.resolve(28, 8)
    assert (r.fn, r.bn, r.warmup, r.rdt, r.mc, r.taylorseer, r.ts_order, r.mask) == (2, 1, 6, 0.12, 2, True, 2, None)
    (cfg,) = node.build(True, "balanced", True, taylorseer="from preset", mask_policy="from preset", steps_mask="")
    assert cfg.resolve(50, 36).taylorseer and cfg.resolve(50, 36).scm_policy == "static"
    with pytest.raises(ValueError) as err:
        node.build(True, "balanced", True, steps_mask="11x1")
    assert "SGLDiffusion Cache-DiT field 'steps_mask'" in str(err.value) and "0 and 1" in str(err.value)
