"""LyCORIS LoKr / LoHa files for the LoRA tests (test_lycoris*.py beside it): factors laid out as LyCORIS
writes them, and the update computed here the way ComfyUI's comfy/weight_adapter/lokr.py and loha.py compute it
(torch.kron, matmuls, Tucker einsums; scale alpha / rank, for LoKr only when a factor is decomposed), without
engine.features.lora."""
import torch
from lora_files import shape_of
from safetensors.torch import save_file

CONV = "x_embedder.proj"
LINEARS = ["layers.0.self_attention.to_q", "layers.1.self_attention.to_out.0", "layers.0.mlp.gate_proj",
           "layers.1.mlp.linear_fc2", "adaLN_modulation.1"]
KINDS = ["lokr_full", "lokr_decomposed", "lokr_w1_decomposed", "lokr_tucker", "loha", "loha_tucker"]
ALPHA = 3.0


def wshape(m):
    return shape_of(m) + ((1, 1) if m == CONV else ())


def factors(kind, m, g, r=3):
    """LyCORIS tensors (float32) for module m, as LyCORIS lays them out; Tucker forms on the conv only ("..._tucker")
    or on every layer ("..._tucker_all", 1 x 1 cores on linears); "loha_wide": rank 8, so that r1 * r2 (64) makes
    the full update the smaller side path."""
    out, inp = shape_of(m)
    r = 8 if kind == "loha_wide" else r
    kh, kw = wshape(m)[2:] or (1, 1)
    tucker = kind.endswith("tucker") and m == CONV or kind.endswith("tucker_all")

    def rnd(*s):
        return torch.randn(*s, generator=g) * 0.3

    if kind.startswith("lokr"):
        a1, b1 = 4, 4 if inp % 4 == 0 else 1
        a2, b2 = out // a1, inp // b1
        t = {"lokr_w1": rnd(a1, b1)}
        if kind == "lokr_full":
            t["lokr_w2"] = rnd(a2, b2, kh, kw) if m == CONV else rnd(a2, b2)
        elif kind == "lokr_w1_decomposed":  # scaled by alpha / (lokr_w1_b's rows)
            t = {"lokr_w1_a": rnd(a1, 2), "lokr_w1_b": rnd(2, b1), "lokr_w2": rnd(a2, b2, kh, kw) if m == CONV else rnd(a2, b2)}
        elif kind == "lokr_decomposed":
            t = {"lokr_w1_a": rnd(a1, 2), "lokr_w1_b": rnd(2, b1), "lokr_w2_a": rnd(a2, r), "lokr_w2_b": rnd(r, b2 * kh * kw)}
        elif tucker:
            t.update(lokr_t2=rnd(r, r, kh, kw), lokr_w2_a=rnd(r, a2), lokr_w2_b=rnd(r, b2))
        else:
            t.update(lokr_w2_a=rnd(a2, r), lokr_w2_b=rnd(r, b2))
        return t
    if tucker:
        return {f"hada_{p}": v for i in (1, 2) for p, v in ((f"t{i}", rnd(r, r, kh, kw)), (f"w{i}_a", rnd(r, out)),
                                                            (f"w{i}_b", rnd(r, inp)))}
    return {f"hada_w{i}_{ab}": rnd(*s) for i in (1, 2) for ab, s in (("a", (out, r)), ("b", (r, inp * kh * kw)))}


def reference_delta(t, alpha, shape):
    """dW as ComfyUI computes it (float64), in the layer's weight shape."""
    t = {k: v.double() for k, v in t.items()}
    if "hada_w1_a" in t:
        def half(i):
            if f"hada_t{i}" in t:
                return torch.einsum("i j k l, j r, i p -> p r k l", t[f"hada_t{i}"], t[f"hada_w{i}_b"], t[f"hada_w{i}_a"])
            return t[f"hada_w{i}_a"] @ t[f"hada_w{i}_b"]
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        return (half(1) * half(2)).reshape(shape) * scale
    dim = None
    w1 = t.get("lokr_w1")
    if w1 is None:
        dim, w1 = t["lokr_w1_b"].shape[0], t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t.get("lokr_w2")
    if w2 is None:
        dim = t["lokr_w2_b"].shape[0]
        w2 = (torch.einsum("i j k l, j r, i p -> p r k l", t["lokr_t2"], t["lokr_w2_b"], t["lokr_w2_a"])
              if "lokr_t2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"])
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(w1, w2.contiguous()).reshape(shape) * scale  # (an einsum result is not contiguous)


def lycoris_file(path, kind, modules, key=lambda m: "lycoris_" + m.replace(".", "_"), alpha=ALPHA, seed=0, extra=None):
    """A LyCORIS file for ``modules`` (keys ``key(m) + "." + part``); returns {module: (tensors, alpha)}."""
    g = torch.Generator().manual_seed(seed)
    sd, made = {}, {}
    for m in modules:
        t = factors(kind, m, g)
        made[m] = (t, alpha)
        sd.update({f"{key(m)}.{p}": v.contiguous() for p, v in t.items()})
        if alpha is not None:
            sd[f"{key(m)}.alpha"] = torch.tensor(alpha)
    sd.update(extra or {})
    save_file(sd, str(path))
    return str(path), made


def merged_reference(w0, made_strengths):
    acc = w0.double()
    for (t, alpha), s in made_strengths:
        acc = acc + s * reference_delta(t, alpha, w0.shape)
    return acc.to(w0.dtype)
