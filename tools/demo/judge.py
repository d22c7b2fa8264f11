"""Judge for demo-model images: does a 64x64 image show what its caption says?

Every pixel is classified to the nearest palette colour (or "none" if it is far from all of them).
- background: the most common class on the 2-pixel border;
- each object: the largest connected blob of the object's colour must exist (>= MIN_PIXELS);
  position = the anchor nearest to the blob's centroid; size = the bounding box's longer side
  (large >= 14 px); shape = fill ratio of the bounding box (square > 0.9, circle 0.66..0.9,
  triangle < 0.66; the generator's shapes are 1.0, ~0.79 and ~0.55);
- clean: no other palette colour covers a blob of >= EXTRA_PIXELS after a 3x3 erosion (so
  blurred edges between two colours do not count, a hallucinated third object does).
An image passes when every check passes.
"""
from __future__ import annotations

from typing import Dict, List, Union

import numpy as np
from scipy import ndimage

from .data import COLOURS, POSITIONS, Scene, parse_caption

NAMES = list(COLOURS)
PALETTE = np.array([COLOURS[n] for n in NAMES], dtype=np.float32)
MAX_DIST = 70.0  # farther than this from every palette colour: "none"
MIN_PIXELS = 20
EXTRA_PIXELS = 12
LARGE_MIN_SIDE = 14
ATTRIBUTES = ("background", "colour", "position", "size", "shape", "clean")


def to_uint8(image) -> np.ndarray:
    a = image.detach().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
    if a.ndim == 4 and a.shape[0] == 1:
        a = a[0]
    if a.ndim == 3 and a.shape[0] == 3 and a.shape[-1] != 3:
        a = a.transpose(1, 2, 0)
    if a.dtype != np.uint8:
        a = np.clip(np.round(a.astype(np.float32) * 255.0), 0, 255).astype(np.uint8)
    return a


def classify(image: np.ndarray) -> np.ndarray:
    """[H, W] palette index per pixel, -1 where no palette colour is near."""
    px = image.astype(np.float32)
    d = np.linalg.norm(px[:, :, None, :] - PALETTE[None, None], axis=-1)
    cls = d.argmin(-1)
    cls[d.min(-1) > MAX_DIST] = -1
    return cls


def nearest_position(x: float, y: float) -> str:
    return min(POSITIONS, key=lambda p: (POSITIONS[p][0] - x) ** 2 + (POSITIONS[p][1] - y) ** 2)


def shape_of(fill: float) -> str:
    return "square" if fill > 0.9 else ("circle" if fill >= 0.66 else "triangle")


def describe_blob(mask: np.ndarray) -> Union[dict, None]:
    """Measurements of the largest connected blob of a mask, or None if it is too small."""
    labels, n = ndimage.label(mask)
    if n == 0:
        return None
    counts = np.bincount(labels.ravel())[1:]
    k = int(counts.argmax()) + 1
    if counts[k - 1] < MIN_PIXELS:
        return None
    ys, xs = np.nonzero(labels == k)
    w, h = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
    fill = len(xs) / float(w * h)
    cx, cy = xs.mean(), ys.mean()
    return {"pixels": int(len(xs)), "centroid": (float(cx), float(cy)), "bbox": (int(w), int(h)), "fill": float(fill),
            "position": nearest_position(cx, cy), "size": "large" if max(w, h) >= LARGE_MIN_SIDE else "small",
            "shape": shape_of(fill)}


def judge(image, caption: Union[str, Scene]) -> Dict:
    """{"pass": bool, "checks": {attribute: bool}, "objects": [...], "background": name}.

    ``checks`` holds each attribute (all objects must pass it); ``objects`` has per-object checks.
    """
    scene = parse_caption(caption) if isinstance(caption, str) else caption
    img = to_uint8(image)
    cls = classify(img)
    border = np.concatenate([cls[:2].ravel(), cls[-2:].ravel(), cls[:, :2].ravel(), cls[:, -2:].ravel()])
    border = border[border >= 0]
    bg_found = NAMES[int(np.bincount(border, minlength=len(NAMES)).argmax())] if border.size else None
    checks = {a: True for a in ATTRIBUTES}
    checks["background"] = bg_found == scene.background
    objects = []
    for o in scene.objects:
        blob = describe_blob(cls == NAMES.index(o.colour))
        res = {"colour": blob is not None, "blob": blob}
        for attr in ("position", "size", "shape"):
            res[attr] = blob is not None and blob[attr] == getattr(o, attr)
        objects.append(res)
        for attr in ("colour", "position", "size", "shape"):
            checks[attr] &= res[attr]
    expected = {NAMES.index(scene.background)} | {NAMES.index(o.colour) for o in scene.objects}
    extra = []
    for i, name in enumerate(NAMES):
        if i in expected:
            continue
        m = ndimage.binary_erosion(cls == i, structure=np.ones((3, 3), bool))
        if m.sum() >= EXTRA_PIXELS:
            extra.append(name)
    checks["clean"] = not extra
    return {"pass": all(checks.values()), "checks": checks, "objects": objects, "background": bg_found, "extra": extra}


def passes(image, caption) -> bool:
    return judge(image, caption)["pass"]


def accuracy(images, captions: List[str]) -> Dict[str, float]:
    """Fraction passing overall and per attribute over a list of images."""
    rs = [judge(im, c) for im, c in zip(images, captions)]
    out = {"pass": float(np.mean([r["pass"] for r in rs]))}
    for a in ATTRIBUTES:
        out[a] = float(np.mean([r["checks"][a] for r in rs]))
    return out
