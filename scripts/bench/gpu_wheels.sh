#!/usr/bin/env bash
# What a lent GPU machine (no network) needs beside the working tree, fetched here where package registries answer:
# simplejpeg and torchcodec wheels for CPython 3.12 and 3.11 on manylinux x86_64 into wheels/ (ignored by git), and,
# with --before COMMIT, that commit's source tree in bench-before/ (ignored), so one run measures before and after on
# the same card. scripts/bench/gpu_run.sh installs the wheels there with pip --no-index; docs/gpu.md has the command.
# torchcodec is pinned to the release built against the project's torch (2.14.1: torchcodec 0.17.0); PyPI's build is
# the one fetched (download.pytorch.org, where the CUDA-only builds live, does not answer from here).
# Usage: scripts/bench/gpu_wheels.sh [--before COMMIT]
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=${PIP:-.venv/bin/pip}
DEST=wheels
TORCHCODEC=${TORCHCODEC:-torchcodec==0.17.0}
SIMPLEJPEG=${SIMPLEJPEG:-simplejpeg==1.9.0}
before=
if [[ ${1:-} == --before ]]; then
    before=${2:?--before needs a commit}
elif [[ $# -gt 0 ]]; then
    echo "usage: scripts/bench/gpu_wheels.sh [--before COMMIT]" >&2
    exit 2
fi
mkdir -p "$DEST"
for python in 3.12 3.11; do
    "$PIP" download -q --disable-pip-version-check --only-binary=:all: --platform manylinux2014_x86_64 \
        --python-version "$python" --no-deps -d "$DEST" "$SIMPLEJPEG"
    # torchcodec publishes manylinux_2_28 wheels only: name that platform too.
    "$PIP" download -q --disable-pip-version-check --only-binary=:all: --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 --python-version "$python" --no-deps -d "$DEST" "$TORCHCODEC" \
        || echo "no $TORCHCODEC wheel for Python $python: the GPU run decodes with torchvision" >&2
done
if [[ -n $before ]]; then
    rm -rf bench-before
    mkdir bench-before
    git archive "$before" shards preprocess train scripts pyproject.toml | tar -x -C bench-before
    git rev-parse "$before" > bench-before/COMMIT
fi
ls -l "$DEST"
du -sh "$DEST" ${before:+bench-before}
