"""LoRA for the ERNIE-Image DiT: the published key formats, several LoRAs at once, swapped in place.

Formats (reference engine_anchors.md §5, ernie_image.md §5). A LoRA file is read with the strict
safetensors reader (pickles are refused). Its keys are matched against names built FROM THE MODEL'S
OWN MODULES (as ComfyUI's ``model_lora_keys_unet`` does), so underscore-flattened kohya names never
need parsing. For every linear / conv module ``<m>`` of the DiT (e.g. ``layers.3.self_attention.to_q``,
``layers.3.mlp.gate_proj``, ``adaLN_modulation.1``, ``x_embedder.proj``) these prefixes match:

  ``<m>`` (bare), ``diffusion_model.<m>`` (ai-toolkit / ComfyUI), ``model.diffusion_model.<m>``,
  ``transformer.<m>`` (diffusers), ``base_model.model.<m>`` and ``base_model.model.transformer.<m>``
  (PEFT), ``unet.<m>``, ``lora_unet_<m with . -> _>`` (kohya), ``lora_transformer_<...>`` (OneTrainer),
  ``lycoris_<...>`` (LyCORIS)

and these adapter suffixes (up = B [out, r], down = A [r, in]):

  ``.lora_up.weight`` / ``.lora_down.weight`` (kohya), ``.lora_B.weight`` / ``.lora_A.weight`` (PEFT),
  ``.lora_B.default.weight`` / ``.lora_A.default.weight`` (PEFT, default adapter name),
  ``.lora.up.weight`` / ``.lora.down.weight`` (diffusers v3), ``_lora.up.weight`` / ``_lora.down.weight``
  (old diffusers), ``.lora_linear_layer.up.weight`` / ``.down.weight`` (transformers), ``.lora_B`` /
  ``.lora_A`` (Mochi), plus ``.alpha`` (scalar) and ``.diff`` (a full weight difference).

Scale: ``alpha / rank`` (rank = rows of down) with alpha from the file's ``.alpha`` tensors; for PEFT /
diffusers files without them, from the PEFT config that diffusers stores in the file metadata
(``lora_adapter_metadata``: ``lora_alpha``, ``alpha_pattern``, ``use_rslora`` -> alpha / sqrt(rank)) or
from an ``adapter_config.json`` beside the file (PEFT ``save_pretrained``); else 1.0 (alpha = rank);
times the strength of the LoRA. Nothing from a file is evaluated as a regex: ``alpha_pattern`` keys must be
plain module-name patterns (letters, digits, ``_``, ``-``, ``.`` and ``\\.``), matched as PEFT's
``(.*\\.)?(key)$`` matches them but one character at a time; the config is at most 1 MiB. Strengths,
alphas and the LoRA tensors must be finite (LoRAError naming the file and key).
Not applied and REPORTED (never silently dropped): keys that match no module, DoRA ``dora_scale``
(diffusers drops it too), LoCon ``lora_mid``, text-encoder keys (``lora_te*``, ``text_encoder.``).
A file none of whose keys matches (a LoRA for another architecture) is refused with a LoRAError that
says what the keys look like; so is one whose shapes do not fit this model.

Application (``LoRAState.apply``), for several LoRAs with their strengths at once:
  * plain (bf16 / fp16 / fp32) weights: merged in float32, ``W = dtype(W0 + sum_i s_i * alpha_i / r_i * B_i @ A_i)``,
    a block of rows at a time, written in place (``copy_``: same storage, so offload masters, compiled
    graphs and other references stay valid). Exact restore without re-reading the checkpoint:
    - 16-bit weights (the release is bf16): while merging, the difference of the old and new bit
      patterns is recorded as an int8 per weight, plus the original value of the few weights whose
      difference does not fit (sign flips, changes of 2x or more) (``UlpDiff``: ~1 byte per touched
      weight instead of a 2-byte copy). Removing, changing a strength or switching sets first
      subtracts the recorded patterns (integer arithmetic: bit-exact whatever kernels or thread counts
      did the merge), then merges the new set.
    - float32 weights (and every dtype with ``SGLD_LORA_RESTORE=copy``): a CPU copy of each touched
      original, merged from directly (faster strength changes, twice the memory of the record).
    Layers no longer touched are restored and their record dropped; with no LoRA nothing is kept.
  * FP8 / INT4 layers (engine/features/quant.py): never merged (re-quantizing would lose the base); a low-rank
    side path instead: the module's class is swapped for a subclass whose forward adds
    ``(x @ A^T) @ (s * alpha / r * B)^T`` (the LoRAs of one layer concatenated along the rank), in the
    activation dtype on the compute device; removing the LoRA swaps the class back.
  * layer-wise offload (engine/features/offload.py): merges happen inside ``offload.updating()``, i.e. into the
    CPU masters, and the device buffers are refilled; so what is streamed is the merged weight.
  * all or nothing: each layer's restore record (or side-path record) exists before the layer changes, and
    an UlpDiff knows how far a merge or restore of its rows got; any exception during the change (a bad
    LoRA, out of memory, KeyboardInterrupt) restores the base bit-exactly before it propagates, and then no
    LoRA is active. A set refused by the checks before the change leaves the previous set as it was.
  * torch.compile (engine/features/compile.py): block weights are graph inputs and merging is in place, so a
    merged LoRA swap, a strength change or a removal never recompiles (tested). Side paths on quantized
    layers change what a block computes: the first set compiles one more block graph per distinct
    layout of adapted layers in a block (a LoRA on every block linear: one), a set of another rank
    per layer another one; changing strengths and returning to a layout seen before reuse the graphs
    (tested). A class swap and not a forward hook, because torch.compile does not guard on hooks
    (``torch._dynamo.config.skip_nnmodule_hook_guards``): a hook added after compiling is ignored.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from ..errors import LoRAError

from ..io.safetensors import CheckpointError, SafetensorsFile

log = logging.getLogger("sgld.lora")

# (up suffix, down suffix), the longest first (``.lora_B.default.weight`` before ``.lora_B``).
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
MERGE_CHUNK_BYTES = 4 * 2 ** 20  # float32 rows merged at a time on the CPU (fits the cache)
MERGE_CHUNK_BYTES_GPU = 256 * 2 ** 20
DIFF_SUFFIX = ".diff"
# Known LoRA parts this engine does not apply: reported, never silently dropped.
UNSUPPORTED_SUFFIXES = {
    ".dora_scale": "DoRA magnitude (dropped, as diffusers does)",
    ".lora_mid.weight": "LoCon/Tucker mid weight",
    ".diff_b": "bias difference",
    ".hada_w1_a": "LoHa", ".hada_w1_b": "LoHa", ".hada_w2_a": "LoHa", ".hada_w2_b": "LoHa",
    ".lokr_w1": "LoKr", ".lokr_w2": "LoKr", ".lokr_w1_a": "LoKr", ".lokr_w1_b": "LoKr",
    ".lokr_w2_a": "LoKr", ".lokr_w2_b": "LoKr", ".oft_blocks": "OFT",
}
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

    @property
    def rank(self) -> int:
        return 0 if self.down is None else int(self.down.shape[0])

    @property
    def scale(self) -> float:
        """alpha / rank, or 1.0 without alpha (a ``.diff`` entry: 1.0)."""
        if self.diff is not None or self.alpha is None or not self.rank:
            return 1.0
        return float(self.alpha) / (self.rank ** 0.5 if self.rslora else self.rank)

    def delta(self, weight_shape, device=None) -> torch.Tensor:
        """The float32 weight difference at strength 1 (already scaled by alpha / rank)."""
        if self.diff is not None:
            return self.diff.to(device=device, dtype=torch.float32).reshape(weight_shape)
        up = self.up.to(device=device, dtype=torch.float32).flatten(1)
        down = self.down.to(device=device, dtype=torch.float32).flatten(1)
        return (up @ down).mul_(self.scale).reshape(weight_shape)


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

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def report(self) -> List[str]:
        """Messages about keys that were not applied (empty when every key was used)."""
        out = []
        if self.unmatched:
            te = [k for k in self.unmatched if k.startswith(TEXT_ENCODER_PREFIXES)]
            first = ", ".join(self.unmatched[:4])
            msg = (f"LoRA {self.name}: {len(self.unmatched)} of its keys match no layer of the ERNIE-Image DiT and were "
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


def target_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """What a LoRA can adapt, by checkpoint name: linears, convs, quantized linears, and the parts of fused
    projections (``engine.features.fuse.RowView``: ``to_q`` is rows of ``qkv``)."""
    from .fuse import RowView, linear_parts
    from .quant import QUANT_MODULES

    kinds = (nn.Linear, nn.Conv2d, RowView) + tuple(QUANT_MODULES)
    return {name: m for name, m in linear_parts(model).items()
            if name and isinstance(m, kinds) and getattr(m, "fused_parts", None) is None}


def _is_quantized(target) -> bool:
    from .fuse import RowView
    from .quant import QUANT_MODULES

    return isinstance(target.module if isinstance(target, RowView) else target, QUANT_MODULES)


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


PEFT_METADATA_KEY = "lora_adapter_metadata"  # diffusers' save_lora_weights: the PEFT LoraConfig as JSON
PEFT_FORMATS = ("peft", "peft_default", "mochi", "diffusers_v3", "diffusers_old", "transformers")


# PEFT configs from a file are bounded and never evaluated as code: at most this many bytes of JSON, this
# many ``alpha_pattern`` entries of at most this many characters, each a plain module-name pattern.
MAX_PEFT_CONFIG_BYTES = 1 << 20
MAX_ALPHA_PATTERNS = 1024
MAX_PATTERN_CHARS = 256
# letters, digits, '_', '-', '.' (any one character, as in PEFT's regex) and '\.' (a literal dot): no
# quantifier, group or alternation, so matching is one comparison per character (no backtracking)
PLAIN_PATTERN = re.compile(r"(?:[A-Za-z0-9_\-.]|\\\.)+")
ALLOWED_PATTERN = ("letters, digits, '_', '-', '.' and '\\.' (a module-name suffix such as 'to_q' or "
                   "'layers.3.mlp.gate_proj'); regular expressions from a file are not evaluated")


def _finite_number(value, where: str) -> float:
    """A number from a LoRA file that must be finite (alpha): else LoRAError naming where it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LoRAError(f"{where} is {value!r}, not a number")
    if not math.isfinite(value):
        raise LoRAError(f"{where} is {value!r}: it must be a finite number")
    return float(value)


