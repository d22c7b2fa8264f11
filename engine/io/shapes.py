"""A config.json against the weights it comes with, before anything is allocated: the model is built on the meta
device (shapes, no memory) and its parameters compared with the safetensors headers. A config that describes
tensors larger, or more, than the files hold is refused naming the config file and the field, so a hostile
or mistaken config (vocab 2e6, hidden 20000, a million layers) costs what its header costs, not gigabytes."""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

from ..errors import CheckpointError


def config_fields(config: dict, value: int, prefix: str = "") -> List[str]:
    """The config's integer fields (nested ones dotted) whose value is ``value``: the field a shape came from."""
    found = []
    for key, v in config.items():
        if isinstance(v, dict):
            found += config_fields(v, value, f"{prefix}{key}.")
        elif type(v) is int and v == value:
            found.append(f"{prefix}{key}")
    return found


def check_layer_counts(config: dict, tensors: int, config_path: str, prefix: str = "") -> None:
    """Every ``*layers`` count of the config at most the tensors the files hold (a layer has at least one):
    checked before a meta build, whose cost is one Python module per layer."""
    for key, v in config.items():
        if isinstance(v, dict):
            check_layer_counts(v, tensors, config_path, f"{prefix}{key}.")
        elif key.endswith("layers") and type(v) is int and v > tensors:
            raise CheckpointError(f"{config_path}: field '{prefix}{key}' is {v}, but the weights hold only {tensors} "
                                  "tensors (a layer has at least one); this config does not describe these weights")


def check_shapes(expected: Dict[str, Tuple[int, ...]], files: Iterable, config: dict, config_path: str) -> None:
    """``expected``: the parameters (name -> shape) of the model built from ``config`` on the meta device;
    ``files``: the opened weight files (``keys()``, ``shape(key)``, ``path``). A tensor of the same name with
    another shape is refused naming the config field that made it; so is a config whose parameters add up to
    more values than the files hold (whatever their names), which would be allocated and left random."""
    held: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for f in files:
        for key in f.keys():
            held[key] = (tuple(f.shape(key)), f.path)
    for name, shape in expected.items():
        if name not in held or held[name][0] == tuple(shape):
            continue
        have, path = held[name]
        raise CheckpointError(f"{config_path}: {_blame(config, tuple(shape), have)}makes '{name}' {list(shape)}, but "
                              f"{path} holds it as {list(have)}; this config does not describe these weights")
    wanted, stored = sum(_count(s) for s in expected.values()), sum(_count(s) for s, _ in held.values())
    if wanted > stored:
        absent = next((name for name in expected if name not in held), None)
        example = f" ('{absent}' is not among them)" if absent is not None else ""
        raise CheckpointError(f"{config_path}: its sizes ({_sizes(config)}) describe {wanted:,} parameter values, but "
                              f"the weights ({', '.join(sorted({p for _, p in held.values()}))}) hold {stored:,}"
                              f"{example}; this config does not describe these weights")


def _blame(config: dict, wanted: Tuple[int, ...], have: Tuple[int, ...]) -> str:
    if len(wanted) == len(have):
        for w, h in zip(wanted, have):
            fields = config_fields(config, w) if w != h else []
            if fields:
                return f"field {' / '.join(repr(f) for f in fields)} = {w} "
    return ""


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _sizes(config: dict) -> str:
    named = [f"{k} {v}" for k, v in config.items() if type(v) is int and k.endswith(("size", "layers", "heads", "dim"))]
    return ", ".join(named) or "no sizes"
