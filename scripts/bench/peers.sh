#!/usr/bin/env bash
# The peers the loader benchmark measures that are not project dependencies: Meta's SPDL 0.8 (spdl_io, spdl_core)
# into .bench-peers/ beside the checkout (scripts/bench/loader_modes.py puts it on the path of its SPDL passes only),
# and the FFmpeg 5.1 libraries spdl.io loads (Debian 12's packages; root installs them, anyone else is told how).
# Usage: scripts/bench/peers.sh   then   .venv/bin/python scripts/bench/loader.py --modes --repeat 3
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
LIBS=(libavcodec59 libavformat59 libavfilter8 libavdevice59 libswscale6)
missing=()
for lib in "${LIBS[@]}"; do
    dpkg -s "$lib" >/dev/null 2>&1 || missing+=("$lib")
done
if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]]; then
        apt-get install -y -q "${missing[@]}" >&2
    else
        echo "error: spdl.io needs FFmpeg 5.1: sudo apt-get install ${missing[*]}" >&2
        exit 1
    fi
fi
"$PYTHON" -m pip install -q --no-deps --target .bench-peers spdl==0.8.0 spdl_io==0.8.0 spdl_core==0.8.0 >&2
PYTHONPATH=.bench-peers "$PYTHON" -c "import spdl.io; print('spdl', spdl.io.utils.get_ffmpeg_versions())"
