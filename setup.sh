#!/usr/bin/env bash
# Creates the project's virtual environment (.venv, or $VENV) from the pinned requirements.txt.
# Run it once on a login node: the job scripts and the test command reuse the environment, and it
# reinstalls only when requirements.txt changed. Uses uv when present, else venv + pip.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV=${VENV:-.venv}
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setup.sh: installing requirements.txt into $VENV (once; later calls reuse it)" >&2
if command -v uv >/dev/null 2>&1; then
  uv venv --allow-existing "$VENV" >&2
  # bytecode at install, as pip does: the test suite writes none, and each of its processes would otherwise
  # compile torch's and transformers' sources: 2.7-2.9 times the CPU to import them
  uv pip install --compile-bytecode --python "$VENV/bin/python" -r requirements.txt >&2
else
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
  "$VENV/bin/python" -c "import torch, transformers, datasets, yaml, numpy" \
    || { echo "setup.sh: installing requirements.txt failed; see the pip output above" >&2; exit 1; }
fi
echo "$want" > "$VENV/.requirements.sha256"
