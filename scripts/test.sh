#!/usr/bin/env bash
# Set up a virtualenv with the test extras and run the whole suite: pytest, then the lab checks.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
.venv/bin/python -m pytest "$@"
bash scripts/check.sh