@dataclass
class AlphaPattern:
    """One PEFT ``alpha_pattern`` entry, matched as PEFT does (``re.match(rf"(.*\\.)?({key})$", module)``) but
    without a regex engine: the pattern is fixed-length, so it must match the module name's last characters
    ('.' any character, '\\.' a dot), preceded by a dot or nothing."""

    key: str
    alpha: float
    chars: Tuple[Optional[str], ...]  # None = any character

    def matches(self, module: str) -> bool:
        n = len(self.chars)
        if len(module) < n or (len(module) > n and module[-n - 1] != "."):
            return False
        return all(c is None or c == m for c, m in zip(self.chars, module[-n:]))


def _alpha_patterns(raw, where: str) -> List[AlphaPattern]:
    if raw in (None, {}):
        return []
    if not isinstance(raw, dict):
        raise LoRAError(f"{where} 'alpha_pattern' is a {type(raw).__name__}, not an object of module pattern -> alpha")
    if len(raw) > MAX_ALPHA_PATTERNS:
        raise LoRAError(f"{where} 'alpha_pattern' has {len(raw)} entries; at most {MAX_ALPHA_PATTERNS} are read")
    out = []
    for key, alpha in raw.items():
        if len(key) > MAX_PATTERN_CHARS or not PLAIN_PATTERN.fullmatch(key):
            shown = key if len(key) <= 80 else key[:80] + "..."
            raise LoRAError(f"{where} 'alpha_pattern' has the key {shown!r}, which is not a plain module-name pattern "
                            f"(at most {MAX_PATTERN_CHARS} characters: {ALLOWED_PATTERN})")
        chars = tuple("." if tok == "\\." else (None if tok == "." else tok) for tok in re.findall(r"\\\.|.", key))
        out.append(AlphaPattern(key, _finite_number(alpha, f"{where} 'alpha_pattern' value of {key!r}"), chars))
    return out


