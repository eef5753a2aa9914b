"""The server's command lines are generated from its configuration dataclasses by
:mod:`splitlearn.procs.clihelp` (shared with the client's command line, issue 43): ``opt`` writes an
option once, as a field with its default and its help; ``add_options`` and ``options_of`` make
the argparse options and read them back."""
from ..procs.clihelp import add_options, flag_of, opt, options, options_of

__all__ = ["add_options", "flag_of", "opt", "options", "options_of"]
