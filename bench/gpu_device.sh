#!/usr/bin/env bash
# `python -m bench --gpu` on a lent device machine (bench/gpu.py), in one prepared call.
#
#   bash bench/gpu_device.sh prepare     # here, once: the wheels the machine lacks, into .whl/ (git-ignored locally)
#   bash bench/gpu_device.sh run         # there: the device tool's run, with carry [".whl"] and timeout_s 420
#
# The machine's image has torch (CUDA), accelerate, huggingface-hub, pyarrow, pandas, pluggy, pyyaml, typer and rich
# but not pydantic (lossplug needs it), trl or datasets; transformers and tokenizers are there in other versions,
# so the lock's are carried (TRL runs on the versions CI tests). Versions come from constraints/cpu-lock.txt.
# verl is not carried: its loss functions import verl.protocol, which imports ray, and ray's wheel alone is larger
# than what may travel (64 MiB) — bench/gpu.py then skips the verl cases of (b) and says why; the TRL cases (TRL's
# loss math replicated in torch) and (a) need none of it.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pydantic pydantic-core annotated-types typing-inspection trl datasets dill multiprocess transformers tokenizers)

pinned() {  # name==version from the lock, for every wheel
    for name in "${WHEELS[@]}"; do
        grep -i -m1 "^${name}==" constraints/cpu-lock.txt || { echo "no pin for ${name} in the lock" >&2; exit 1; }
    done
}

case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    # the machine's Python is CPython 3.12 on x86-64 Linux
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl $(pinned)
    du -sh .whl
    ;;
run)
    OUT="${OUT:-/tmp/lossplug-gpu}"
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site .
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    set -o pipefail
    python3 -m bench --gpu --out "$OUT/results-gpu.json" "${@:2}" 2>&1 | tee "$OUT/gpu-log.txt"
    ;;
*)
    echo "usage: bash bench/gpu_device.sh prepare|run [python -m bench --gpu options]" >&2
    exit 2
    ;;
esac
