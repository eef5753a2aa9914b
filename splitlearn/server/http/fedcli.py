"""The fed server's command line (``python -m splitlearn.server.http.fedapp``), generated from
:class:`FedConfig`, the segment server's LoRA options and :class:`FedServe`. It imports no torch
(as ``python -m splitlearn.server``'s, :mod:`.cli`): :mod:`.fedapp` parses its options with it
before it imports the app, so ``--help`` and a bad option are answered at once (~8 s sooner on
2 cores).
"""
from __future__ import annotations

import argparse
import sys

from ...errors import SplitLearnError
from ..config import LoraOptions
from ..federation.fedoptions import FedConfig, FedServe
from ..options import add_options, options_of


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m splitlearn.server.http.fedapp", allow_abbrev=False,
                                description="a fed server: averages client-side weights apart from the segment server")
    for group in (FedConfig, LoraOptions, FedServe):
        add_options(p, group)
    return p


def parse_args(argv=None) -> tuple[FedServe, FedConfig]:
    """The command line: the fed server's own options and those it shares with its segment server."""
    a = parser().parse_args(argv)
    serve = FedServe(**options_of(FedServe, a))
    cfg = FedConfig(**options_of(FedConfig, a), lora=LoraOptions(**options_of(LoraOptions, a)).spec())
    return serve, cfg


def parse_or_exit(argv=None) -> tuple[FedServe, FedConfig]:
    """:func:`parse_args`, or the process exits: 0 after ``--help``, 2 on a bad option (argparse's
    message, or ``error: ...`` for a value the options refuse)."""
    try:
        return parse_args(argv)
    except (SplitLearnError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
