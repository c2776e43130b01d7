#!/usr/bin/env bash
# Interleaved A/B of one backend provider's first decoder step (its compile), each in a fresh
# process with empty Inductor, Triton and tuning caches, as `bench backend`'s compile times:
#   bash scripts/compile_time_ab.sh PROVIDER VAR REPEATS [LAYERS]
# runs PROVIDER (torch_compile, fastops_auto, fastops_kernel, fastops_inductor) REPEATS times with
# VAR=0 and VAR=1 in turn, plus torch_compile once per round, printing seconds per run.
# Session 9 (H200): one round of fastops_kernel takes ~40 s; compile times vary ±2 s between repeats.
set -u
provider=$1 var=$2 repeats=$3 layers=${4:-4}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
one() {  # $1 provider, $2 value of $var
  local dir
  dir=$(mktemp -d -p "$scratch")
  env TORCHINDUCTOR_CACHE_DIR="$dir/inductor" TRITON_CACHE_DIR="$dir/triton" INDUCTOR_EXT_CACHE_DIR="$dir/tuning" "$var=$2" \
    python -m inductor_ext.bench backend --layers "$layers" --first-step "$1" 2>/dev/null |
    sed -n "s/^BENCH_CHILD_RESULT {\"seconds\": \([0-9.]*\)}/$1 $var=$2 \1 s/p"
}
for _ in $(seq "$repeats"); do
  one "$provider" 0
  one "$provider" 1
  one torch_compile 0
done
