"""How a feature attaches to a model: one registry on the model and three primitives.

Every feature (fused projections, quantization, layer-wise offload, LoRA, compile, the attention
backend, Cache-DiT, tensor parallel) changes a model from outside, only through this module, and
is recorded in the model's registry, so it can be removed exactly and anyone can ask what is
attached (``attached(model)``, ``Engine.describe()``). A feature module offers an
``apply_x(model, ...)`` / ``remove_x(model)`` pair; ``apply_x`` registers a ``Patch``.

The primitives:

- ``swap_class(module, feature, make)``: the module's class becomes ``make(base)`` (a subclass,
  made once per base class). Swaps of several features stack; ``restore_class`` takes one off.
  A class swap and not a forward hook: torch.compile guards on a module's class but not on hooks
  added after compiling (docs/architecture.md).
- ``replace_module(model, name, new)``: a child replaced (quantized linears); ``set_children`` for a
  module whose children change in number (fused projections: q, k, v become one qkv).
- ``set_slot(model, slot, value)``: one of the model's two documented slots, ``block_runner``
  (what runs the block loop: Cache-DiT) and ``attention`` (the attention function); the value
  before is kept by the caller's patch and given back by ``set_slot`` again.

What a swapped class needs at call time for one module (a block's offload index, a linear's LoRA
terms) lives in ``state(module)[feature]``, the one per-module record. A patch refers to its model
weakly: the model holds the registry, so a strong reference would keep both alive until a gc.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from torch import nn

REGISTRY = "patches"  # the model's attribute (in __dict__: not a submodule, not in state_dict)
STATE = "patch_state"  # a patched module's per-feature record
SLOTS = ("block_runner", "attention")


class Patch:
    """One feature attached to one model. Subclasses keep what they changed and undo it in ``remove``."""

    name = "patch"

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)

    @property
    def model(self) -> Optional[nn.Module]:
        return self._model()

    def remove(self) -> None:
        """Undo everything this feature changed on the model."""

    def describe(self) -> dict:
        """What the feature does on this model, as plain data (for ``Engine.describe``)."""
        return {}


class Patches:
    """The registry of one model: feature name -> its Patch, in the order they were attached."""

    def __init__(self):
        self._items: Dict[str, Patch] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[Patch]:
        return iter(list(self._items.values()))

    def get(self, name: str) -> Optional[Patch]:
        return self._items.get(name)

    def add(self, patch: Patch) -> Patch:
        if patch.name in self._items:
            raise ValueError(f"feature '{patch.name}' is already attached to this model; remove it first")
        self._items[patch.name] = patch
        return patch

    def pop(self, name: str) -> Optional[Patch]:
        return self._items.pop(name, None)


def patches(model: nn.Module) -> Patches:
    """The model's registry (made on first use)."""
    reg = model.__dict__.get(REGISTRY)
    if reg is None:
        reg = model.__dict__[REGISTRY] = Patches()
    return reg


def attach(model: nn.Module, patch: Patch) -> Patch:
    return patches(model).add(patch)


def get(model: nn.Module, name: str) -> Optional[Patch]:
    reg = model.__dict__.get(REGISTRY)
    return None if reg is None else reg.get(name)


def detach(model: nn.Module, name: str) -> bool:
    """Remove feature ``name`` from the model (its ``remove``, then out of the registry). False if absent."""
    patch = get(model, name)
    if patch is None:
        return False
    patch.remove()
    patches(model).pop(name)
    return True


def attached(model: nn.Module) -> List[str]:
    reg = model.__dict__.get(REGISTRY)
    return [] if reg is None else [p.name for p in reg]


# -- per-module state ------------------------------------------------------------------------------------------
def state(module: nn.Module) -> dict:
    """``module``'s per-feature record (what its swapped class reads at call time)."""
    st = module.__dict__.get(STATE)
    if st is None:
        st = module.__dict__[STATE] = {}
    return st


def feature_state(module: nn.Module, feature: str):
    """``state(module)[feature]``, or None when the module has none (reads only: nothing is created)."""
    return (module.__dict__.get(STATE) or {}).get(feature)


def clear_state(module: nn.Module, feature: str) -> None:
    st = module.__dict__.get(STATE)
    if st is not None:
        st.pop(feature, None)
        if not st:
            del module.__dict__[STATE]


# -- class swaps ----------------------------------------------------------------------------------------------
_SUBCLASSES: Dict[Tuple[type, Callable], type] = {}


def _subclass(base: type, make: Callable[[type], type]) -> type:
    cls = _SUBCLASSES.get((base, make))
    if cls is None:
        cls = _SUBCLASSES[(base, make)] = make(base)
    return cls


def swap_class(module: nn.Module, feature: str, make: Callable[[type], type]) -> None:
    """Give ``module`` the subclass ``make(current class)`` for ``feature`` (idempotent per feature).
    ``make`` must be a module-level function: its subclass is made once per base class."""
    layers = state(module).setdefault("classes", [])
    if any(f == feature for f, _ in layers):
        return
    if not layers:
        state(module)["base_class"] = type(module)
    module.__class__ = _subclass(type(module), make)
    layers.append((feature, make))


def restore_class(module: nn.Module, feature: str) -> None:
    """Take ``feature``'s subclass off ``module`` (other features' swaps stay)."""
    st = module.__dict__.get(STATE) or {}
    layers = st.get("classes") or []
    if not any(f == feature for f, _ in layers):
        return
    rest = [(f, make) for f, make in layers if f != feature]
    cls = st["base_class"]
    for _, make in rest:
        cls = _subclass(cls, make)
    module.__class__ = cls
    if rest:
        st["classes"] = rest
    else:
        st.pop("classes", None)
        st.pop("base_class", None)
        if not st:
            del module.__dict__[STATE]


def base_class(module: nn.Module) -> type:
    """The module's class before any feature swapped it."""
    return (module.__dict__.get(STATE) or {}).get("base_class", type(module))


# -- module replacement and slots --------------------------------------------------------------------------------
def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``name`` (a dotted child path); returns the module it replaces."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = parent._modules[child]
    parent._modules[child] = new
    return old


def set_children(module: nn.Module, children: Dict[str, nn.Module]) -> Dict[str, nn.Module]:
    """Give ``module`` exactly these children, in this order (fused projections: three parts become one
    child in the first part's place); returns the children before, for the caller's patch to restore."""
    old = dict(module._modules)
    module._modules.clear()
    module._modules.update(children)
    return old


def set_slot(model: nn.Module, slot: str, value) -> object:
    """Set one of the model's slots (``SLOTS``); returns the value before, for the caller to restore."""
    if slot not in SLOTS:
        raise ValueError(f"'{slot}' is not a model slot; the slots are {', '.join(SLOTS)}")
    old = getattr(model, slot)
    setattr(model, slot, value)
    return old
