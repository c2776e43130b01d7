#!/usr/bin/env bash
# GPU tests and benchmarks on any CUDA machine, from a bare checkout (PYTHONPATH=$PWD: no install,
# no network). Written for an H200; runs on any GPU that the CUDA build of torch supports.
#   bash scripts/h200.sh tests [test files]   GPU tests, one pytest per file (default: all of tests/gpu),
#                                             $PARALLEL at a time (default 4), each under $PER_FILE_TIMEOUT s
#                                             (default 240; then SIGABRT, so faulthandler prints where it hung),
#                                             failures summarised on stdout
#   bash scripts/h200.sh bench [benchmarks...]  benchmarks (default: every op micro-benchmark and model-level one
#                                             of benchmarks/, then bench train and generate; long)
#                                             + examples/quickstart.py as a smoke test
# Environment: WHEELS, a folder of wheels to add with no network (e.g. bitsandbytes for the QLoRA tests and
# `bench train --qlora`: `pip download --no-deps bitsandbytes` elsewhere), installed with --no-deps into
# $WHEELS/site, which goes on PYTHONPATH; OUT (default /tmp/out) receives results.tgz; LOGS (default /tmp/h200_logs) holds every log,
# benchmark JSON/PNG and gpu.txt; INDUCTOR_EXT_CACHE_DIR (default /tmp/h200_cache) is the tuning database's
# folder, copied into LOGS. On exit LOGS is bundled into one archive, $OUT/results.tgz, to copy off the machine.
set -uo pipefail
case ${1:-tests} in
  tests | bench) ;;
  *) sed -n '2,14s/^# \{0,1\}//p' "$0"; [ "$1" = -h ] || [ "$1" = --help ]; exit ;;
esac
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$WHEELS/site" "$WHEELS"/*.whl && PYTHONPATH=$PWD:$WHEELS/site
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOGS=${LOGS:-/tmp/h200_logs}; mkdir -p "$LOGS"
export INDUCTOR_EXT_CACHE_DIR=${INDUCTOR_EXT_CACHE_DIR:-/tmp/h200_cache}
trap 'cp "$INDUCTOR_EXT_CACHE_DIR"/*.json "$LOGS"/ 2>/dev/null; tar czf "$OUT/results.tgz" -C "$LOGS" . 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$LOGS/gpu.txt"
what=${1:-tests}; shift || true
run_test_file() {
  local file=$1 log="$LOGS/$(basename "$1" .py).log"
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 20 "${PER_FILE_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short -rfE "$file" > "$log" 2>&1
  echo "== $file rc=$?"
  grep -E "^(FAILED|ERROR) |^E  |[0-9]+ (passed|failed|skipped)" "$log" | tail -12
}
if [ "$what" = tests ]; then
  # files run $PARALLEL at a time (default 4): the tests are compile- and tune-bound and
  # assert no timings, so sharing the GPU changes only which configs the tuners pick
  for file in ${*:-tests/gpu/test_*.py}; do
    while [ "$(jobs -rp | wc -l)" -ge "${PARALLEL:-4}" ]; do wait -n; done
    run_test_file "$file" &
  done
  wait
else
  ops=${*:-$(python3 -c "from benchmarks.__main__ import MODEL_BENCHES, OPS; print(*OPS, *MODEL_BENCHES, 'train', 'generate')")}
  for op in $ops; do
    case $op in
      train | generate) module=inductor_ext.bench ;;  # the package's own benchmarks
      *) module=benchmarks ;;  # op micro-benchmarks and developer tools (repository only)
    esac
    python3 -m "$module" "$op" --out "$LOGS" 2>&1 | tee "$LOGS/bench_$op.log" | grep -v Warning | tail -40
  done
  python3 examples/quickstart.py 2>&1 | tee "$LOGS/quickstart.log" | tail -15
fi
