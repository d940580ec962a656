#!/usr/bin/env bash
# The whole GPU measurement in one prepared run on a lent machine (no network, its own python3 with torch): install
# the wheels carried in wheels/ (scripts/bench/gpu_wheels.sh) where they load, then scripts/bench/gpu.py on this tree
# ("after"), then on bench-before/ when it was carried ("before": G2-G4, G1 being the model's own ceiling), into $OUT.
# Everything fits one device call of 600 s: after gets up to 300 s, before what is left less a margin.
# The wheels go into .gpu-site/ (PYTHONPATH), not into the machine's Python: pip --no-index --target, one package at
# a time so that a wheel for another Python or a torchcodec that does not load against this torch is left out alone.
# Files in $OUT: install.log, env.txt, after.jsonl/.log, before.jsonl/.log, run.json (what was installed, seconds).
# Usage (device machine): OUT=/some/folder scripts/bench/gpu_run.sh [extra gpu.py options, e.g. --quick --device cpu]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the results go to}
PYTHON=${PYTHON:-python3}
TOTAL_S=${GPU_RUN_TOTAL_S:-570}
AFTER_S=${GPU_RUN_AFTER_S:-300}
SITE=$PWD/.gpu-site
mkdir -p "$OUT" "$SITE"
began=$SECONDS
tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

{ nvidia-smi 2>&1 || echo "no nvidia-smi"; "$PYTHON" -VV
  "$PYTHON" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__,
"cuda", torch.cuda.is_available())'; nproc; } > "$OUT/env.txt" 2>&1

installed=()
for package in simplejpeg torchcodec; do
    wheel=$(ls wheels/"$package"-*-"$tag"-*.whl 2>/dev/null | head -n 1)
    if [[ -z $wheel ]]; then
        echo "$package: no wheel for $tag in wheels/" >> "$OUT/install.log"
        continue
    fi
    if ! "$PYTHON" -m pip install --no-index --no-deps --upgrade --disable-pip-version-check -q \
            --target "$SITE" "$wheel" >> "$OUT/install.log" 2>&1; then
        echo "$package: pip could not install $wheel; unpacking it" >> "$OUT/install.log"
        "$PYTHON" -m zipfile -e "$wheel" "$SITE" >> "$OUT/install.log" 2>&1
    fi
    check="import $package"
    if [[ $package == torchcodec ]]; then  # imports, and its decoder loads against this torch
        check="from shards.image.device import jpeg_backend; assert jpeg_backend() == 'torchcodec'"
    fi
    if PYTHONPATH=".:$SITE" "$PYTHON" -c "$check" >> "$OUT/install.log" 2>&1; then
        echo "$package: $wheel loads" >> "$OUT/install.log"
        installed+=("$package")
    else
        echo "$package: $wheel does not load here; left out" >> "$OUT/install.log"
        rm -rf "$SITE/$package" "$SITE/$package"-*.dist-info "$SITE/$package".libs
    fi
done

PYTHONPATH=".:$SITE" timeout $((AFTER_S + 30)) "$PYTHON" scripts/bench/gpu.py --budget "$AFTER_S" "$@" \
    > "$OUT/after.jsonl" 2> "$OUT/after.log"
after_rc=$?
before_rc=null
left=$((TOTAL_S - (SECONDS - began) - 30))
if [[ -d bench-before ]] && ((left >= 60)); then
    budget=$((left < AFTER_S ? left : AFTER_S))
    (cd bench-before && PYTHONPATH=".:$SITE" timeout $((budget + 20)) "$PYTHON" scripts/bench/gpu.py \
        --steps G2,G3,G4 --budget "$budget" "$@" > "$OUT/before.jsonl" 2> "$OUT/before.log")
    before_rc=$?
fi
printf '{"python": "%s", "installed": "%s", "after_rc": %s, "before_rc": %s, "before_commit": "%s", "seconds": %s}\n' \
    "$tag" "${installed[*]:-}" "$after_rc" "$before_rc" "$(cat bench-before/COMMIT 2>/dev/null)" \
    "$((SECONDS - began))" | tee "$OUT/run.json"