def peft_config(path: str, metadata: Dict[str, str]) -> Optional[dict]:
    """The PEFT LoraConfig of a file: diffusers' ``lora_adapter_metadata`` (keys ``transformer.lora_alpha``
    ...) or ``adapter_config.json`` beside the file. None when there is none. Checked here: ``lora_alpha``
    is a finite number, ``alpha_pattern`` (replaced by a list of AlphaPattern) holds plain patterns only."""
    import json

    cfg, where = None, ""
    raw = metadata.get(PEFT_METADATA_KEY)
    if raw:
        where = f"{path}: metadata '{PEFT_METADATA_KEY}'"
        if len(raw) > MAX_PEFT_CONFIG_BYTES:
            raise LoRAError(f"{where} is {len(raw)} bytes; a PEFT config is at most {MAX_PEFT_CONFIG_BYTES} bytes")
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError):
            raise LoRAError(f"{where} is not valid JSON") from None
        if isinstance(d, dict):
            sub = {k.split(".", 1)[1]: v for k, v in d.items() if k.startswith("transformer.")}
            cfg = sub or d
    side = os.path.join(os.path.dirname(os.path.abspath(path)), "adapter_config.json")
    if cfg is None and os.path.isfile(side):
        where = side + ":"
        if os.path.getsize(side) > MAX_PEFT_CONFIG_BYTES:
            raise LoRAError(f"{side}: this PEFT adapter config is larger than {MAX_PEFT_CONFIG_BYTES} bytes")
        try:
            with open(side) as fh:
                cfg = json.load(fh)
        except (OSError, ValueError, RecursionError):
            raise LoRAError(f"{side}: cannot read this PEFT adapter config (not JSON)") from None
    if not isinstance(cfg, dict) or "lora_alpha" not in cfg:
        return None
    cfg = dict(cfg, lora_alpha=_finite_number(cfg["lora_alpha"], f"{where} 'lora_alpha'"),
               alpha_pattern=_alpha_patterns(cfg.get("alpha_pattern"), where))
    return cfg


def _peft_alpha(cfg: dict, module: str) -> float:
    """PEFT: the first ``alpha_pattern`` entry matching the end of the module name, else ``lora_alpha``."""
    for pat in cfg["alpha_pattern"]:
        if pat.matches(module):
            return pat.alpha
    return cfg["lora_alpha"]


