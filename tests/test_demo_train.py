"""The demo model's training script: reproducible by seed, and its loss weighting is symmetric
around objects (the bias that made the first demo model draw bloated boxes) and, as an option, on
both sides of their outlines."""
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.models.demo import codec
from tools.demo import data, train


def test_object_weights_cover_the_object_and_the_background_around_it():
    img, caption = data.sample(3, num_objects=1)
    scene = data.parse_caption(caption)
    obj = scene.objects[0]
    w = train.object_weights(img[None], 3.0)
    weighted = codec.decode_float((w - 1.0) / 3.0 * 2.0 - 1.0)[0, :, :, 0].numpy() > 0.5  # weight 1 -> 0, 4 -> 1
    fg = (img != img[:1, :1]).any(-1)
    assert weighted[fg].all()  # every object pixel
    ax, ay = data.POSITIONS[obj.position]
    half = data.SIZES[obj.size]
    m = train.OBJECT_MARGIN
    ring = np.zeros_like(fg)
    ring[ay - half - m + 1: ay + half + m, ax - half - m + 1: ax + half + m] = True
    assert weighted[ring & ~fg].any()  # background next to the object as well
    far = np.ones_like(fg)
    far[max(0, ay - half - m - 2): ay + half + m + 3, max(0, ax - half - m - 2): ax + half + m + 3] = False
    assert not weighted[far].any()  # but not the whole image


def _neighbours(mask: np.ndarray, combine) -> np.ndarray:
    """``combine`` (np.logical_or / np.logical_and) of a mask with its four shifted copies."""
    out = mask.copy()
    for axis in (0, 1):
        for step in (1, -1):
            shifted = np.roll(mask, step, axis=axis)
            edge = [slice(None), slice(None)]
            edge[axis] = 0 if step == 1 else -1
            shifted[tuple(edge)] = mask[tuple(edge)]  # no wrap-around
            out = combine(out, shifted)
    return out


def test_edge_weights_cover_both_sides_of_the_outline_and_nothing_else():
    img, _ = data.sample(11, num_objects=1)
    w = train.edge_weights(img[None], 6.0)
    assert set(torch.unique(w).tolist()) == {0.0, 6.0}
    weighted = codec.decode_float(w / 6.0 * 2.0 - 1.0)[0, :, :, 0].numpy() > 0.5
    fg = (img != img[:1, :1]).any(-1)
    outline = fg & ~_neighbours(fg, np.logical_and)  # object pixels touching the background
    halo = _neighbours(fg, np.logical_or) & ~fg  # background pixels touching the object
    assert outline.any() and halo.any()
    assert np.array_equal(weighted, outline | halo)


def test_sigmas_lie_in_the_unit_interval_and_follow_the_generator():
    a = train.sample_sigma(1000, torch.Generator().manual_seed(0), uniform_frac=0.5)
    b = train.sample_sigma(1000, torch.Generator().manual_seed(0), uniform_frac=0.5)
    assert torch.equal(a, b)
    assert 0.0 < float(a.min()) and float(a.max()) < 1.0
    assert float(a.median()) > 0.5  # shift 3 spends most samples at high noise, where the layout is decided


@pytest.fixture
def restore_threads():
    """train.main sets the process's torch thread count; later tests compare bit-exactly against a
    ComfyUI server process, so they need the default back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
def test_training_is_reproducible_by_seed(tmp_path, restore_threads):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.safetensors"
        train.main(["--steps", "3", "--batch", "2", "--threads", "1", "--warmup", "1", "--out", str(out)])
        outs.append(out)
    first, second = (load_file(str(p)) for p in outs)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    with safe_open(str(outs[0]), "pt") as f:
        info = json.loads(f.metadata()["demo_config"])["train"]
    assert info["steps"] == 3 and info["seed"] == 0 and np.isfinite(info["final_loss"])
