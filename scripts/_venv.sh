# Sourced by scripts/demo, scripts/test and the ops scripts: `ensure_venv [EXTRA]` creates .venv in the checkout
# if missing, installs the project (with the optional extra) and puts .venv/bin first on PATH.
# pip (not uv/poetry): torch==2.14.1 and torchvision==0.29.1 come from this machine's local package store.
SHARDCACHE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

ensure_venv() {
    local extra=${1:-} venv="$SHARDCACHE_ROOT/.venv"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
    fi
    local stamp="$venv/.shardcache-installed${extra:+-$extra}"
    if [ ! -f "$stamp" ] || [ "$SHARDCACHE_ROOT/pyproject.toml" -nt "$stamp" ]; then
        echo "shardcache: installing into $venv (the first run takes a few minutes)" >&2
        "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$SHARDCACHE_ROOT${extra:+[$extra]}" >&2
        touch "$stamp"
    fi
    export PATH="$venv/bin:$PATH"
}