def read_lora(path: str, model: nn.Module) -> LoRAFile:
    """Read a LoRA .safetensors file against ``model`` (tensors stay on the CPU in the file's dtype)."""
    path = os.fspath(path)
    try:
        f = SafetensorsFile(path)
    except CheckpointError as e:
        raise LoRAError(str(e)) from None
    name = os.path.basename(path)
    keys = list(f.keys())
    if not keys:
        raise LoRAError(f"{path}: this LoRA file holds no tensors")
    kmap = key_map(model)
    modules = target_modules(model)
    groups: Dict[str, Dict[str, str]] = {}
    unknown: List[str] = []
    unsupported: List[Tuple[str, str]] = []
    for k in keys:
        prefix, part, fmt = _split_key(k)
        if part.startswith("unsupported:"):
            unsupported.append((k, part.split(":", 1)[1]))
        elif not part:
            unknown.append(k)
        else:
            groups.setdefault(prefix, {})[part] = k
            if fmt:
                groups[prefix]["fmt"] = fmt
    matched = {p: g for p, g in groups.items() if p in kmap}
    unmatched = sorted(unknown + [k for p, g in groups.items() if p not in kmap for part, k in g.items() if part != "fmt"])
    if not matched and any(_split_key(k)[0] in kmap for k, _ in unsupported):
        kinds = sorted({w for _, w in unsupported})
        raise LoRAError(f"{path}: this adapter for ERNIE-Image uses {', '.join(kinds)}, which this engine does not apply "
                        "(supported: LoRA up/down or A/B pairs with alpha, and full .diff weights)")
    if not matched:
        arch = _guess_architecture(keys)
        meta = {k: v for k, v in f.metadata.items() if k in ("ss_base_model_version", "modelspec.architecture", "ss_network_module")}
        raise LoRAError(
            f"{path}: not a LoRA for ERNIE-Image: none of its {len(keys)} keys names a layer of the ERNIE-Image DiT "
            f"(first keys: {', '.join(sorted(keys)[:3])})" + (f"; it looks like a LoRA for {arch}" if arch else "")
            + (f"; file metadata: {meta}" if meta else "")
            + ". Use a LoRA trained for ERNIE-Image / ERNIE-Image-Turbo.")
    tensors = dict(f.tensors([k for g in matched.values() for part, k in g.items() if part != "fmt"]))
    entries: Dict[str, LoRAEntry] = {}
    formats = set()
    nbytes = 0
    for prefix, g in matched.items():
        mod_name = kmap[prefix]
        mod = modules[mod_name]
        wshape = _weight_shape(mod)
        if mod_name in entries:
            raise LoRAError(f"{path}: layer '{mod_name}' is adapted twice (keys '{prefix}' and another spelling)")
        e = LoRAEntry(mod_name)
        if "alpha" in g:
            a = tensors[g["alpha"]]
            if a.numel() != 1:
                raise LoRAError(f"{path}: '{g['alpha']}' should be a scalar, it has shape {tuple(a.shape)}")
            e.alpha = float(a.float().reshape(()))
            if not math.isfinite(e.alpha):
                raise LoRAError(f"{path}: '{g['alpha']}' is {e.alpha}: a LoRA alpha must be a finite number")
        if "diff" in g:
            d = tensors[g["diff"]]
            if d.numel() != _numel(wshape):
                raise LoRAError(f"{path}: '{g['diff']}' has shape {tuple(d.shape)}, but layer '{mod_name}' of this model "
                                f"has weight {tuple(wshape)}: this LoRA is for a model of another size")
            e.diff, e.fmt = d, "diff"
        if "up" in g or "down" in g:
            if "up" not in g or "down" not in g:
                have = g.get("up") or g.get("down")
                raise LoRAError(f"{path}: '{have}' has no matching {'down (A)' if 'up' in g else 'up (B)'} weight: "
                                "the LoRA file is incomplete")
            up, down = tensors[g["up"]], tensors[g["down"]]
            out_f, in_f = wshape[0], _numel(wshape[1:])
            if up.dim() < 2 or down.dim() < 2 or up.shape[1] != down.shape[0] or _numel(up.shape[2:]) != 1:
                raise LoRAError(f"{path}: '{g['up']}' {tuple(up.shape)} and '{g['down']}' {tuple(down.shape)} are not a "
                                "low-rank pair (up [out, r], down [r, in])")
            if up.shape[0] != out_f or _numel(down.shape[1:]) != in_f:
                raise LoRAError(f"{path}: '{g['down']}' / '{g['up']}' make a [{up.shape[0]}, {_numel(down.shape[1:])}] update, "
                                f"but layer '{mod_name}' of this model has weight {tuple(wshape)}: this LoRA is for a "
                                "model of another size or architecture")
            e.up, e.down, e.fmt = up, down, g.get("fmt", "")
        if e.up is None and e.diff is None:  # an alpha alone
            unmatched.append(g["alpha"])
            continue
        for part in ("up", "down", "diff"):
            if part in g and not _all_finite(tensors[g[part]]):
                raise LoRAError(f"{path}: '{g[part]}' holds NaN or infinite values: the LoRA file is damaged "
                                "(a LoRA trained with a diverged loss?)")
        formats.add(e.fmt)
        nbytes += sum(t.numel() * t.element_size() for t in (e.up, e.down, e.diff) if t is not None)
        entries[mod_name] = e
    if not entries:
        raise LoRAError(f"{path}: no usable LoRA weights (only {len(keys)} alpha / unsupported keys)")
    pcfg = peft_config(path, f.metadata) if any(e.alpha is None and e.fmt in PEFT_FORMATS for e in entries.values()) else None
    if pcfg is not None:
        for e in entries.values():
            if e.alpha is None and e.up is not None:
                e.alpha = _peft_alpha(pcfg, e.module)
                e.rslora = bool(pcfg.get("use_rslora"))
    lf = LoRAFile(path, entries, sorted(unmatched), unsupported, tuple(sorted(formats)), dict(f.metadata), nbytes)
    log.info("LoRA %s", lf.describe())
    for msg in lf.report():
        log.warning("%s", msg)
    return lf


