#!/usr/bin/env bash
# H200 calls (no network there: run from the checkout). Results under $OUT.
#   bash scripts/h200.sh tests [test files]   GPU tests, one pytest per file (default: all of tests/gpu),
#                                             each under $PER_FILE_TIMEOUT s (default 240), failures summarised
#   bash scripts/h200.sh bench [ops...]       side-by-side benchmarks (default: every op) + quickstart
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export INDUCTOR_EXT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
what=${1:-tests}; shift || true
if [ "$what" = tests ]; then
  for file in ${*:-tests/gpu/test_*.py}; do
    log="$OUT/$(basename "$file" .py).log"
    timeout "${PER_FILE_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short -rfE "$file" > "$log" 2>&1
    echo "== $file rc=$?"
    grep -E "^(FAILED|ERROR) |^E  |[0-9]+ (passed|failed)" "$log" | tail -12
  done
else
  ops=${*:-$(python3 -c "from inductor_ext.bench.__main__ import OPS; print(*OPS)")}
  for op in $ops; do
    python3 -m inductor_ext.bench "$op" --out "$OUT" 2>&1 | tee "$OUT/bench_$op.log" | grep -v Warning | tail -40
  done
  python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart.log" | tail -15
fi
