"""``python -m flashlax.bench``: see flashlax/bench/cli.py."""

import os
import sys

from flashlax.bench.cli import main

if __name__ == "__main__":
    try:
        code = main()
    except BrokenPipeError:  # output piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)