def _all_finite(t: torch.Tensor) -> bool:
    if t.is_floating_point() and t.element_size() == 1:  # fp8: isfinite is not implemented for every fp8 dtype
        t = t.float()
    return bool(torch.isfinite(t).all())


def _weight_shape(mod: nn.Module) -> tuple:
    if hasattr(mod, "in_features") and not isinstance(mod, (nn.Linear, nn.Conv2d)):  # quantized linear
        return (mod.out_features, mod.in_features)
    return tuple(mod.weight.shape)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# -- applying -----------------------------------------------------------------------------------------------
_SIDE_CLASSES: Dict[type, type] = {}


def _side_class(base: type) -> type:
    """``base`` (FP8Linear / Int4Linear) with the LoRA side path added to its forward. A class swap, not a
    forward hook: torch.compile guards on the module's class (it skips guards on hooks by default), so a
    compiled block sees the side path appear and disappear."""
    cls = _SIDE_CLASSES.get(base)
    if cls is None:
        def forward(self, x):
            a, b = self._sgld_lora_side
            return base.forward(self, x) + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))

        cls = type(base.__name__ + "WithLoRA", (base,), {"forward": forward, "_sgld_lora_base": base})
        _SIDE_CLASSES[base] = cls
    return cls


class UlpDiff:
    """What turns a merged 16-bit weight back into its original, exactly, in about half the bytes of a copy:
    per element the difference of the two bit patterns (int16 views) as an int8, and, sparsely, the
    original values where that difference does not fit (sign changes, changes of 2x or more).
    Integer arithmetic: the restore is bit-exact whatever GEMM kernels or thread counts did the merge.

    Merging and restoring go a block of rows at a time, and ``state`` says at every moment what the
    weight holds, so an interrupted merge or restore can always be undone (``LoRAState._restore``):
    rows ``[lo, hi)`` are merged (original = bits - d), the other rows are original, except the one
    block being written (``pending``: its first row and its original rows); the exceptions, written
    last, hold original values (writing them again anywhere is harmless). ``state`` is replaced as one
    tuple (one assignment: an exception cannot land half-way)."""

    def __init__(self, numel: int, dtype: torch.dtype):
        self.dtype = dtype
        self.d = torch.empty(numel, dtype=torch.int8)
        self.exc: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (flat int32 indices, their original values)
        self.state: Tuple[int, int, Optional[Tuple[int, torch.Tensor]]] = (0, 0, None)  # (lo, hi, pending)

    @property
    def nbytes(self) -> int:
        return self.d.numel() + sum(i.numel() * 4 + v.numel() * v.element_size() for i, v in self.exc)

    def exceptions(self) -> int:
        return sum(i.numel() for i, _ in self.exc)


def restore_mode() -> str:
    """``SGLD_LORA_RESTORE``: "compact" (default; 16-bit weights keep an UlpDiff, ~1 byte per touched weight)
    or "copy" (a copy of each touched original: twice the memory, ~1.5-3x faster strength changes on CPU)."""
    mode = os.environ.get("SGLD_LORA_RESTORE", "compact").lower()
    if mode not in ("compact", "copy"):
        raise LoRAError(f"SGLD_LORA_RESTORE='{mode}' is not supported; choose compact or copy")
    return mode


def _nbytes(rec) -> int:
    return rec.nbytes if isinstance(rec, UlpDiff) else rec.numel() * rec.element_size()


