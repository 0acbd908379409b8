"""Options declared once: a dataclass field carries its flag names, help, group and parser, and the argparse
arguments and the namespace -> dataclass step are generated from those fields (vLLM's ``EngineArgs`` /
``get_kwargs`` pattern).

Contract: ``option(default, *flags, help=..., group=..., type=..., ...)`` is a ``dataclasses.field`` whose
metadata holds the flag spelling(s) (the first long flag names the option; aliases follow), the help text and
the ``--help`` group; ``type``, ``choices``, ``metavar``, ``nargs`` and ``action`` pass through to argparse. Left
out, the parser follows the annotation: ``bool`` -> ``store_true`` (``negatable=True``: ``--flag/--no-flag``),
``list[X]`` -> ``nargs="+"`` of X, ``X | None`` -> X. ``add_arguments(parser, *classes)`` adds every option of
the classes, in field order, to argument groups made in ``GROUPS`` order; each argument's ``dest`` is the field
name and its default the field's default. ``values_from(cls, ns)`` -> the keyword arguments of ``cls`` found in
``ns``. ``option_flags(cls)`` -> {field: flags}. ``human_int`` / ``fraction`` are the value parsers vLLM's
flags take. Standard library only: this module sits below the configuration.
"""
from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, Field, field, fields
from typing import Any

# --help groups, in the order they are printed.
GROUPS = ("model", "KV cache", "scheduler", "parallelism (one GPU)", "OpenAI server", "runtime")

_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def human_int(text: str) -> int:
    """An integer, optionally with a size suffix as vLLM accepts: 65536, 64k, 64K (1024), 1g, 1Gi, 2.5G."""
    t = text.strip().replace("_", "")
    try:
        return int(t)
    except ValueError:
        pass
    low = t.lower().rstrip("b")
    for suf in sorted(_SUFFIX, key=len, reverse=True):
        if low.endswith(suf):
            num = low[: -len(suf)]
            # vLLM: lower-case k/m/g are decimal, upper-case K/M/G are binary.
            mult = _SUFFIX[suf]
            if len(suf) == 1 and t.rstrip("bB")[-1].isupper():
                mult = _SUFFIX[suf + "i"]
            try:
                return int(float(num) * mult)
            except ValueError:
                break
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer (a suffix k, m, g is allowed)")


def fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def option(default: Any, *flags: str, help: str | None = None, group: str, negatable: bool = False,
           **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a command-line option (see the module docstring)."""
    if group not in GROUPS:
        raise ValueError(f"unknown option group {group!r}; add it to GROUPS")
    meta = {"flags": flags, "help": help, "group": group, "negatable": negatable, "argparse": argparse_kwargs}
    return field(default=default, metadata={"option": meta})


def _options(cls: type) -> list[tuple[Field, dict[str, Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata["option"], hints[f.name]) for f in fields(cls) if "option" in f.metadata]


def _unwrap(hint: Any) -> Any:
    """``X | None`` -> X."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def argparse_kwargs(f: Field, meta: dict[str, Any], hint: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"dest": f.name, "default": f.default if f.default is not MISSING else None,
                          "help": meta["help"], **meta["argparse"]}
    base = _unwrap(hint)
    if base is bool and "action" not in kw:
        kw["action"] = argparse.BooleanOptionalAction if meta["negatable"] else "store_true"
    elif typing.get_origin(base) is list:
        kw.setdefault("nargs", "+")
        kw.setdefault("type", typing.get_args(base)[0])
    elif base in (int, float) and "type" not in kw:
        kw["type"] = base
    if kw.get("type") is str:
        del kw["type"]
    return kw


def add_arguments(parser: argparse.ArgumentParser, *classes: type) -> argparse.ArgumentParser:
    groups: dict[str, Any] = {}
    specs = [spec for cls in classes for spec in _options(cls)]
    for name in GROUPS:
        for f, meta, hint in specs:
            if meta["group"] != name:
                continue
            if name not in groups:
                groups[name] = parser.add_argument_group(name)
            groups[name].add_argument(*meta["flags"], **argparse_kwargs(f, meta, hint))
    return parser


def values_from(cls: type, ns: Any) -> dict[str, Any]:
    """The options of ``cls`` that ``ns`` carries, as keyword arguments of ``cls``."""
    return {f.name: getattr(ns, f.name) for f, _, _ in _options(cls) if hasattr(ns, f.name)}


def option_flags(cls: type) -> dict[str, tuple[str, ...]]:
    return {f.name: meta["flags"] for f, meta, _ in _options(cls)}
