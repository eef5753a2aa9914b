"""The server's ``--help`` (issue 54): the essential options by group and a line naming
``--help-all``, which shows every option; every option parses either way."""
import re

import pytest

from splitlearn.server.http.cli import ESSENTIAL, parser


def help_of(flag, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser().parse_args([flag])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_shows_the_essentials_by_group_and_help_all_the_rest(capsys):
    p = parser()
    from splitlearn.server.http.cli import _Help

    options = [a for a in p._actions if a.option_strings and not isinstance(a, _Help)]
    short, full = help_of("--help", capsys), help_of("--help-all", capsys)
    def shown(flag, text):  # an option's own line (another's help may name it)
        return re.search(rf"^  {re.escape(flag)}\b", text, re.M) is not None

    for a in options:
        flag = a.option_strings[-1]
        assert shown(flag, full)
        assert shown(flag, short) == (a.dest in ESSENTIAL), flag
    assert ESSENTIAL <= {a.dest for a in options}  # no essential names a field that is gone
    hidden = len(options) - len(ESSENTIAL)
    assert short.rstrip().endswith(f"{hidden} more options (limits, scheduling, federation, the door...): --help-all")
    assert "Source:" in short and "StrategyOptions:" not in short  # a group with nothing essential: not shown
    assert len(short.splitlines()) < len(full.splitlines()) / 2
    assert parser().parse_args(["--model", "tiny", "--decode-share", "0.25"]).decode_share == 0.25  # hidden: parses


def test_help_imports_no_torch():
    """``python -m splitlearn.server --help`` and ``--help-all`` as a user runs them (the package,
    then its ``__main__``): the text is the parser's own, and neither torch nor transformers is
    imported (issue 54: 4.2 s on an idle machine, 23 s under load, almost all of it torch)."""
    import subprocess
    import sys
    from pathlib import Path

    from splitlearn.server.http.cli import help_text

    script = ("import runpy, sys\n"
              "for flag in ('--help', '--help-all'):\n"
              "    sys.argv = ['splitlearn.server', flag]\n"
              "    try:\n"
              "        runpy.run_module('splitlearn.server', run_name='__main__', alter_sys=True)\n"
              "    except SystemExit as e:\n"
              "        assert e.code in (0, None), e.code\n"
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'safetensors'))\n"
              "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    text, heavy = out.stdout.rsplit("HEAVY ", 1)
    assert text == help_text(parser(), False) + help_text(parser(), True)
    assert heavy.strip() == "[]"
