#!/usr/bin/env bash
# The main job: sets up .venv, then runs the quick benchmark and parity report on the present backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
exec .venv/bin/python -m flashlax.bench --quick "$@"
