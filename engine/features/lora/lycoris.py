"""LyCORIS adapters: LoKr (a Kronecker product of two factors) and LoHa (a Hadamard product of two low-rank
products), with ComfyUI's scaling rules (comfy/weight_adapter/lokr.py, loha.py), checked against the layer by
the shapes a file's header gives before any data is read.

LoKr: dW = kron(w1, w2) * scale; w1 = lokr_w1 or lokr_w1_a @ lokr_w1_b; w2 = lokr_w2, lokr_w2_a @ lokr_w2_b, or
the Tucker form einsum(lokr_t2, lokr_w2_a, lokr_w2_b); scale = alpha / rank only when a factor is decomposed
(rank: lokr_w2_b's rows, else lokr_w1_b's), else 1. LoHa: dW = (w1a @ w1b) * (w2a @ w2b) * alpha / rank (rank:
hada_w1_b's rows), Tucker: each product is einsum(hada_t, hada_w_a, hada_w_b). A conv's kernel dims ride with the
input dims (``[out, in * kh * kw]``), as ComfyUI's reshape does.

Merged layers get dW a block of rows at a time (``rows``); quantized linears a side path (``side_terms``): LoKr
as ``kron(w1, w2) x`` computed from the factors (never the full matrix), LoHa as an exact low-rank pair of rank
r1 * r2 (its Khatri-Rao form), or the full dW where that would be larger (docs/lora.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...errors import LoRAError

# key suffix -> part (LyCORIS' parameter names, as ComfyUI reads them)
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
SUFFIXES: Tuple[Tuple[str, str], ...] = tuple(("." + p, p) for p in LOKR_PARTS + LOHA_PARTS)
# OneTrainer's legacy key conversion writes LyCORIS keys of flat (underscored) names without the dot
# ("lora_unet_<module path, dots as underscores>_hada_w1_a"); read only where the whole key has no dot
FLAT_SUFFIXES: Tuple[Tuple[str, str], ...] = tuple(("_" + p, p) for p in LOKR_PARTS + LOHA_PARTS)
PARTS = frozenset(LOKR_PARTS + LOHA_PARTS)
# keys a trainer writes beside the adapters that carry nothing to apply (musubi-tuner's LoKr factor)
IGNORED_KEYS = frozenset({"lokr_factor"})
ALLOWED = ("LoKr: lokr_w1 (or lokr_w1_a + lokr_w1_b) and lokr_w2 (or lokr_w2_a + lokr_w2_b, optional lokr_t2); "
           "LoHa: hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b (optional hada_t1 + hada_t2); optional alpha")


def split_key(key: str) -> Optional[Tuple[str, str]]:
    """(prefix, part) of a LyCORIS key, or None."""
    for suffix, part in SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], part
    if "." not in key:
        for suffix, part in FLAT_SUFFIXES:
            if key.endswith(suffix):
                return key[: -len(suffix)], part
    return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass
class Lycoris:
    """One layer's LoKr or LoHa factors (CPU, the file's dtype) and ComfyUI's scale."""

    kind: str  # "lokr" | "loha"
    t: Dict[str, torch.Tensor]  # part -> tensor
    out_features: int
    in_flat: int  # in_features * kernel numel
    scale: float = 1.0
    rank: int = 0

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.t.values())

    # -- LoKr factors as matrices [a1, b1], [a2, c2] (c2 = b2 * kernel), float32 on ``dev`` ---------------
    def _lokr_factors(self, dev) -> Tuple[torch.Tensor, torch.Tensor]:
        t = {k: v.to(dev, torch.float32) for k, v in self.t.items()}
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        if "lokr_w2" in t:
            w2 = t["lokr_w2"]
        elif "lokr_t2" in t:
            w2 = torch.einsum("ijkl,jr,ip->prkl", t["lokr_t2"], t["lokr_w2_b"].flatten(1), t["lokr_w2_a"])
        else:
            w2 = t["lokr_w2_a"] @ t["lokr_w2_b"].flatten(1)
        return w1.flatten(1), w2.flatten(1)

    def _loha_half(self, i: int, t, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of hada_w{i}_a @ hada_w{i}_b (or its Tucker form), [n, in_flat] float32."""
        a, b = t[f"hada_w{i}_a"], t[f"hada_w{i}_b"]
        if f"hada_t{i}" in t:  # a: [r, out], b: [r', in], t: [r, r', kh, kw]
            return torch.einsum("ijkl,jr,ip->prkl", t[f"hada_t{i}"], b.flatten(1), a[:, lo:hi]).reshape(hi - lo, -1)
        return a[lo:hi] @ b.flatten(1)

    def rows(self, dev) -> Callable[[int, int], torch.Tensor]:
        """A function (lo, hi) -> rows [lo, hi) of the unscaled dW, float32 [hi - lo, in_flat] on ``dev``."""
        if self.kind == "lokr":
            w1, w2 = self._lokr_factors(dev)
            a2 = w2.shape[0]

            def lokr_rows(lo: int, hi: int) -> torch.Tensor:
                r = torch.arange(lo, hi, device=dev)
                return (w1[r // a2][:, :, None] * w2[r % a2][:, None, :]).reshape(hi - lo, -1)

            return lokr_rows
        t = {k: v.to(dev, torch.float32) for k, v in self.t.items()}
        return lambda lo, hi: self._loha_half(1, t, lo, hi) * self._loha_half(2, t, lo, hi)

    def side_terms(self, dev, factor: float) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
        """What a quantized linear adds for ``factor`` * dW (float32 on ``dev``): [("kron", w1, w2)] (the forward
        computes kron(w1, w2) x from the factors) or [("low_rank", down [r, in], up [out, r])]."""
        if self.kind == "lokr":
            w1, w2 = self._lokr_factors(dev)
            return [("kron", w1 * factor, w2)]
        t = {k: v.to(dev, torch.float32) for k, v in self.t.items()}
        full = ("kron", torch.full((1, 1), factor, device=dev))
        if any(t[p].shape[2:].numel() != 1 for p in ("hada_t1", "hada_t2") if p in t):  # a kernel in the core
            return [full + (self.rows(dev)(0, self.out_features),)]
        halves = []  # (up [out, r], down [r, in]) of each product; a Tucker core (1 x 1) joins the up side
        for i in (1, 2):
            a, b, core = t[f"hada_w{i}_a"], t[f"hada_w{i}_b"], t.get(f"hada_t{i}")
            halves.append((a.t() @ core.flatten(1) if core is not None else a, b))
        (u1, d1), (u2, d2) = halves
        r = u1.shape[1] * u2.shape[1]
        if r * (self.out_features + self.in_flat) >= self.out_features * self.in_flat:  # the full dW is smaller
            return [full + ((u1 @ d1) * (u2 @ d2),)]
        up = (u1[:, :, None] * u2[:, None, :]).reshape(self.out_features, r) * factor
        down = (d1[:, None, :] * d2[None, :, :]).reshape(r, self.in_flat)
        return [("low_rank", down, up)]


def kron_linear(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """kron(w1, w2) applied to x [..., b1 * b2] without forming it: [..., a1 * a2]."""
    b1, b2 = w1.shape[1], w2.shape[1]
    xs = x.reshape(-1, b1, b2)
    y = torch.matmul(w1, torch.matmul(xs, w2.t()))  # [N, a1, a2]
    return y.reshape(*x.shape[:-1], w1.shape[0] * w2.shape[0])


# -- reading -------------------------------------------------------------------------------------------------
def check(path: str, g: Dict[str, str], mod_name: str, wshape: tuple, shape_of, user) -> Tuple[str, int]:
    """One layer's LyCORIS keys (``g``: part -> key) against its weight ``wshape``, by the header's shapes:
    (kind, rank), else a LoRAError naming the file, the key and what is allowed. Factors are 2-d matrices
    (ComfyUI multiplies them with torch.mm), a full lokr_w2 may carry a conv kernel, Tucker cores are 4-d."""
    parts = {p for p in g if p in PARTS}
    out_f, in_flat = int(wshape[0]), _numel(wshape[1:])
    kinds = {"lokr" if p.startswith("lokr") else "loha" for p in parts}
    if len(kinds) > 1 or set(g) & {"up", "down", "diff"}:
        raise LoRAError(f"{path}: layer '{mod_name}' has keys of several adapter kinds ({', '.join(sorted(user(k) for p, k in g.items() if p != 'fmt'))}); "
                        f"one layer takes one adapter ({ALLOWED})")
    kind = kinds.pop()
    s = {p: tuple(int(d) for d in shape_of(g[p])) for p in parts}

    def bad(msg: str):
        raise LoRAError(f"{path}: layer '{mod_name}' (weight {tuple(wshape)}): {msg} ({ALLOWED})")

    def need(*names):
        missing = [n for n in names if n not in s]
        if missing:
            have = user(g[sorted(parts)[0]])
            bad(f"'{have}' has no matching '{missing[0]}': the LoRA file is incomplete")

    def mat(p, dims=(2,)):
        if len(s[p]) not in dims or any(d <= 0 for d in s[p]):
            bad(f"'{user(g[p])}' has shape {s[p]}, not a {' or '.join(map(str, dims))}-d factor")
        return s[p]

    if kind == "lokr":
        if "lokr_w1" in s and ("lokr_w1_a" in s or "lokr_w1_b" in s) or "lokr_w2" in s and ("lokr_w2_a" in s or "lokr_w2_b" in s):
            bad("both a full and a decomposed form of one LoKr factor")
        rank = 0
        if "lokr_w1" in s:
            a1, b1 = mat("lokr_w1")
        else:
            need("lokr_w1_a", "lokr_w1_b")
            (a1, r), (r2, b1) = mat("lokr_w1_a"), mat("lokr_w1_b")
            if r != r2:
                bad(f"'{user(g['lokr_w1_a'])}' {s['lokr_w1_a']} and '{user(g['lokr_w1_b'])}' {s['lokr_w1_b']} are not a low-rank pair")
            rank = r2
        if "lokr_w2" in s:
            a2, c2 = mat("lokr_w2", (2, 4))[0], _numel(s["lokr_w2"][1:])
            if "lokr_t2" in s:
                bad(f"'{user(g['lokr_t2'])}' (Tucker) belongs with lokr_w2_a / lokr_w2_b, not a full lokr_w2")
        else:
            need("lokr_w2_a", "lokr_w2_b")
            wa, wb = mat("lokr_w2_a"), mat("lokr_w2_b")
            if "lokr_t2" in s:  # t2 [r, r', kh, kw], w2_a [r, a2], w2_b [r', b2]
                t2 = mat("lokr_t2", (4,))
                if t2[0] != wa[0] or t2[1] != wb[0]:
                    bad(f"Tucker factors '{user(g['lokr_t2'])}' {t2}, '{user(g['lokr_w2_a'])}' {wa}, "
                        f"'{user(g['lokr_w2_b'])}' {wb} do not fit together (t2 [r, r', kh, kw], w2_a [r, out], w2_b [r', in])")
                a2, c2 = wa[1], wb[1] * _numel(t2[2:])
            else:
                if wa[1] != wb[0]:
                    bad(f"'{user(g['lokr_w2_a'])}' {wa} and '{user(g['lokr_w2_b'])}' {wb} are not a low-rank pair")
                a2, c2 = wa[0], wb[1]
            rank = wb[0]
        if a1 * a2 != out_f or b1 * c2 != in_flat:
            k1 = next(g[p] for p in ("lokr_w1", "lokr_w1_a") if p in g)
            k2 = next(g[p] for p in ("lokr_w2", "lokr_t2", "lokr_w2_a") if p in g)
            bad(f"'{user(k1)}' and '{user(k2)}' make a kron of [{a1} x {a2}, {b1} x {c2}] = [{a1 * a2}, {b1 * c2}], but "
                f"the layer needs [{out_f}, {in_flat}]: this LoRA is for a model of another size or architecture")
        return kind, rank
    need("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
    if ("hada_t1" in s) != ("hada_t2" in s):
        bad("hada_t1 and hada_t2 (Tucker) come together")
    for i in (1, 2):
        wa, wb = mat(f"hada_w{i}_a"), mat(f"hada_w{i}_b")
        if f"hada_t{i}" in s:  # t [r, r', kh, kw], a [r, out], b [r', in]
            t = mat(f"hada_t{i}", (4,))
            if t[0] != wa[0] or t[1] != wb[0]:
                bad(f"Tucker factors '{user(g[f'hada_t{i}'])}' {t}, '{user(g[f'hada_w{i}_a'])}' {wa}, "
                    f"'{user(g[f'hada_w{i}_b'])}' {wb} do not fit together (t [r, r', kh, kw], w_a [r, out], w_b [r', in])")
            got = (wa[1], wb[1] * _numel(t[2:]))
        else:
            if wa[1] != wb[0]:
                bad(f"'{user(g[f'hada_w{i}_a'])}' {wa} and '{user(g[f'hada_w{i}_b'])}' {wb} are not a low-rank pair")
            got = (wa[0], wb[1])
        if got != (out_f, in_flat):
            bad(f"'{user(g[f'hada_w{i}_a'])}' / '{user(g[f'hada_w{i}_b'])}' make a {list(got)} update, but the layer needs "
                f"[{out_f}, {in_flat}]: this LoRA is for a model of another size or architecture")
    return kind, s["hada_w1_b"][0]


def build(kind: str, rank: int, tensors: Dict[str, torch.Tensor], alpha: Optional[float], wshape: tuple) -> Lycoris:
    """The checked factors of one layer as a ``Lycoris`` with ComfyUI's scale."""
    if kind == "lokr":
        decomposed = "lokr_w1" not in tensors or "lokr_w2" not in tensors
        scale = alpha / rank if alpha is not None and decomposed else 1.0
    else:
        scale = alpha / rank if alpha is not None else 1.0
    return Lycoris(kind, tensors, int(wshape[0]), _numel(wshape[1:]), float(scale), int(rank))
