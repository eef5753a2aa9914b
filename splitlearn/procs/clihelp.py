"""The ``--help`` of splitlearn's command lines: every option with its default (issue 41)."""
from __future__ import annotations

import argparse


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