class LoRAState:
    """The LoRAs applied to one model, and what restores the layers they touch exactly.

    16-bit weights (bf16 / fp16, the release's dtype): an ``UlpDiff`` (about 1 byte per weight); the
    layer is restored in place, then merged again for a new set or strength. float32 weights: a copy
    of the original (about 4 bytes per weight), merged from directly.

    ``apply`` is transactional: a layer's restore record (``backups``) or side-path record (``hooks``)
    exists before the layer changes, so these two always name every layer that may differ from the base; any exception
    (a bad LoRA, out of memory, KeyboardInterrupt) restores the base bit-exactly before it propagates,
    and the state is then "no LoRA" (``applied == ()``). ``applied`` is None while a change is under way."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)  # the model holds this state: a strong reference would be a cycle
        self.backups: Dict[str, object] = {}  # module name -> UlpDiff or original weight (CPU)
        self.hooks: Dict[str, type] = {}  # module name -> its class before the side path (quantized layers)
        self.applied: Optional[Tuple] = ()  # ((LoRAFile, strength), ...); None while changing
        self.last_seconds = 0.0

    @property
    def model(self) -> nn.Module:
        return self._model()

    @property
    def backup_bytes(self) -> int:
        return sum(_nbytes(r) for r in self.backups.values())

    def _updating(self):
        from .offload import get_offload

        off = get_offload(self.model)
        return off.updating() if off is not None else contextlib.nullcontext()

    def _compute_device(self) -> torch.device:
        # the device blocks compute on (offload: its device, not the CPU masters)
        from .offload import get_offload

        off = get_offload(self.model)
        if off is not None:
            return torch.device(off.device)
        return self.model.final_linear.weight.device

    def _plan(self, loras, modules) -> Dict[str, List[Tuple[LoRAEntry, float]]]:
        """module name -> [(entry, strength)], checked against the model (nothing is changed here)."""
        plan: Dict[str, List[Tuple[LoRAEntry, float]]] = {}
        for lf, strength in loras:
            if float(strength) == 0.0:
                continue
            for name, e in lf.entries.items():
                if name not in modules:
                    raise LoRAError(f"{lf.path}: layer '{name}' is not in this model")
                mod = modules[name]
                if e.diff is not None and _is_quantized(mod):
                    raise LoRAError(f"{lf.path}: a full weight difference ('.diff') cannot be applied to the quantized "
                                    f"layer '{name}'; load the model without quantization to use this LoRA")
                wshape = _weight_shape(mod)
                got = [e.diff.numel()] if e.diff is not None else [int(e.up.shape[0]), _numel(e.down.shape[1:])]
                want = [_numel(wshape)] if e.diff is not None else [wshape[0], _numel(wshape[1:])]
                if got != want:
                    raise LoRAError(f"{lf.path}: the update of layer '{name}' is {got} but the layer's weight is "
                                    f"{tuple(wshape)}: this LoRA was read against a model of another size")
                plan.setdefault(name, []).append((e, float(strength)))
        return plan

    @torch.no_grad()
    def apply(self, loras: Sequence[Tuple[LoRAFile, float]]) -> None:
        """Make exactly ``loras`` (with their strengths) active; ``[]`` restores the base bit-exactly.
        All or nothing: on any exception the base is restored (then ``applied == ()``) and it propagates."""
        import time

        t0 = time.perf_counter()
        modules = target_modules(self.model)
        plan = self._plan(loras, modules)
        compact_ok = restore_mode() == "compact"
        self.applied = None
        try:
            with self._updating():
                self._change(plan, modules, compact_ok)
            self.applied = tuple((lf, float(s)) for lf, s in loras)
        except BaseException:
            with self._updating():  # offload: the layer buffers are refilled with the restored masters
                self._rollback(modules)
            raise
        self.last_seconds = time.perf_counter() - t0

    def _change(self, plan, modules, compact_ok: bool) -> None:
        def compact(name: str) -> bool:
            return compact_ok and modules[name].weight.element_size() == 2

        # 1. back to the original: every layer with a compact record, and copied layers no longer touched
        #    (or to be recorded compactly now); a record is dropped only once its layer is restored
        for name in list(self.backups):
            rec = self.backups[name]
            if isinstance(rec, UlpDiff):
                self._restore(modules[name].weight, rec)
                del self.backups[name]
            elif name not in plan or compact(name):
                modules[name].weight.copy_(rec)
                del self.backups[name]
        for name in [n for n in self.hooks if n not in plan or not _is_quantized(modules[n])]:
            self._remove_side(name, modules[name])
        # 2. touched layers: merged in float32, or a side path when quantized; the record first
        for name, items in plan.items():
            mod = modules[name]
            if _is_quantized(mod):
                self._set_side(name, mod, items)
                continue
            w = mod.weight
            if compact(name):
                rec = self.backups[name] = UlpDiff(w.numel(), w.dtype)
                self._merge(w, w, items, rec)
            else:
                if name not in self.backups:
                    self.backups[name] = w.detach().to("cpu", copy=True)
                self._merge(w, self.backups[name], items)

    def _rollback(self, modules) -> None:
        """Every touched layer back to the base (whatever point a merge or restore had reached), records dropped."""
        for name in list(self.backups):
            rec = self.backups[name]
            if isinstance(rec, UlpDiff):
                self._restore(modules[name].weight, rec)
            else:
                modules[name].weight.copy_(rec)
            del self.backups[name]
        for name in list(self.hooks):
            self._remove_side(name, modules[name])
        self.applied = ()

    @staticmethod
    def _rows(w2: torch.Tensor) -> int:
        budget = MERGE_CHUNK_BYTES if w2.device.type == "cpu" else MERGE_CHUNK_BYTES_GPU
        return max(1, budget // (4 * w2.shape[1]))

    @classmethod
    def _merge(cls, w: torch.Tensor, base: torch.Tensor, items, record: Optional[UlpDiff] = None):
        """w = dtype(base + sum s * scale * up @ down), in float32, a block of rows at a time (MERGE_CHUNK_BYTES
        of float32: cache-sized on CPUs, a bounded temporary on GPUs). ``base`` may be ``w`` itself; then
        ``record`` (an UlpDiff) gets what restores it, before each block of rows is written."""
        dev = w.device
        out = w.shape[0]
        w2, base2 = w.view(out, -1), base.view(out, -1)
        cols = w2.shape[1]
        terms = []
        for e, s in items:
            if e.diff is not None:
                terms.append((None, e.diff.to(dev, torch.float32).reshape(out, -1), s))
            else:
                terms.append((e.up.to(dev, torch.float32).flatten(1), e.down.to(dev, torch.float32).flatten(1), s * e.scale))
        rows = cls._rows(w2)
        for i in range(0, out, rows):
            src = base2[i:i + rows].to(dev)
            acc = src.to(torch.float32, copy=True)
            for up, down, s in terms:
                if up is None:
                    acc.add_(down[i:i + rows], alpha=s)
                else:
                    acc.addmm_(up[i:i + rows], down, alpha=s)
            new = acc.to(w.dtype)
            if record is not None:
                # new - old bit patterns modulo 2**16; where that does not fit an int8, keep the old value
                d16 = new.view(torch.int16) - src.view(torch.int16)
                d8 = d16.to(torch.int8)
                pos = (d8.to(torch.int16) != d16).reshape(-1).nonzero().reshape(-1)
                if pos.numel():
                    record.exc.append(((pos + i * cols).to(torch.int32).cpu(), src.reshape(-1)[pos].cpu()))
                record.d[i * cols:(i + rows) * cols].copy_(d8.reshape(-1))
                lo, hi, _ = record.state
                record.state = (lo, hi, (i, src.clone()))  # src may be a view of w: keep the originals
                w2[i:i + rows].copy_(new)
                record.state = (lo, i + new.shape[0], None)
            else:
                w2[i:i + rows].copy_(new)
        return record

    @classmethod
    def _restore(cls, w: torch.Tensor, record: UlpDiff) -> None:
        """Undo a merge recorded in ``record``, from whatever point a merge or an earlier restore reached:
        the block being written gets its originals back, the merged rows their bit patterns minus the int8
        differences (modulo 2**16), then the exceptions (whatever the subtraction gave there is overwritten)."""
        out = w.shape[0]
        w2 = w.view(out, -1)
        cols = w2.shape[1]
        bits = w2.view(torch.int16)
        lo, hi, pending = record.state
        if pending is not None:
            i, orig = pending
            w2[i:i + orig.shape[0]].copy_(orig)
            record.state = (lo, hi, None)
        rows = cls._rows(w2)
        while lo < hi:
            end = min(hi, lo + rows)
            d = record.d[lo * cols:end * cols].to(w.device).view(end - lo, cols)
            orig = bits[lo:end] - d.to(torch.int16)
            record.state = (end, hi, (lo, orig.view(w.dtype)))
            bits[lo:end].copy_(orig)
            lo = end
            record.state = (lo, hi, None)
        flat = w.view(-1)
        for idx, vals in record.exc:
            flat[idx.to(w.device, torch.int64)] = vals.to(w.device)

    def _set_side(self, name: str, target, items) -> None:
        mod, rows = _side_module(target)
        dev = self._compute_device()
        dtype = self.model.dtype if hasattr(self.model, "dtype") else torch.float32
        downs, ups = [], []
        for e, s in items:
            downs.append(e.down.float().flatten(1))
            ups.append(e.up.float().flatten(1) * (s * e.scale))
        a = torch.cat(downs, 0).to(dev, dtype)
        b = torch.cat(ups, 1).to(dev, dtype)
        if name not in self.hooks:  # recorded before the module changes
            self.hooks[name] = getattr(type(mod), "_sgld_lora_base", type(mod))
        mod.__dict__.setdefault("_sgld_lora_parts", {})[name] = (rows, a, b)
        _install_side(mod, self.hooks[name])

    def _remove_side(self, name: str, target) -> None:
        mod, _ = _side_module(target)
        base_cls = self.hooks.get(name)
        (mod.__dict__.get("_sgld_lora_parts") or {}).pop(name, None)
        if base_cls is not None:
            _install_side(mod, base_cls)
        self.hooks.pop(name, None)  # forgotten only once the module is back


def _side_module(target) -> Tuple[nn.Module, Tuple[int, int]]:
    """The module whose forward gets the side path, and the target's output rows in it (a fused part's)."""
    from .fuse import RowView

    if isinstance(target, RowView):
        return target.module, (target.start, target.stop)
    return target, (0, target.out_features)


def _install_side(mod: nn.Module, base_cls: type) -> None:
    """The module's side path from its parts (one per LoRA target in it: a fused module has several):
    A = every part's down stacked along the rank, B = each part's up in its own output rows (zeros elsewhere)."""
    parts = mod.__dict__.get("_sgld_lora_parts") or {}
    if not parts:
        mod.__class__ = base_cls
        mod.__dict__.pop("_sgld_lora_side", None)
        mod.__dict__.pop("_sgld_lora_parts", None)
        return
    a = torch.cat([pa for _, pa, _ in parts.values()], 0)
    b = a.new_zeros(mod.out_features, a.shape[0])
    r = 0
    for (start, stop), pa, pb in parts.values():
        b[start:stop, r:r + pa.shape[0]] = pb
        r += pa.shape[0]
    old = mod.__dict__.get("_sgld_lora_side")
    if old is not None and old[0].shape == a.shape and old[1].shape == b.shape:
        old[0].copy_(a)  # same shapes: in place (no new graph under torch.compile)
        old[1].copy_(b)
    else:
        mod._sgld_lora_side = (a, b)
    mod.__class__ = _side_class(base_cls)


def lora_state(model: nn.Module) -> LoRAState:
    st = model.__dict__.get("_sgld_lora")
    if st is None:
        st = LoRAState(model)
        model.__dict__["_sgld_lora"] = st  # not an nn.Module attribute: no state_dict / named_* side effects
    return st


# -- engine API ---------------------------------------------------------------------------------------------
LoRASpec = Union[Tuple[str, float], Tuple[LoRAFile, float], str]
MAX_CACHED_FILES = 8


def _file_key(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError as e:
        raise LoRAError(f"{path}: cannot read the LoRA file ({e.strerror})") from None
    return (os.path.realpath(path), st.st_mtime_ns, st.st_size)


def normalize(loras: Optional[Iterable]) -> List[Tuple[str, float]]:
    """[(path, strength)] from paths, (path, strength) pairs or "FILE:STRENGTH" strings."""
    out = []
    for item in loras or ():
        if isinstance(item, str):
            item = parse_spec(item)
        path, strength = item
        name = getattr(path, "path", path)
        try:
            strength = float(strength)
        except (TypeError, ValueError):
            raise LoRAError(f"{name}: LoRA strength '{strength}' is not a number") from None
        if not math.isfinite(strength):
            raise LoRAError(f"{name}: LoRA strength {strength} is not a finite number")
        out.append((path if isinstance(path, LoRAFile) else os.fspath(path), strength))
    return out


def parse_spec(spec: str) -> Tuple[str, float]:
    """``FILE:STRENGTH`` (``FILE`` alone = strength 1.0; a Windows drive letter is not a strength)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            strength = float(tail)
        except ValueError:
            return spec, 1.0
        if not math.isfinite(strength):
            raise LoRAError(f"LoRA '{spec}': the strength '{tail}' is not a finite number (FILE:STRENGTH, e.g. "
                            f"{head}:0.8)")
        return head, strength
    return spec, 1.0


