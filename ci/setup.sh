#!/usr/bin/env bash
# Creates .venv with Python 3.12 (via pyenv when present) and installs flashlax with its test and bench extras.
# Idempotent: a second run only re-checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  py=""
  for cand in "$(command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null)" \
              "$HOME/.pyenv/versions/3.12.1/bin/python3.12" "$(command -v python3.12 || true)" "$(command -v python3 || true)"; do
    if [ -n "$cand" ] && [ -x "$cand" ] && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then py="$cand"; break; fi
  done
  [ -n "$py" ] || { echo "ci/setup.sh: no Python >= 3.12 found (pyenv 3.12.1 expected)" >&2; exit 1; }
  "$py" -m venv .venv
fi
# Skip pip when the install is current: same pyproject.toml and Python as the last successful install.
stamp=".venv/.flashlax-install"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(.venv/bin/python -c 'import sys; print(sys.version)')"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c 'import flashlax' 2>/dev/null; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench]'
echo "$want" > "$stamp"
