#!/usr/bin/env bash
# The test command: sets up .venv, then runs the default (CPU) suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
export JAX_PLATFORMS=cpu
# The interpreted Pallas kernels are mostly XLA CPU compile time; LLVM at -O0 halves it. Float32 results
# move in the last bits (another accumulation order in XLA's CPU dots), well inside every test's tolerance,
# which is set against float64 references. Appended: a user's XLA_FLAGS still apply.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
exec .venv/bin/python -m pytest -q -n 2 "$@"
