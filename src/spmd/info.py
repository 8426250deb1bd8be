"""``python -m spmd.info`` prints spmd's environment report (see :mod:`spmd.cli.info`)."""

import sys

from .cli.info import main

if __name__ == "__main__":
    sys.exit(main())
