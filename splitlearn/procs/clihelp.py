"""The command lines of splitlearn: every ``--help`` shows each option's default (issue 41),
and the options of the server and the client are generated from their configuration
dataclasses (issue 43), the server's and the client's alike (this module is below both
layers): each option is written once, as a field with its default and its ``help``
(:func:`opt`); :func:`add_options` makes the argparse options of a dataclass's fields,
:func:`options_of` reads them back as the field values.

A field's option is ``--<name>`` (underscores as dashes, a ``_s`` unit suffix dropped:
``round_timeout_s`` is ``--round-timeout``) unless ``flag`` names another; its type is the
field's (``Optional[X]`` is X; a bool is a switch: ``--name`` sets True, or ``flag="--no-..."``
on a True default sets False; ``tuple[X, ...]`` is repeated: ``--cut 1 --cut 3``, or one
option of several values with ``nargs="+"``: ``--expected-cuts 2 10``). ``unit``
scales what the command line says to the field's unit (``--max-body-mb 256`` is
``256 << 20`` bytes); an option not given is the field's default; ``parse`` turns the
option's text into the field's value after parsing (reading a file: its errors are the
config's, not argparse's). ``cli=False`` keeps a field off the command line. The help
shows each default (in the option's unit).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Optional


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's help, each option's line ending in ``(default: X)`` where it has a default
    worth showing (not None, False or an empty tuple) and its help does not already name one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text.lower() or default is argparse.SUPPRESS
                or default is None or default is False or default == ()):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def with_default(text: str, default) -> str:
    """``text`` with ``(default: default)`` appended, for an option whose argparse default is
    not the value (``argparse.SUPPRESS``: the value is a dataclass field's default)."""
    if default is None or default is False or default == () or "default" in text.lower():
        return text
    shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
    return f"{text} (default: {str(shown).replace('%', '%%')})"


HELP, FLAG, UNIT, PARSE, TYPE, CHOICES, METAVAR, GROUP, CLI, NARGS = (
    "help", "flag", "unit", "parse", "type", "choices", "metavar", "group", "cli", "nargs")


def opt(default: Any = dataclasses.MISSING, help: str = "", *, flag: Optional[str] = None, unit: float = 1,
        parse: Optional[Callable[[str], Any]] = None, type: Optional[Callable[[str], Any]] = None,
        choices: Optional[tuple] = None, metavar: Optional[str] = None, group: Optional[str] = None,
        cli: bool = True, repr: bool = True, nargs: Optional[str] = None):
    """A dataclass field with its command-line option (see the module docstring). ``type``:
    argparse's conversion when the field's own type is not it; ``group``: options of one
    mutually exclusive, required group (exactly one is given)."""
    meta = {HELP: help, FLAG: flag, UNIT: unit, PARSE: parse, TYPE: type, CHOICES: choices,
            METAVAR: metavar, GROUP: group, CLI: cli, NARGS: nargs}
    if isinstance(default, (list, dict, set)):
        raise TypeError("give a tuple (or None) as an option's default")
    return dataclasses.field(default=default, metadata=meta, repr=repr)


def flag_of(f: dataclasses.Field, flags: Optional[dict] = None) -> str:
    """The option of field ``f``: ``flags[f.name]`` where given (one command's name for it)."""
    if flags and f.name in flags:
        return flags[f.name]
    name = f.name[:-2] if f.name.endswith("_s") else f.name
    return f.metadata.get(FLAG) or "--" + name.replace("_", "-")


def _base_type(hint) -> tuple[Any, bool]:
    """(X, repeated) of a field's type: X of ``Optional[X]`` or ``tuple[X, ...]``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return _base_type(inner[0]) if len(inner) == 1 else (str, False)
    if origin is tuple:
        return args[0], True
    return hint, False


def options(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are command-line options."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get(CLI, False)]


def add_options(parser: argparse.ArgumentParser, cls, title: Optional[str] = None, *,
                only: Optional[tuple] = None, skip: tuple = (), flags: Optional[dict] = None) -> None:
    """The options of ``cls``'s fields, in a group titled ``title`` (default: its docstring's
    first line) of ``parser``'s help: those named in ``only`` (default: all), less those in
    ``skip``; ``flags``: field name -> the option's name in this command, where it differs."""
    hints = typing.get_type_hints(cls)
    doc = (cls.__doc__ or "").strip().splitlines()
    group = parser.add_argument_group(title or cls.__name__, doc[0] if doc and title is None else None)
    exclusive: dict[str, Any] = {}
    for f in options(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        m = f.metadata
        where = group
        if m[GROUP]:
            if m[GROUP] not in exclusive:
                exclusive[m[GROUP]] = group.add_mutually_exclusive_group(required=True)
            where = exclusive[m[GROUP]]
        base, repeated = _base_type(hints[f.name])
        shown = f.default if base is not bool and f.default is not dataclasses.MISSING else None
        if isinstance(shown, (int, float)) and not isinstance(shown, bool) and m[UNIT] != 1:
            shown = f"{shown / m[UNIT]:g}"  # in the option's unit (--max-body-mb 256, not bytes)
        kw: dict[str, Any] = {"dest": f.name, "help": with_default(m[HELP], shown),
                              "default": argparse.SUPPRESS}  # not given: absent
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and not m[GROUP]:
            kw["required"] = True  # a field without a default
        if base is bool and m[PARSE] is None:
            kw["action"] = "store_false" if f.default is True else "store_true"
        else:
            if m[PARSE] is not None:
                kw["type"] = str
            else:
                kw["type"] = m[TYPE] or (float if m[UNIT] != 1 else base)
            if m[NARGS] is not None:
                kw["nargs"] = m[NARGS]
            elif repeated and m[PARSE] is None:
                kw["action"] = "append"
            if m[CHOICES] is not None:
                kw["choices"] = list(m[CHOICES])
            else:  # named after the option, not the field (--max-body-mb MAX_BODY_MB)
                kw["metavar"] = m[METAVAR] or flag_of(f, flags)[2:].replace("-", "_").upper()
        where.add_argument(flag_of(f, flags), **kw)


def options_of(cls, ns: argparse.Namespace) -> dict:
    """The field values of ``cls`` that the parsed options ``ns`` give (what was not given on
    the command line is left out: the field's default)."""
    out = {}
    for f in options(cls):
        if not hasattr(ns, f.name):  # not given
            continue
        v, m = getattr(ns, f.name), f.metadata
        if m[PARSE] is not None:
            v = m[PARSE](v)
        elif isinstance(v, list):
            v = tuple(v)
        elif m[UNIT] != 1:
            v = int(v * m[UNIT])
        out[f.name] = v
    return out
