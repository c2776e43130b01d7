#!/usr/bin/env bash
# H200 calls (no network there: run from the checkout). Results under $OUT.
#   bash scripts/h200.sh tests [pytest args]   GPU tests of every op and the backend
#   bash scripts/h200.sh bench [ops...]        side-by-side benchmarks (default: every op) + quickstart
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export INDUCTOR_EXT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
what=${1:-tests}; shift || true
if [ "$what" = tests ]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
else
  ops=${*:-$(python3 -c "from inductor_ext.bench.__main__ import OPS; print(*OPS)")}
  for op in $ops; do
    python3 -m inductor_ext.bench "$op" --out "$OUT" 2>&1 | tee "$OUT/bench_$op.log" | grep -v Warning | tail -40
  done
  python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart.log" | tail -15
fi
