"""``python -m splitlearn.server``: see :mod:`splitlearn.server.http.cli`."""
import sys

from .http.cli import main

if __name__ == "__main__":
    sys.exit(main())
