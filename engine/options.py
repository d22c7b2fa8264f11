"""Each option declared once, as a dataclass field: its type, choices, range, default and help, and its
spellings elsewhere (CLI flag, ComfyUI widget, environment variable, server request field). The checks, the CLI's arguments,
a node's inputs and the environment reader derive from the declarations, so an option cannot be
forgotten in one of them; a refused value is named as its caller spelled it (the field, ``--cache-fn``,
``SGLANG_CACHE_DIT_FN`` or ``SGLDiffusion Cache-DiT field 'Fn'``). Imports nothing of the engine, so
every layer may use it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

TRUE_TEXT = ("1", "true", "yes", "on")
FALSE_TEXT = ("0", "false", "no", "off", "")
BOOL_TEXT = "one of true, false (also 1/0, yes/no, on/off)"


class _Unset:
    def __repr__(self):
        return "UNSET"


UNSET = _Unset()  # "the field's own" (None is a value, so it cannot mean that)


@dataclass(frozen=True)
class Option:
    """One option's declaration; the field's name is the option's name."""

    kind: type  # bool, int, float or str: what the field holds besides None
    help: str  # the CLI's help text
    choices: tuple = ()  # the values allowed (any value of ``kind`` in the range when empty)
    optional: bool = False  # None is a value: as stored, from the preset, not set
    low: Optional[float] = None  # numbers: the inclusive range
    high: Optional[float] = None
    low_open: bool = False  # numbers: ``low`` itself refused (shift: above 0)
    finite: bool = True  # floats: inf refused (NaN always is)
    allowed: str = ""  # what a refusal says is allowed, where the derived text says too little
    check: Optional[Callable[[Any], Any]] = None  # a further check of a string value (raises ValueError)
    aliases: Mapping = field(default_factory=dict)  # other spellings of a value: {"off": False, None: "none"}
    labels: Mapping = field(default_factory=dict)  # the text of values that are not strings: {None: "default"}
    any_case: bool = False  # strings are compared, and kept, in lower case
    flag: Optional[str] = None  # CLI: "--cache-fn"
    flag_aliases: Tuple[str, ...] = ()  # other spellings of the flag (SGLang's: "--sp" for --ulysses-degree)
    flag_default: Any = UNSET  # the flag's default when it is not the field's
    flag_const: Any = UNSET  # the value of the flag given without one ("--compile" = static)
    group: str = ""  # the CLI argument group it is listed in
    env: Optional[str] = None  # environment variable
    api: Optional[str] = None  # the server's request field (OpenAI's / SGLang's name: num_inference_steps)
    widget: Optional[str] = None  # ComfyUI node input name
    widget_default: Any = UNSET  # the widget's default when it is not the field's
    widget_min: Optional[float] = None
    widget_max: Optional[float] = None
    widget_step: Optional[float] = None
    widget_required: bool = False  # a required input (else optional)
    widget_extra: Mapping = field(default_factory=dict)  # more of the widget's spec: {"control_after_generate": True}
    tooltip: str = ""


def option(default, kind: type, help: str, **spec) -> Any:
    """A dataclass field declared as an option (``spec``: the fields of :class:`Option`)."""
    return field(default=default, metadata={"option": Option(kind, help, **spec)})


def declared(cls) -> Dict[str, Option]:
    """The declared options of a dataclass, in field order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(cls) if "option" in f.metadata}


def default_of(cls, name: str):
    """The field's default."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


class _Refused(Exception):
    """A value the declaration does not allow; the caller words the message for its spelling."""


def _lookup(mapping: Mapping, value):
    """``mapping[value]``, matching strings by lower-case text and other keys by identity (False is not 0)."""
    for key, target in mapping.items():
        if (key is value) or (isinstance(key, str) and isinstance(value, str) and key == value.strip().lower()):
            return True, target
    return False, None


def _spelled(opt: Option, value):
    """The value an alias or a label stands for."""
    found, target = _lookup(opt.aliases, value)
    if not found:
        found, target = _lookup({text.lower(): v for v, text in opt.labels.items()}, value)
    return found, target


def _value(opt: Option, value):
    """``value`` normalized (aliases, labels, case), or _Refused."""
    found, target = _spelled(opt, value)
    if found:
        return target
    if isinstance(value, str) and opt.any_case:
        value = value.lower()
    if value is None:
        if opt.optional:
            return None
        raise _Refused
    if opt.choices:
        if any(type(c) is type(value) and c == value for c in opt.choices):
            return value
        raise _Refused
    if opt.kind is bool:
        ok = isinstance(value, bool)
    elif opt.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif opt.kind is float:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
              and (math.isfinite(value) or not opt.finite))
    else:
        ok = isinstance(value, str)
    if not ok or (opt.low is not None and (value <= opt.low if opt.low_open else value < opt.low)) or (
            opt.high is not None and value > opt.high):
        raise _Refused
    if opt.check is not None:
        try:
            opt.check(value)
        except ValueError:
            raise _Refused from None
    return value