def read_cached(engine, path: str) -> LoRAFile:
    """The LoRA read against the engine's model, cached per (file, mtime, size)."""
    cache = engine.__dict__.setdefault("_lora_files", {})
    key = _file_key(path)
    lf = cache.get(key)
    if lf is None:
        lf = read_lora(path, engine.model)
        cache[key] = lf
        while len(cache) > MAX_CACHED_FILES:
            cache.pop(next(iter(cache)))
    else:  # most recently used last
        cache[key] = cache.pop(key)
    return lf


def check_engine(engine) -> None:
    if not isinstance(getattr(engine, "model", None), nn.Module):
        raise LoRAError("LoRA is not supported on this engine (several GPUs / worker processes): "
                        "load the model on one device to use LoRAs")


def set_loras(engine, loras: Optional[Iterable]) -> List[str]:
    """``Engine.set_loras``: make exactly these LoRAs active. Returns the report (keys not applied).

    ``loras``: [(path or LoRAFile, strength), ...] (or "FILE:STRENGTH" strings); [] restores the base
    bit-exactly. Calling it again with the same list does nothing (cheap enough to call before every run)."""
    items = normalize(loras)
    if not items and not getattr(engine.model, "__dict__", {}).get("_sgld_lora"):
        engine.loras = []
        engine.lora_report = []
        return []
    check_engine(engine)
    files = [(p if isinstance(p, LoRAFile) else read_cached(engine, p), s) for p, s in items]
    st = lora_state(engine.model)
    want = tuple((id(lf), s) for lf, s in files)
    if st.applied is None or want != tuple((id(lf), s) for lf, s in st.applied):
        try:
            st.apply(files)
        except BaseException:
            # rolled back to the base (or, for a refused set, nothing changed): say what is active now
            engine.loras = [(lf.path, s) for lf, s in st.applied or ()]
            engine.lora_report = [m for lf, _ in st.applied or () for m in lf.report()]
            raise
        log.info("LoRA: %s in %.2f s (%d layers merged, %d side paths, %.1f MiB of original weights kept)",
                 ", ".join(f"{lf.name} x{s:g}" for lf, s in files) or "base restored", st.last_seconds,
                 len(st.backups), len(st.hooks), st.backup_bytes / 2 ** 20)
    report = [m for lf, _ in files for m in lf.report()]
    engine.loras = [(lf.path, s) for lf, s in files]
    engine.lora_report = report
    return report


def check_lora(engine, path: str) -> List[str]:
    """``Engine.check_lora`` (callers use the method: a ParallelEngine asks its workers). Read (and cache) a
    LoRA against the engine's model without applying it: raises LoRAError for a file that cannot be used,
    returns the report of keys that would not be applied."""
    check_engine(engine)
    return read_cached(engine, os.fspath(path)).report()


__all__ = ["LoRAError", "LoRAEntry", "LoRAFile", "LoRAState", "read_lora", "key_map", "target_modules", "set_loras",
           "check_lora", "parse_spec", "normalize", "lora_state"]
