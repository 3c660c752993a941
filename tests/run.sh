#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (pytest arguments pass through).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash setup.sh
exec .venv/bin/python -m pytest -q "$@" tests