def _from_text(opt: Option, text: str):
    """A value typed as text (flag, variable, widget list) -> the option's value, or _Refused."""
    found, target = _spelled(opt, text)
    if found:
        return target
    t = text.strip()
    if opt.kind is bool and not opt.choices:
        if t.lower() in TRUE_TEXT:
            return True
        if t.lower() in FALSE_TEXT:
            return False
        raise _Refused
    if opt.kind in (int, float):
        try:
            return _value(opt, opt.kind(t))
        except ValueError:
            raise _Refused from None
    if any(isinstance(c, str) for c in opt.choices):
        t = t.lower()
    return _value(opt, t)


def text_choices(opt: Option) -> list:
    """The values as they are typed: the choices' texts (a switch's: on, off), then the text of None."""
    values = ([True, False] if opt.kind is bool and not opt.choices else list(opt.choices)) + (
        [None] if opt.optional else [])
    out = []
    for v in values:
        found, text = _lookup(opt.labels, v)
        if not found:
            text = ("on" if v else "off") if opt.kind is bool and isinstance(v, bool) else v
        if isinstance(text, (str, int)) and not isinstance(text, bool):  # compile's True has no text ("static")
            out.append(str(text))
    return out


def allowed(opt: Option, typed: bool) -> str:
    """What a refusal says is allowed: for a value ``typed`` as text, or a Python value (the field)."""
    if opt.allowed:
        return opt.allowed
    if opt.choices:
        if typed:
            return "one of " + ", ".join(text_choices(opt))
        values = ((None,) if opt.optional else ()) + tuple(opt.choices)
        plain = all(isinstance(c, str) for c in opt.choices)
        return "one of " + ", ".join(v if plain and isinstance(v, str) else repr(v) for v in values)
    if opt.kind is bool:
        return BOOL_TEXT if typed else "one of True, False"
    if opt.kind is str:
        return "a string"
    noun = "an integer" if opt.kind is int else "a finite number" if opt.finite else "a number"
    if opt.low is not None and opt.high is not None:
        return f"{noun} {'above' if opt.low_open else 'from'} {opt.low:g} to {opt.high:g}"
    if opt.low is not None:
        return f"{noun} {'>' if opt.low_open else '>='} {opt.low:g}"
    return f"{noun} <= {opt.high:g}" if opt.high is not None else noun


def _error(cls) -> type:
    """The error a class's options raise: its OPTION_ERROR (CacheConfigError), else ValueError."""
    return getattr(cls, "OPTION_ERROR", ValueError)


def field_label(cls, name: str) -> str:
    """How a message names a field: ``EngineConfig.offload`` (a class may say otherwise in OPTION_LABEL)."""
    return getattr(cls, "OPTION_LABEL", "{cls}.{name}").format(cls=cls.__name__, name=name)


# -- the field -------------------------------------------------------------------------------------------
def checked(obj) -> Dict[str, Any]:
    """The declared fields of a dataclass instance, normalized; an error naming the field on a bad value."""
    cls = type(obj)
    out = {}
    for name, opt in declared(cls).items():
        value = getattr(obj, name)
        try:
            out[name] = _value(opt, value)
        except _Refused:
            raise _error(cls)(f"{field_label(cls, name)} {value!r} is not supported; "
                              f"choose {allowed(opt, False)}") from None
    return out


def _typed(cls, opt: Option, value, where: str):
    """A value from a flag, a variable or a widget (text, or already a number / bool) -> the option's value."""
    try:
        return _from_text(opt, value) if isinstance(value, str) else _value(opt, value)
    except _Refused:
        raise _error(cls)(f"{where}={str(value)!r} is not supported; choose {allowed(opt, True)}") from None


# -- the command line -------------------------------------------------------------------------------------
def flag_dest(opt: Option) -> str:
    """The argparse attribute of the flag (argparse's own rule: --cache-fn -> cache_fn)."""
    return opt.flag.lstrip("-").replace("-", "_")


