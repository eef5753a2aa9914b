"""``python -m splitlearn.client``: see :mod:`splitlearn.client.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
