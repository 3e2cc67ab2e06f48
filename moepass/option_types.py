"""What an option is, and how a part of moepass declares the ones it reads: a frozen dataclass of typed fields.

A section is a frozen dataclass whose fields are the options under one prefix: `lowp.exclude` is the field `exclude`
of options.Lowp, `mxfp8.kernel` the field `kernel` of the MXFP8 recipe's Options. A field's type lists its values
(a Literal of choices, bool, None; a check says what any other type takes) and `option(...)` gives its default and
one-line help. Users pass one flat dict; options.py validates it against every section and `read` gives a section
back typed. Kept apart from options.py so that a recipe declares its options without importing the table of all.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

try:  # Dynamo wraps backend errors in BackendCompilerFailed unless they are ShortenTraceback.
    from torch._dynamo.exc import ShortenTraceback as _PassThrough
except ImportError:  # pragma: no cover - older torch: the ValueError arrives wrapped
    _PassThrough = Exception


class OptionsError(ValueError, _PassThrough):
    """A bad `options` key or value. Reaches the caller of torch.compile as a ValueError."""

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.first_useful_frame = None  # read by Dynamo's ShortenTraceback handling


@dataclasses.dataclass(frozen=True)
class Option:
    key: str
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    expects: str = ""
    aliases: tuple[str, ...] = ()  # old keys that mean this one (accepted with a DeprecationWarning)


def option(default: Any, help: str, *, check: Callable[[Any], bool] | None = None, expects: str = "",
           aliases: tuple[str, ...] = ()) -> Any:
    """A section's field: its default and one-line help; `check` and `expects` for values its type cannot list."""
    meta = {"help": help, "check": check, "expects": expects, "aliases": aliases}
    if isinstance(default, (dict, list)):  # a dataclass default must not be shared and mutable
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def section_options(section: type, prefix: str = "") -> tuple[Option, ...]:
    """The Options a section declares, keyed `<prefix>.<field>` (the field's name alone without a prefix)."""
    hints = typing.get_type_hints(section)
    found = []
    for f in dataclasses.fields(section):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        found.append(Option(key(prefix, f.name), default, f.metadata["help"], choices=choices_of(hints[f.name]),
                            check=f.metadata["check"], expects=f.metadata["expects"], aliases=f.metadata["aliases"]))
    return tuple(found)


def choices_of(tp: Any) -> tuple | None:
    """The values a type lists: a Literal's arguments, bool's True and False, None, and unions of those; None for
    any other type."""
    if tp is bool:
        return (True, False)
    if tp is type(None):
        return (None,)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return typing.get_args(tp)
    if origin in (Union, types.UnionType):
        parts = [choices_of(a) for a in typing.get_args(tp)]
        return None if any(p is None for p in parts) else tuple(c for p in parts for c in p)
    return None


def read(section: type, values: Mapping[str, Any], prefix: str = ""):
    """A section's frozen instance from validated values (a Config, or any mapping holding its keys)."""
    return section(**{f.name: values[key(prefix, f.name)] for f in dataclasses.fields(section)})
