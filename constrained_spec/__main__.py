"""``python -m constrained_spec``: the same command line as ``constrained-spec``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
