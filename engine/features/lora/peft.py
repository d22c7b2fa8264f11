"""PEFT configs of a LoRA file: ``lora_alpha``, ``alpha_pattern`` and ``use_rslora``, from diffusers' file
metadata or an ``adapter_config.json`` beside the file. Bounded and never evaluated as code: an
``alpha_pattern`` key is a plain module-name pattern, matched one character at a time (docs/lora.md).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ...errors import LoRAError

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
ALLOWED_PATTERN = ("letters, digits, '_', '-', '.' and '\\.' (a module name as the LoRA's keys give it, or its "
                   "last dotted parts); regular expressions from a file are not evaluated")


def finite_number(value, where: str) -> float:
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


def alpha_patterns(raw, where: str) -> List[AlphaPattern]:
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
        out.append(AlphaPattern(key, finite_number(alpha, f"{where} 'alpha_pattern' value of {key!r}"), chars))
    return out


def peft_config(path: str, metadata: Dict[str, str]) -> Optional[dict]:
    """The PEFT LoraConfig of a file: diffusers' ``lora_adapter_metadata`` (keys ``transformer.lora_alpha``
    ...) or ``adapter_config.json`` beside the file. None when there is none. Checked here: ``lora_alpha``
    is a finite number, ``alpha_pattern`` (replaced by a list of AlphaPattern) holds plain patterns only."""
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
    cfg = dict(cfg, lora_alpha=finite_number(cfg["lora_alpha"], f"{where} 'lora_alpha'"),
               alpha_pattern=alpha_patterns(cfg.get("alpha_pattern"), where))
    return cfg


def peft_alpha(cfg: dict, module: str) -> float:
    """PEFT: the first ``alpha_pattern`` entry matching the end of the module name, else ``lora_alpha``."""
    for pat in cfg["alpha_pattern"]:
        if pat.matches(module):
            return pat.alpha
    return cfg["lora_alpha"]