def add_arguments(parser, cls, titles: Optional[Mapping[str, str]] = None, names: Optional[Iterable[str]] = None) -> None:
    """An argparse argument for every declared flag of ``cls`` (``titles``: group -> argument group title;
    ``names``: only these options). Values are checked by ``from_args``, so the messages are the options' own."""
    groups = {}
    for name, opt in declared(cls).items():
        if not opt.flag or (names is not None and name not in names):
            continue
        target = parser
        if opt.group:
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group((titles or {}).get(opt.group, opt.group))
            target = groups[opt.group]
        default = default_of(cls, name) if opt.flag_default is UNSET else opt.flag_default
        kw = {"default": default, "help": opt.help}
        if opt.kind is bool and not opt.optional and default is False:
            target.add_argument(opt.flag, *opt.flag_aliases, action="store_true", **kw)
            continue
        if opt.flag_const is not UNSET:
            kw.update(nargs="?", const=opt.flag_const)
        if opt.kind in (int, float):
            kw["type"] = opt.kind
        if opt.choices or opt.kind is bool:
            kw["metavar"] = "{" + ",".join(text_choices(opt)) + "}"
        target.add_argument(opt.flag, *opt.flag_aliases, **kw)


def from_args(cls, args, names: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """The values of the declared flags that ``args`` holds (None = not given), checked; an error
    naming the flag on a bad value. ``names``: only these options."""
    out = {}
    for name, opt in declared(cls).items():
        wanted = opt.flag and (names is None or name in names)
        value = getattr(args, flag_dest(opt), None) if wanted else None
        if value is not None:
            out[name] = _typed(cls, opt, value, opt.flag)
    return out


# -- the environment --------------------------------------------------------------------------------------
def from_env(cls, env: Mapping[str, str], names: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """The values the declared variables set (blank = not set, but false for a switch), checked; an
    error naming the variable on a bad value. ``names``: only these options."""
    out = {}
    for name, opt in declared(cls).items():
        raw = env.get(opt.env) if opt.env and (names is None or name in names) else None
        if raw is None or (not raw.strip() and opt.kind is not bool):
            continue
        out[name] = _typed(cls, opt, raw, opt.env)
    return out


# -- ComfyUI node inputs ----------------------------------------------------------------------------------
def widget_default(cls, name: str):
    """The widget's default: declared, or the text of the field's default."""
    opt = declared(cls)[name]
    if opt.widget_default is not UNSET:
        return opt.widget_default
    value = default_of(cls, name)
    found, text = _lookup(opt.labels, value)
    return text if found else value


def _widget_spec(cls, name: str, opt: Option) -> tuple:
    default = widget_default(cls, name)
    spec = {"default": default}
    if opt.kind is bool and not opt.optional:
        kind = "BOOLEAN"
    elif (opt.kind is str and opt.choices) or opt.kind is bool:
        kind = [default] + [t for t in text_choices(opt) if t != default]
    elif opt.kind in (int, float):
        kind = "INT" if opt.kind is int else "FLOAT"
        low = opt.widget_min if opt.widget_min is not None else opt.low if opt.low is not None else (
            min(opt.choices) if opt.choices else None)
        high = opt.widget_max if opt.widget_max is not None else opt.high if opt.high is not None else (
            max(opt.choices) if opt.choices else None)
        spec.update({k: v for k, v in (("min", low), ("max", high), ("step", opt.widget_step)) if v is not None})
    else:
        kind = "STRING"
    spec.update(opt.widget_extra)
    if opt.tooltip:
        spec["tooltip"] = opt.tooltip
    return kind, spec


def node_inputs(cls) -> Dict[str, Dict[str, tuple]]:
    """INPUT_TYPES entries for the declared widgets: ``{"required": {...}, "optional": {...}}``, field order."""
    out = {"required": {}, "optional": {}}
    for name, opt in declared(cls).items():
        if opt.widget:
            out["required" if opt.widget_required else "optional"][opt.widget] = _widget_spec(cls, name, opt)
    return out


def widget_defaults(cls) -> Dict[str, Any]:
    """{widget: default}: what a node uses for an input a saved workflow does not have."""
    return {opt.widget: widget_default(cls, name) for name, opt in declared(cls).items() if opt.widget}


def from_widgets(cls, values: Mapping[str, Any], node: str) -> Dict[str, Any]:
    """Node input values -> {field: value} (None = not set), checked; an error naming ``node`` and the
    field on a bad value or an input that is no declared widget."""
    by_widget = {opt.widget: (name, opt) for name, opt in declared(cls).items() if opt.widget}
    out = {}
    for widget, value in values.items():
        if widget not in by_widget:
            raise _error(cls)(f"{node}: unknown input {widget!r}; allowed: {', '.join(by_widget)}")
        name, opt = by_widget[widget]
        if value is not None:
            out[name] = _typed(cls, opt, value, f"{node} field '{widget}'")
    return out
