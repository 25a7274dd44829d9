"""``python -m constrained_spec``: the same command line as ``constrained-spec``."""

import sys

from constrained_spec.cli import main

if __name__ == "__main__":
    sys.exit(main())
