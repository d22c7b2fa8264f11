"""Step computation masks and presets (engine.features.cache.masks)."""
import pytest

from engine.features.cache import (
    ALL_PRESETS,
    PRESETS,
    USER_PRESETS,
    longest_cached_run,
    mask_note,
    mask_str,
    parse_mask,
    preset_mask,
)
from engine.features.cache.masks import FEW_STEPS, fit_mask


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_every_step_count_is_sensible(preset):
    for n in range(1, 101):
        m = preset_mask(preset, n)
        assert len(m) == n
        assert set(m) <= {0, 1}
        assert m[0] == 1 and m[-1] == 1, (preset, n, mask_str(m))
        assert m[:2] == [1, 1] or n < FEW_STEPS  # from 16 steps on a warm-up run; fewer: evenly spaced
        spec = PRESETS["quality" if preset == "medium" else preset]
        assert longest_cached_run(m) <= spec.max_run, (preset, n, mask_str(m))


@pytest.mark.parametrize("steps", [16, 20])
def test_no_long_cached_runs_at_16_and_20(steps):
    for preset in ALL_PRESETS:
        m = preset_mask(preset, steps)
        assert longest_cached_run(m) <= 2, (preset, steps, mask_str(m))
        assert 0 < sum(m) < steps  # caches something, computes more than the ends


def test_50_step_budgets_meet_the_speed_targets():
    # upper bound of the block-compute speedup with F1B0 on 36 layers; wall clock is checked in the bench
    targets = {"quality": 1.67, "balanced": 2.0, "fast": 2.69}
    for preset, target in targets.items():
        m = preset_mask(preset, 50)
        c, s = sum(m), 50 - sum(m)
        assert 50 / (c + s / 36) >= target * 1.03, (preset, c)
    assert sum(preset_mask("quality", 50)) > sum(preset_mask("balanced", 50)) > sum(preset_mask("fast", 50))


def test_monotone_between_presets():
    order = ["slow", "quality", "balanced", "fast", "ultra"]
    for n in (4, 6, 8, 9, 12, 20, 28, 50):
        counts = [sum(preset_mask(p, n)) for p in order]
        assert counts == sorted(counts, reverse=True), (n, counts)


def test_eight_steps_compute_five_four_three():
    """Turbo's 8 steps: 5 / 4 / 3 calls computed, evenly spaced from the first to the last, so that 1.5x / 1.8x /
    2.2x hold when a cached call costs up to 9% of a computed one (F1B0 on 36 blocks, the CPU's overhead)."""
    targets = {"quality": 1.5, "balanced": 1.8, "fast": 2.2}
    for preset, target in targets.items():
        m = preset_mask(preset, 8)
        assert mask_note(preset, 8) is None
        c = sum(m)
        assert 8 / (c + (8 - c) * 0.09) >= target, (preset, mask_str(m))
        gaps = [j - i for i, j in zip([i for i, v in enumerate(m) if v], [i for i, v in enumerate(m) if v][1:])]
        assert max(gaps) - min(gaps) <= 1, (preset, mask_str(m))  # evenly spaced
    assert [sum(preset_mask(p, 8)) for p in ("quality", "balanced", "fast")] == [5, 4, 3]
    assert mask_note("balanced", 50) is None


def test_below_four_steps_everything_is_computed():
    for preset in ALL_PRESETS:
        assert preset_mask(preset, 3) == [1, 1, 1]
        assert "computes every step" in mask_note(preset, 3)
        assert 0 < sum(preset_mask(preset, 4)) < 4


def test_aliases_and_errors():
    assert preset_mask("medium", 50) == preset_mask("quality", 50)
    assert preset_mask("FAST", 28) == preset_mask("fast", 28)
    with pytest.raises(ValueError) as e:
        preset_mask("turbo", 20)
    for name in USER_PRESETS:
        assert name in str(e.value)


def test_parse_and_fit():
    assert parse_mask("1101") == [1, 1, 0, 1]
    assert parse_mask("1,1,0,1") == [1, 1, 0, 1]
    assert parse_mask([1, 0, 1]) == [1, 0, 1]
    with pytest.raises(ValueError):
        parse_mask("11a1")
    with pytest.raises(ValueError):
        parse_mask([1, 2])
    assert fit_mask([0, 0, 0], 5) == [1, 0, 0, 1, 1]
    assert fit_mask([1, 0, 0, 0, 0, 0], 4) == [1, 0, 0, 1]
