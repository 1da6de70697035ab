#!/usr/bin/env bash
# The test command: sets up .venv, then runs the default (CPU) suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q -n 2 "$@"
