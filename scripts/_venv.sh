# Sourced by scripts/demo and scripts/test: create .venv in the checkout if missing and install the project.
# pip (not uv/poetry) because torch==2.14.1 and torchvision==0.29.1 come from this machine's local package store.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
EXTRA=${1:-}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
STAMP="$VENV/.shardcache-installed${EXTRA:+-$EXTRA}"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "shardcache: installing into $VENV (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT${EXTRA:+[$EXTRA]}" >&2
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
