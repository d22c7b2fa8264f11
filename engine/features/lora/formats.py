"""Reading a LoRA file against a model: the published key formats, matched against names built from the
model's own modules (its checkpoint names: a fused part is rows of its fused module), into a ``LoRAFile``.
Keys that match nothing, and kinds this engine does not apply, are reported, never dropped; a file for
another architecture or of other shapes is refused (docs/lora.md lists the formats).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...errors import LoRAError
from ...io.readers import open_file
from ...io.safetensors import CheckpointError
from ...models.family import family_of
from ..fuse import RowView, linear_parts
from ..quant import quant_modules
from . import lycoris
from .fused import fused_shape, in_our_names, part_lycoris, part_rows, part_shapes
from .peft import PEFT_FORMATS, peft_alpha, peft_config
from .shard import cut_entry, full_shape, layer_cut

log = logging.getLogger("sgld.lora")

# (format, up suffix, down suffix), the longest first (``.lora_B.default.weight`` before ``.lora_B``).
ADAPTERS: Tuple[Tuple[str, str, str], ...] = (
    ("peft_default", ".lora_B.default.weight", ".lora_A.default.weight"),
    ("transformers", ".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    ("kohya", ".lora_up.weight", ".lora_down.weight"),
    ("peft", ".lora_B.weight", ".lora_A.weight"),
    ("diffusers_v3", ".lora.up.weight", ".lora.down.weight"),
    ("diffusers_old", "_lora.up.weight", "_lora.down.weight"),
    ("mochi", ".lora_B", ".lora_A"),
)
ALPHA_SUFFIX = ".alpha"
DIFF_SUFFIX = ".diff"
# Known LoRA parts this engine does not apply: reported, never silently dropped.
UNSUPPORTED_SUFFIXES = {
    ".dora_scale": "DoRA magnitude (dropped, as diffusers does)",
    ".lora_mid.weight": "LoCon/Tucker mid weight",
    ".diff_b": "bias difference", ".oft_blocks": "OFT",
}
# the parts that make a layer's update (an alpha alone makes none)
DELTA_PARTS = frozenset({"up", "down", "diff"}) | lycoris.PARTS
DOTTED_PREFIXES = ("", "diffusion_model.", "model.diffusion_model.", "transformer.", "base_model.model.",
                   "base_model.model.transformer.", "base_model.model.diffusion_model.", "unet.")
FLAT_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_")
TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder", "te_", "lora_te1_", "lora_te2_", "text_model.")
# Key fragments of other architectures' LoRAs (for the refusal message).
OTHER_ARCHITECTURES = (
    ("double_blocks", "Flux (double/single stream blocks)"), ("single_blocks", "Flux (double/single stream blocks)"),
    ("single_transformer_blocks", "Flux (diffusers names)"), ("transformer_blocks", "a diffusers DiT such as SD3, Flux, "
                                                             "Qwen-Image or Wan (transformer_blocks.N)"),
    ("input_blocks", "a Stable Diffusion / SDXL UNet"), ("down_blocks", "a Stable Diffusion / SDXL UNet (diffusers names)"),
    ("lora_unet_down", "a Stable Diffusion / SDXL UNet (kohya names)"), ("joint_blocks", "Stable Diffusion 3 (MMDiT)"),
    ("blocks.", "a DiT with 'blocks.N' layers (e.g. Wan, HunyuanVideo, Lumina)"),
    ("layers.", "a DiT with 'layers.N' of another shape (e.g. Z-Image, Lumina2)"),
)



# -- reading ------------------------------------------------------------------------------------------------
@dataclass
class LoRAEntry:
    """One adapted module of one LoRA file."""

    module: str
    down: Optional[torch.Tensor] = None  # A [r, in(, kh, kw)]
    up: Optional[torch.Tensor] = None  # B [out, r(, 1, 1)]
    alpha: Optional[float] = None
    diff: Optional[torch.Tensor] = None  # full weight difference (".diff")
    fmt: str = ""
    rslora: bool = False  # PEFT use_rslora: scale = alpha / sqrt(rank)
    lycoris: Optional[lycoris.Lycoris] = None  # LoKr / LoHa factors (engine/features/lora/lycoris.py)

    @property
    def rank(self) -> int:
        if self.lycoris is not None:
            return self.lycoris.rank
        return 0 if self.down is None else int(self.down.shape[0])

    @property
    def scale(self) -> float:
        """alpha / rank, or 1.0 without alpha (a ``.diff`` entry: 1.0; LoKr / LoHa: ComfyUI's rule)."""
        if self.lycoris is not None:
            return self.lycoris.scale
        if self.diff is not None or self.alpha is None or not self.rank:
            return 1.0
        return float(self.alpha) / (self.rank ** 0.5 if self.rslora else self.rank)


@dataclass
class LoRAFile:
    """A LoRA read against one model: entries per module, and everything that was not applied."""

    path: str
    entries: Dict[str, LoRAEntry]
    unmatched: List[str] = field(default_factory=list)  # keys that match no module of the model
    unsupported: List[Tuple[str, str]] = field(default_factory=list)  # (key, what it is)
    formats: Tuple[str, ...] = ()
    metadata: Dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    file_key: Optional[tuple] = None  # what identifies the file read (files.file_key); None: held in memory
    model_title: str = "the DiT"  # the family of the DiT it was read against, for messages

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def report(self) -> List[str]:
        """Messages about keys that were not applied (empty when every key was used)."""
        out = []
        if self.unmatched:
            te = [k for k in self.unmatched if k.startswith(TEXT_ENCODER_PREFIXES)]
            first = ", ".join(self.unmatched[:4])
            msg = (f"LoRA {self.name}: {len(self.unmatched)} of its keys match no layer of the {self.model_title} DiT and were "
                   f"not applied (first: {first})")
            if te:
                msg += f"; {len(te)} of them are text-encoder keys (this engine patches the diffusion model only)"
            out.append(msg)
        if self.unsupported:
            kinds = sorted({w for _, w in self.unsupported})
            out.append(f"LoRA {self.name}: {len(self.unsupported)} keys of kinds this engine does not apply were ignored "
                       f"({'; '.join(kinds)}; first: {', '.join(k for k, _ in self.unsupported[:3])})")
        return out

    def describe(self) -> str:
        ranks = sorted({e.rank for e in self.entries.values() if e.rank})
        return (f"{self.name}: {len(self.entries)} layers, format {'/'.join(self.formats) or '?'}, "
                f"rank {'/'.join(map(str, ranks)) or '-'}")


@dataclass(eq=False)
class LoRATensors:
    """A LoRA held in memory (ComfyUI's LoRA patches on the MODEL path): read like a file, never written to
    one. ``name``: what messages call it (the user's file); ``origin``: a key here -> the key the user's file
    has (messages name the user's keys). Compared by identity: the same object is the same LoRA."""

    name: str
    weights: Dict[str, torch.Tensor]
    origin: Dict[str, str] = field(default_factory=dict)
    metadata: Dict[str, str] = field(default_factory=dict)

    def keys(self):
        return list(self.weights)

    def tensors(self, keys):
        return [(k, self.weights[k]) for k in keys]

    def shape(self, key) -> tuple:
        return tuple(self.weights[key].shape)

    def dtype(self, key) -> torch.dtype:
        return self.weights[key].dtype


def target_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """What a LoRA can adapt, by checkpoint name: linears, convs, quantized linears, and the parts of fused
    projections (``engine.features.fuse.RowView``: a q projection is rows of the fused q/k/v linear)."""
    kinds = (nn.Linear, nn.Conv2d, RowView) + quant_modules()
    return {name: m for name, m in linear_parts(model).items() if name and isinstance(m, kinds)}


def is_quantized(target) -> bool:
    """An FP8 / INT4 layer (or a part of a fused one): never merged, a side path instead."""
    return isinstance(target.module if isinstance(target, RowView) else target, quant_modules())


def key_map(model: nn.Module) -> Dict[str, str]:
    """Every accepted LoRA key prefix -> module name (built from the model's own module names)."""
    out: Dict[str, str] = {}
    for name in target_modules(model):
        for p in DOTTED_PREFIXES:
            out[p + name] = name
        flat = name.replace(".", "_")
        for p in FLAT_PREFIXES:
            out.setdefault(p + flat, name)
    return out


def family_layouts(model: nn.Module) -> tuple:
    """The model's family's other layouts (``Family.layouts``), () for a module of no family."""
    try:
        return family_of(model).layouts
    except TypeError:
        return ()


def _title(model: nn.Module) -> str:
    """The model's family's name for messages ("ERNIE-Image", "Z-Image"), "the DiT" for another module."""
    try:
        return family_of(model).title
    except TypeError:
        return "the DiT"


def _split_key(key: str) -> Tuple[str, str, str]:
    """key -> (prefix, part, fmt) with part in up/down/alpha/diff/unsupported:<what>/'' (unknown)."""
    for fmt, up, down in ADAPTERS:
        if key.endswith(up):
            return key[: -len(up)], "up", fmt
        if key.endswith(down):
            return key[: -len(down)], "down", fmt
    if key.endswith(ALPHA_SUFFIX):
        return key[: -len(ALPHA_SUFFIX)], "alpha", ""
    if key.endswith(DIFF_SUFFIX):
        return key[: -len(DIFF_SUFFIX)], "diff", "diff"
    lyco = lycoris.split_key(key)
    if lyco is not None:
        return lyco[0], lyco[1], lyco[1][:4]  # fmt "lokr" / "hada"
    for suf, what in UNSUPPORTED_SUFFIXES.items():
        if key.endswith(suf):
            return key[: -len(suf)], "unsupported:" + what, ""
    return key, "", ""


def _guess_architecture(keys: Sequence[str]) -> str:
    joined = "\n".join(keys[:2000])
    for frag, arch in OTHER_ARCHITECTURES:
        if frag in joined:
            return arch
    if all(k.startswith(TEXT_ENCODER_PREFIXES) for k in keys):
        return "a text encoder only"
    return ""


def _open(source):
    """(name for messages, reader with keys() / tensors() / metadata, key -> the user's spelling, file key)."""
    if isinstance(source, LoRATensors):
        return source.name, source, lambda k: source.origin.get(k, k), None
    path = os.fspath(source)
    try:
        key = file_key(path) if os.path.isfile(path) else None  # before the read: a file replaced meanwhile
        return path, open_file(path), lambda k: k, key  # gets a new key next time
    except CheckpointError as e:
        raise LoRAError(str(e)) from None


def file_key(path: str) -> tuple:
    """What identifies a file's content for the caches: its device and inode (every name of it: a link, another
    spelling of its path), and its times and size (a file replaced, by a rename or by ``cp -p`` keeping its
    mtime, gets a new inode or ctime)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise LoRAError(f"{path}: cannot read the LoRA file ({e.strerror})") from None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def _header_tensors(f, keys) -> Dict[str, torch.Tensor]:
    """Meta tensors of the header's shapes and dtypes: what a LoRA costs, with no data read."""
    return {k: torch.empty(f.shape(k), dtype=f.dtype(k), device="meta") for k in keys}


def read_lora(source, model: nn.Module, header_only: bool = False) -> LoRAFile:
    """Read a LoRA against ``model``: a .safetensors path, or a ``LoRATensors`` held in memory (tensors stay
    on the CPU in their dtype). ``header_only``: every check the header allows and the tensors as meta tensors
    of their shapes and dtypes (alphas unread), so what it costs is known before any data is read."""
    path, f, user, key = _open(source)
    keys = list(f.keys())
    if not keys:
        raise LoRAError(f"{path}: this LoRA file holds no tensors")
    kmap = key_map(model)
    modules = target_modules(model)
    title = _title(model)
    groups: Dict[str, Dict[str, str]] = {}
    unknown: List[str] = []
    unsupported: List[Tuple[str, str]] = []
    for k in keys:
        if k in lycoris.IGNORED_KEYS:
            continue
        prefix, part, fmt = _split_key(k)
        if part.startswith("unsupported:"):
            unsupported.append((user(k), part.split(":", 1)[1]))
        elif not part:
            unknown.append(k)
        else:
            groups.setdefault(prefix, {})[part] = k
            if fmt:  # lora_up / lora_down under a module's dotted name: ComfyUI's layout, not kohya's flat one
                groups[prefix]["fmt"] = "comfyui" if fmt == "kohya" and "." in prefix else fmt
    groups = in_our_names(groups, family_layouts(model), kmap, DOTTED_PREFIXES, FLAT_PREFIXES)
    matched = {p: g for p, g in groups.items() if p in kmap}
    unmatched = sorted(map(user, unknown + [k for p, g in groups.items() if p not in kmap for part, k in g.items() if part != "fmt"]))
    if not matched and any(_split_key(k)[0] in kmap for k, _ in unsupported):
        kinds = sorted({w for _, w in unsupported})
        raise LoRAError(f"{path}: this adapter for {title} uses {', '.join(kinds)}, which this engine does not apply "
                        "(supported: LoRA up/down or A/B pairs with alpha, LyCORIS LoKr and LoHa, and full .diff weights)")
    if not matched:
        arch = _guess_architecture(keys)
        meta = {k: v for k, v in f.metadata.items() if k in ("ss_base_model_version", "modelspec.architecture", "ss_network_module")}
        raise LoRAError(
            f"{path}: not a LoRA for {title}: none of its {len(keys)} keys names a layer of the {title} DiT "
            f"(first keys: {', '.join(sorted(map(user, keys))[:3])})" + (f"; it looks like a LoRA for {arch}" if arch else "")
            + (f"; file metadata: {meta}" if meta else "")
            + f". Use a LoRA trained for {title}" + (" / ERNIE-Image-Turbo." if title == "ERNIE-Image" else "."))
    seen: Dict[str, str] = {}
    for prefix, g in matched.items():  # names and shapes from the header, before any data is read
        mod_name = kmap[prefix]
        if mod_name in seen and set(g) & DELTA_PARTS:
            raise LoRAError(f"{path}: layer '{mod_name}' is adapted twice (keys '{user(seen[mod_name])}' and '{user(prefix)}')")
        if set(g) & DELTA_PARTS:
            seen[mod_name] = prefix
        wshape = full_shape(weight_shape(modules[mod_name]), layer_cut(model, mod_name))  # a TP shard: the whole layer's
        _check_shapes(path, g, mod_name, wshape, part_shapes(g, f.shape), user)
        if set(g) & lycoris.PARTS:  # a fused layer's part: the factors fit the whole layer
            g["lycoris"] = lycoris.check(path, g, mod_name, fused_shape(wshape, g.get("rows")), f.shape, user)
    wanted = list(dict.fromkeys(k for g in matched.values() for part, k in g.items() if part not in NOT_KEYS))
    try:
        tensors = _header_tensors(f, wanted) if header_only else dict(f.tensors(wanted))
    except CheckpointError as e:
        raise LoRAError(str(e)) from None
    entries: Dict[str, LoRAEntry] = {}
    formats = set()
    nbytes = 0
    for prefix, g in matched.items():
        mod_name = kmap[prefix]
        e = LoRAEntry(mod_name)
        wshape = full_shape(weight_shape(modules[mod_name]), layer_cut(model, mod_name))
        if "alpha" in g and not header_only:
            e.alpha = float(tensors[g["alpha"]].float().reshape(()))
            if not math.isfinite(e.alpha):
                raise LoRAError(f"{path}: '{user(g['alpha'])}' is {e.alpha}: a LoRA alpha must be a finite number")
        if "diff" in g:  # stored in any shape of the layer's size ([192, 768], flat): as the layer's weight
            e.diff, e.fmt = part_rows(tensors[g["diff"]], g.get("rows")).reshape(wshape), "diff"
        if "up" in g:
            e.up, e.down, e.fmt = part_rows(tensors[g["up"]], g.get("rows")), tensors[g["down"]], g.get("fmt", "")
        if "lycoris" in g:
            kind, rank = g["lycoris"]
            parts = {p: tensors[k] for p, k in g.items() if p in lycoris.PARTS}
            whole = lycoris.build(kind, rank, parts, e.alpha, fused_shape(wshape, g.get("rows")))
            e.lycoris, e.fmt = part_lycoris(whole, g.get("rows")), kind
        if e.up is None and e.diff is None and e.lycoris is None:  # an alpha alone
            unmatched.append(user(g["alpha"]))
            continue
        for part, k in g.items():
            if part in DELTA_PARTS and not header_only and not all_finite(tensors[k]):
                raise LoRAError(f"{path}: '{user(k)}' holds NaN or infinite values: the LoRA file is damaged "
                                "(a LoRA trained with a diverged loss?)")
        formats.add(e.fmt)
        nbytes += sum(t.numel() * t.element_size() for t in (e.up, e.down, e.diff) if t is not None)
        nbytes += e.lycoris.nbytes if e.lycoris is not None else 0
        entries[mod_name] = cut_entry(e, layer_cut(model, mod_name))  # a TP shard keeps its slice of the update
    if not entries:
        raise LoRAError(f"{path}: no usable LoRA weights (only {len(keys)} alpha / unsupported keys)")
    pcfg = peft_config(path, f.metadata) if any(e.alpha is None and e.fmt in PEFT_FORMATS for e in entries.values()) else None
    if pcfg is not None:
        for e in entries.values():
            if e.alpha is None and e.up is not None:
                e.alpha = peft_alpha(pcfg, e.module)
                e.rslora = bool(pcfg.get("use_rslora"))
    lf = LoRAFile(path, entries, sorted(unmatched), unsupported, tuple(sorted(formats)), dict(f.metadata), nbytes, key, title)
    if header_only:
        return lf
    log.info("LoRA %s", lf.describe())
    for msg in lf.report():
        log.warning("%s", msg)
    return lf


NOT_KEYS = ("fmt", "lycoris", "rows")  # a group's entries that are not the file's keys


def _check_shapes(path: str, g: Dict[str, str], mod_name: str, wshape: tuple, shape_of, user) -> None:
    """One layer's keys (``g``: part -> key) against its weight, by the shapes the header gives (``shape_of``);
    ``user`` names a key as the user's file spells it."""
    if "alpha" in g and numel(shape_of(g["alpha"])) != 1:
        raise LoRAError(f"{path}: '{user(g['alpha'])}' should be a scalar, it has shape {shape_of(g['alpha'])}")
    if "diff" in g and numel(shape_of(g["diff"])) != numel(wshape):
        raise LoRAError(f"{path}: '{user(g['diff'])}' has shape {shape_of(g['diff'])}, but layer '{mod_name}' of this model "
                        f"has weight {tuple(wshape)}: this LoRA is for a model of another size")
    if "up" not in g and "down" not in g:
        return
    if "up" not in g or "down" not in g:
        have = g.get("up") or g.get("down")
        raise LoRAError(f"{path}: '{user(have)}' has no matching {'down (A)' if 'up' in g else 'up (B)'} weight: "
                        "the LoRA file is incomplete")
    up, down = shape_of(g["up"]), shape_of(g["down"])
    out_f, in_f = wshape[0], numel(wshape[1:])
    if len(up) < 2 or len(down) < 2 or up[1] != down[0] or numel(up[2:]) != 1:
        raise LoRAError(f"{path}: '{user(g['up'])}' {up} and '{user(g['down'])}' {down} are not a low-rank pair (up [out, r], "
                        "down [r, in])")
    if up[0] != out_f or numel(down[1:]) != in_f:
        raise LoRAError(f"{path}: '{user(g['down'])}' / '{user(g['up'])}' make a [{up[0]}, {numel(down[1:])}] update, but layer "
                        f"'{mod_name}' of this model has weight {tuple(wshape)}: this LoRA is for a model of another "
                        "size or architecture")


def all_finite(t: torch.Tensor) -> bool:
    if t.is_floating_point() and t.element_size() == 1:  # fp8: isfinite is not implemented for every fp8 dtype
        t = t.float()
    return bool(torch.isfinite(t).all())


def weight_shape(mod: nn.Module) -> tuple:
    if hasattr(mod, "in_features") and not isinstance(mod, (nn.Linear, nn.Conv2d)):  # quantized linear
        return (mod.out_features, mod.in_features)
    return tuple(mod.weight.shape)


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
