"""Demo model data: generator, codec, tokenizer and judge (no weights needed)."""
import numpy as np
import pytest
import torch

from engine.models.demo import codec
from engine.models.demo.text_encoder import WordTokenizer
from tools.demo import data, judge


def test_generator_is_deterministic_by_seed():
    a_img, a_cap = data.sample(123)
    b_img, b_cap = data.sample(123)
    assert a_cap == b_cap and np.array_equal(a_img, b_img)
    c_img, c_cap = data.sample(124)
    assert c_cap != a_cap or not np.array_equal(c_img, a_img)
    imgs1, caps1 = data.batch(range(20))
    imgs2, caps2 = data.batch(range(20))
    assert caps1 == caps2 and np.array_equal(imgs1, imgs2)
    assert imgs1.shape == (20, 64, 64, 3) and imgs1.dtype == np.uint8


def test_captions_follow_the_grammar():
    seen_counts = set()
    for s in range(300):
        img, cap = data.sample(s)
        scene = data.parse_caption(cap)
        assert scene.caption == cap
        seen_counts.add(len(scene.objects))
        positions = [o.position for o in scene.objects]
        colours = [o.colour for o in scene.objects]
        assert len(set(positions)) == len(positions), cap
        assert len(set(colours)) == len(colours) and scene.background not in colours, cap
    assert seen_counts == {1, 2}
    assert len(data.COLOURS) >= 6 and set(data.SHAPES) >= {"circle", "square", "triangle"}
    scene = data.parse_caption("a large red circle on the left and a small blue square on the right, on a yellow background")
    assert [o.position for o in scene.objects] == ["left", "right"] and scene.background == "yellow"
    with pytest.raises(ValueError):
        data.parse_caption("a red car on the left, on a blue background")


def test_objects_never_overlap():
    # every object keeps its full colour area: nothing drawn later covers it
    for s in range(200):
        img, cap = data.sample(s)
        scene = data.parse_caption(cap)
        for o in scene.objects:
            area = (img == np.array(data.COLOURS[o.colour], np.uint8)).all(-1).sum()
            expected = data.shape_mask(o.shape, data.SIZES[o.size], *data.POSITIONS[o.position]).sum()
            assert area == expected, cap


def test_codec_is_lossless():
    imgs, _ = data.batch(range(8))
    rnd = np.random.default_rng(0).integers(0, 256, size=(3, 64, 64, 3), dtype=np.uint8)
    for x in (imgs, rnd):
        z = codec.encode(x)
        assert z.shape == (len(x), 48, 16, 16) and z.dtype == torch.float32
        assert float(z.abs().max()) <= 1.0
        assert np.array_equal(codec.decode(z), x)
    # a token holds one 4x4 block: channel (dy*4+dx)*3+c at (y//4, x//4)
    z = codec.encode(rnd[:1])
    y, x, c = 9, 22, 2
    assert float(z[0, ((y % 4) * 4 + x % 4) * 3 + c, y // 4, x // 4]) == pytest.approx((rnd[0, y, x, c] - 127.5) / 127.5)


def test_tokenizer():
    tok = WordTokenizer.from_words(data.vocabulary())
    assert tok("") == [1]
    ids = tok("a large red circle on the left, on a blue background")
    assert ids[0] == 1 and 2 not in ids
    assert tok("a purple-ish banana")[1:] and 2 in tok("a banana")  # unknown words map to <unk>


def test_judge_passes_generator_images():
    imgs, caps = data.batch(range(5000, 5200))
    ok = [judge.passes(i, c) for i, c in zip(imgs, caps)]
    assert np.mean(ok) >= 0.99
    # float images in 0..1 are accepted as well
    assert judge.passes(imgs[0].astype(np.float32) / 255.0, caps[0])


def _swap_colours(scene):
    objs = list(scene.objects)
    if len(objs) == 2:
        a, b = objs
        objs = [data.Obj(a.size, b.colour, a.shape, a.position), data.Obj(b.size, a.colour, b.shape, b.position)]
    else:
        o = objs[0]
        objs = [data.Obj(o.size, scene.background, o.shape, o.position)]
        return data.Scene(tuple(objs), o.colour)
    return data.Scene(tuple(objs), scene.background)


def _change(scene, attr):
    o = scene.objects[0]
    if attr == "position":
        used = {x.position for x in scene.objects}
        new = next(p for p in data.POSITIONS if p not in used)
    elif attr == "size":
        new = "small" if o.size == "large" else "large"
    elif attr == "shape":
        new = data.SHAPES[(data.SHAPES.index(o.shape) + 1) % len(data.SHAPES)]
    elif attr == "colour":
        used = {x.colour for x in scene.objects} | {scene.background}
        new = next(c for c in data.COLOURS if c not in used)
    else:  # background
        used = {x.colour for x in scene.objects} | {scene.background}
        return data.Scene(scene.objects, next(c for c in data.COLOURS if c not in used))
    kw = {"size": o.size, "colour": o.colour, "shape": o.shape, "position": o.position, attr: new}
    return data.Scene((data.Obj(**kw),) + scene.objects[1:], scene.background)


@pytest.mark.parametrize("attr", ["swap", "position", "size", "shape", "colour", "background"])
def test_judge_fails_wrong_captions(attr):
    fails = 0
    n = 30
    for s in range(n):
        img, cap = data.sample(9000 + s)
        scene = data.parse_caption(cap)
        wrong = _swap_colours(scene) if attr == "swap" else _change(scene, attr)
        assert wrong.caption != cap
        res = judge.judge(img, wrong.caption)
        fails += not res["pass"]
    assert fails == n


def test_judge_fails_on_a_blank_or_noisy_image_and_an_extra_object():
    img, cap = data.sample(1, num_objects=1)
    scene = data.parse_caption(cap)
    blank = np.empty_like(img)
    blank[:] = data.COLOURS[scene.background]
    assert not judge.passes(blank, cap)
    noise = np.random.default_rng(0).integers(0, 256, size=img.shape, dtype=np.uint8)
    assert not judge.passes(noise, cap)
    # the same caption but the picture has a second object the caption does not mention
    extra = img.copy()
    other = next(c for c in data.COLOURS if c not in {scene.background, scene.objects[0].colour})
    free = next(p for p in data.POSITIONS if p != scene.objects[0].position)
    extra[data.shape_mask("square", data.SIZES["large"], *data.POSITIONS[free])] = data.COLOURS[other]
    res = judge.judge(extra, cap)
    assert not res["pass"] and not res["checks"]["clean"]
