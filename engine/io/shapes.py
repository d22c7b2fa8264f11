"""A config.json against the weights it comes with, before anything is allocated: the config's layer/block
counts against the weights' tensor count (``check_counts``), then the model built on the meta device (``on_meta``:
shapes, no memory) compared with the safetensors headers (``check_sizes``). A config that describes tensors larger,
or more, than the files hold is a CheckpointError naming the file, the key and the config field, so a hostile or
mistaken config (vocab 2e6, hidden 20000, a million layers) costs what its header costs, not gigabytes."""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

from ..errors import CheckpointError

# Config fields that multiply the modules a build makes (besides every ``*layers``); each at most the weights'
# tensor count (every layer and block has tensors), checked before even the meta build, whose cost is one Python
# module per layer.
COUNT_FIELDS = ("layers_per_block", "block_out_channels", "down_block_types", "up_block_types")
SPARE_VALUES = 16 << 20  # buffers a config makes beyond the file's tensors (rotary tables): at most this or the file's size


def _flat(config: dict, prefix: str = "") -> dict:
    """A config as {"field": value, "text_config.field": value, ...}."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + str(k)] = v
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fields_giving(config: dict, sizes) -> str:
    """The config fields whose value (or a list item) is one of ``sizes``: the fields a shape came from."""
    hits = [f"'{k}' = {_short(v)}" for k, v in _flat(config).items() if type(v) is int and v in sizes
            or isinstance(v, list) and any(type(i) is int and i in sizes for i in v)]
    return f" (field {', '.join(hits[:4])})" if hits else ""


def _sizes(config: dict) -> str:
    named = [f"{k} {_short(v)}" for k, v in _flat(config).items()
             if k.endswith(("size", "layers", "heads", "dim", "channels", "per_block")) and (type(v) is int or
                                                                                          isinstance(v, list))]
    return ", ".join(named[:8]) or "no sizes"


def check_counts(config: dict, tensors: int, where: str) -> None:
    """Every layer/block count of ``config`` (``*layers``, ``COUNT_FIELDS``; a list counts its items) at most
    ``tensors``, the weights' tensor count: a layer or block has at least one. A ``max_*layers`` field is a bound on
    a layer's index (Qwen3's ``max_window_layers``: the layers with a sliding window), not layers built."""
    for key, value in _flat(config).items():
        field = key.rpartition(".")[2]
        if (field.endswith("layers") and not field.startswith("max_")) or field in COUNT_FIELDS:
            count = len(value) if isinstance(value, list) else value
            if type(count) is int and count > tensors:
                raise CheckpointError(f"{where}: field '{key}' = {_short(value)} asks for more layers or blocks than "
                                      f"the weights hold tensors ({tensors}); this config does not describe these "
                                      "weights")


def on_meta(build):
    """The module ``build()`` makes, on the meta device: its parameters have shapes but no memory."""
    with torch.device("meta"):
        return build()


def read_header(files: Iterable) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(key -> a meta tensor of its stored dtype and shape, key -> its file) of opened weight files (``path``,
    ``keys()``, ``shape(key)``, ``dtype(key)``): the header only, no data read."""
    have, origin = {}, {}
    for f in files:
        for k in f.keys():
            have[k], origin[k] = torch.empty(f.shape(k), dtype=f.dtype(k), device="meta"), f.path
    return have, origin


def check_sizes(module: torch.nn.Module, have: dict, where: str, what: str, config: Optional[dict] = None,
                config_path: str = "", strict: bool = True, rename=lambda key: key,
                origin: Optional[Dict[str, str]] = None, weights: str = "") -> None:
    """``module`` (built on the meta device from ``config``) against the weights' header ``have`` (key -> tensor;
    ``rename``: the module's names as ``have`` gives them; ``origin``: key -> file, else ``weights``) before
    anything is allocated: every parameter and persistent buffer present (tied weights: one of their names is
    enough) in its shape, and with ``strict`` no other key (a folder may hold extra ones); the largest mismatched
    key is named, with the config fields that made it. The values the config makes beyond the file's tensors
    (buffers such as rotary tables) are bounded by ``SPARE_VALUES`` or the file's size."""
    want = {rename(k): v for k, v in module.state_dict(keep_vars=True).items()}
    have = {**{k: v for k, v in want.items() if k.endswith("num_batches_tracked")}, **have}  # a counter, not a weight
    found = {id(v) for k, v in want.items() if k in have}  # tied weights: one of their names in the file is enough
    missing = [k for k, v in want.items() if k not in have and id(v) not in found]
    extra = [k for k in have if k not in want] if strict else []
    bad = max((k for k in want if k in have and tuple(have[k].shape) != tuple(want[k].shape)), default=None,
              key=lambda k: want[k].numel())  # the largest: the one the config's sizes show best
    config_file = f" {config_path}" if config_path else ""
    stored = sum(t.numel() for t in have.values())
    files = ", ".join(sorted(set((origin or {}).values()))) or weights

    def file_of(key: str) -> str:
        return (origin or {}).get(key, weights)

    if missing or extra or bad:
        counts = f"not a {what} of this layout/config ({len(missing)} missing, {len(extra)} unknown of {len(want)} keys)"
        if bad:
            shape = list(want[bad].shape)
            fields = _fields_giving(config or {}, set(shape) - set(have[bad].shape))
            raise CheckpointError(f"{where}: key '{bad}' is {list(have[bad].shape)} in {file_of(bad)}, but the "
                                  f"config{config_file} makes it {shape}{fields}: {counts}")
        if missing:
            wanted = sum({id(t): t.numel() for t in want.values()}.values())
            raise CheckpointError(f"{where}: key '{missing[0]}' is not in the weights ({files}): the config"
                                  f"{config_file}'s sizes ({_sizes(config or {})}) describe {wanted:,} values, the "
                                  f"weights hold {stored:,}: {counts}")
        raise CheckpointError(f"{where}: key '{extra[0]}' of {file_of(extra[0])} is not part of the model the config"
                              f"{config_file} describes: {counts}")
    unique = {id(t): t for t in (*module.parameters(), *module.buffers())}
    spare = sum(t.numel() for i, t in unique.items() if i not in found)
    if spare > max(SPARE_VALUES, stored):
        raise CheckpointError(f"{where}: the config{config_file}'s sizes ({_sizes(config or {})}) make buffers of "
                              f"{spare:,} values besides the weights' {stored:,}: more than the weights are worth")
