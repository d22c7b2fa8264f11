"""Procedural scenes for the demo model: 64x64 RGB images of one or two flat-coloured shapes on a
flat background, with captions from a fixed grammar. Everything is deterministic by seed.

Caption grammar::

    caption := object [" and " object] ", on a " COLOUR " background"
    object  := "a " SIZE " " COLOUR " " SHAPE " " WHERE
    WHERE   := "on the left" | "on the right" | "at the top" | "at the bottom" | "in the center"

e.g. "a large red circle on the left and a small blue square on the right, on a yellow background".
Two objects never share a position or a colour, and no object has the background's colour.
Positions are fixed anchors with a jitter of at most one pixel; large objects in neighbouring
anchors keep at least one pixel apart, so objects never overlap.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

IMAGE_SIZE = 64
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 220, 50),
    "white": (245, 245, 245),
    "black": (25, 25, 25),
}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 5, "large": 8}  # half-size in pixels: bounding boxes 11x11 and 17x17
POSITIONS = {  # anchor (x, y) of the object's centre
    "left": (13, 32),
    "right": (51, 32),
    "top": (32, 13),
    "bottom": (32, 51),
    "center": (32, 32),
}
WHERE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom",
         "center": "in the center"}
JITTER = 1


@dataclass(frozen=True)
class Obj:
    size: str
    colour: str
    shape: str
    position: str

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} {WHERE[self.position]}"


@dataclass(frozen=True)
class Scene:
    objects: Tuple[Obj, ...]
    background: str

    @property
    def caption(self) -> str:
        return " and ".join(o.phrase() for o in self.objects) + f", on a {self.background} background"


def vocabulary() -> List[str]:
    """Every word the grammar can produce, in a fixed order."""
    words = ["a", "and", "on", "the", "at", "in", "background"]
    words += list(SIZES) + list(COLOURS) + list(SHAPES) + list(POSITIONS)
    return words


_OBJ_RE = re.compile(r"a (\w+) (\w+) (\w+) (on the left|on the right|at the top|at the bottom|in the center)")
_WHERE_INV = {v: k for k, v in WHERE.items()}


def parse_caption(caption: str) -> Scene:
    """The scene a caption describes; ValueError if it is not in the grammar."""
    text = " ".join(caption.strip().lower().replace(",", " , ").split()).replace(" ,", ",")
    m = re.fullmatch(r"(.+), on a (\w+) background", text)
    if not m:
        raise ValueError(f"caption is not in the demo grammar (no ', on a <colour> background'): {caption!r}")
    body, bg = m.group(1), m.group(2)
    objs = []
    for part in body.split(" and "):
        om = _OBJ_RE.fullmatch(part.strip())
        if not om:
            raise ValueError(f"caption is not in the demo grammar: cannot read object {part!r}")
        size, colour, shape, where = om.groups()
        if size not in SIZES or colour not in COLOURS or shape not in SHAPES:
            raise ValueError(f"caption is not in the demo grammar: unknown word in {part!r}")
        objs.append(Obj(size, colour, shape, _WHERE_INV[where]))
    if bg not in COLOURS:
        raise ValueError(f"caption is not in the demo grammar: unknown background colour {bg!r}")
    if not 1 <= len(objs) <= 2:
        raise ValueError("caption is not in the demo grammar: one or two objects")
    return Scene(tuple(objs), bg)


def random_scene(rng: np.random.Generator, num_objects: Optional[int] = None) -> Scene:
    n = int(num_objects) if num_objects else int(rng.integers(1, 3))
    colours = list(COLOURS)
    picked = rng.permutation(len(colours))[: n + 1]
    bg = colours[picked[0]]
    positions = [list(POSITIONS)[i] for i in rng.permutation(len(POSITIONS))[:n]]
    objs = []
    for i in range(n):
        objs.append(Obj(list(SIZES)[int(rng.integers(2))], colours[picked[i + 1]],
                        SHAPES[int(rng.integers(len(SHAPES)))], positions[i]))
    return Scene(tuple(objs), bg)


def shape_mask(shape: str, half: int, cx: int, cy: int, size: int = IMAGE_SIZE) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size]
    dx, dy = xx - cx, yy - cy
    inside_box = (np.abs(dx) <= half) & (np.abs(dy) <= half)
    if shape == "square":
        return inside_box
    if shape == "circle":
        return dx * dx + dy * dy <= (half + 0.5) ** 2
    if shape == "triangle":  # apex up, base at the bottom of the box
        frac = (dy + half) / (2.0 * half)
        return inside_box & (np.abs(dx) <= half * frac + 0.5)
    raise ValueError(f"unknown shape {shape!r}")


def render(scene: Scene, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """uint8 image [64, 64, 3]; ``rng`` draws the position jitter (none without it)."""
    img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    img[:] = COLOURS[scene.background]
    for o in scene.objects:
        ax, ay = POSITIONS[o.position]
        jx, jy = (rng.integers(-JITTER, JITTER + 1, size=2) if rng is not None else (0, 0))
        img[shape_mask(o.shape, SIZES[o.size], ax + int(jx), ay + int(jy))] = COLOURS[o.colour]
    return img


def sample(seed: int, num_objects: Optional[int] = None) -> Tuple[np.ndarray, str]:
    """(image uint8 [64, 64, 3], caption) for one seed."""
    rng = np.random.default_rng([int(seed), 0xDE40])
    scene = random_scene(rng, num_objects)
    return render(scene, rng), scene.caption


def batch(seeds, num_objects: Optional[int] = None) -> Tuple[np.ndarray, List[str]]:
    items = [sample(s, num_objects) for s in seeds]
    return np.stack([i for i, _ in items]), [c for _, c in items]


# Seeds at or above this value are never used for training; the judge evaluation draws from them.
HELD_OUT_SEED_START = 1_000_000_000
