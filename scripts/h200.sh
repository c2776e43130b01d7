#!/usr/bin/env bash
# One H200 call: install (no network there), GPU tests, benchmark. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD  # no network there: run from the checkout
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q tests/gpu "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 -m inductor_ext.bench rms_norm --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart.log" | tail -15
