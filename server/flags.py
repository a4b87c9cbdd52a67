"""Command-line flags generated from the config dataclasses (EngineConfig, SpecConfig, ServerConfig): each field
becomes `--field-name` with its type, choices and help taken from the field and its metadata, and no argparse
default of its own, so the dataclass default is the only one (--help prints it).

Field metadata keys: "help" (required for a flag), "flag" (another flag name), "aliases", "choices",
"kind": "bytes" (accepts 512M, 4G...), "positional": True, "cli": False (no flag)."""
from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Any


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 536870912, 512M or 1G, got {text!r}")
    unit = m.group(2).lower()
    scale = 1024 ** ("kmgt".find(unit) + 1) if unit else 1
    return int(float(m.group(1)) * scale)


def _base_type(hint: Any) -> Any:
    """int | None -> int; the one non-None member of an optional."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType")) \
        else hint


def cli_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and "help" in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "" if f.default is None else f" (default: {f.default})"
    return ""


def add_flags(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = (),
              defaults: dict[str, Any] | None = None) -> None:
    """One flag per CLI field of `cls`. `defaults`: a command's own defaults for some fields (shown in --help)."""
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for f in cli_fields(cls):
        if f.name in skip:
            continue
        meta, kind = f.metadata, _base_type(hints[f.name])
        helptext = meta["help"] + (f" (default: {defaults[f.name]})" if f.name in defaults else _default_text(f))
        kwargs: dict[str, Any] = {"help": helptext.replace("%", "%%"), "default": argparse.SUPPRESS}
        if "choices" in meta:
            kwargs["choices"] = list(meta["choices"])
        if meta.get("positional"):
            parser.add_argument(f.name, nargs="?", **kwargs)
            continue
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) in (list, tuple):  # tuple[int, ...]: --flag 1 2 3
            kwargs.update(nargs="+", type=typing.get_args(kind)[0], metavar=f.name.upper())
        else:
            kwargs["type"] = parse_bytes if meta.get("kind") == "bytes" else kind
            if "choices" not in kwargs:
                kwargs["metavar"] = f.name.upper()
        parser.add_argument(flag_name(f), *meta.get("aliases", ()), dest=f.name, **kwargs)


def build(cls, args: argparse.Namespace, defaults: dict[str, Any] | None = None, **values: Any):
    """An instance of `cls` from the flags given (then `defaults`, then the dataclass's own defaults)."""
    given = {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}
    return cls(**{**(defaults or {}), **given, **values})
