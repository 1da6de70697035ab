"""``python -m flashlax.bench``: see flashlax/bench/cli.py."""

import sys

from flashlax.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
