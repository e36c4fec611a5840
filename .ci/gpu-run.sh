#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmark from .gpu/ (see .ci/gpu-build.sh)
# on a machine with an NVIDIA GPU. Logs and JSON go to $OUT (or ./gpu-out).
#   what=tests|bench|sanitize|all   (default all)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$PWD/.gpu:${LD_LIBRARY_PATH:-}
export KVSWAP_LOG=${KVSWAP_LOG:-warn}
what=${1:-all}
fail=0
step() { local name=$1; shift; echo "=== $name"; local t=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then echo "    ok ($((SECONDS-t)) s)"; else echo "    FAILED ($((SECONDS-t)) s)"; tail -40 "$OUT/$name.log"; fail=1; fi; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
T=.gpu/tests
if [[ $what == tests || $what == all ]]; then
  step gpu-tests      $T/gpu --ignored --test-threads=1
  step model-cuda     env KVSWAP_TEST_BACKEND=cuda $T/model
  step threads-cuda   env KVSWAP_TEST_BACKEND=cuda $T/threads
  if [[ -x .gpu/ffi/test_abi ]]; then
    step ffi-c-cuda   env KVSWAP_TEST_BACKEND=cuda .gpu/ffi/test_abi
    step ffi-cpp-cuda env KVSWAP_TEST_BACKEND=cuda .gpu/ffi/test_abi_cpp
  fi
fi
if [[ $what == sanitize || $what == all ]]; then
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    step "sanitizer-$tool" timeout ${SAN_TIMEOUT:-300} env KVSWAP_TEST_SCALE=${SAN_SCALE:-0.01} "$CS" --tool $tool --error-exitcode 1 $T/gpu --ignored --test-threads=1
  done
fi
if [[ $what == bench || $what == all ]]; then
  step bench .gpu/kvswap bench --backend cuda --json "$OUT/bench.json" ${BENCH_ARGS:-}
  cat "$OUT/bench.log"
  step demo-cuda .gpu/kvswap demo --backend cuda --steps 500
  cat "$OUT/demo-cuda.log"
fi
exit $fail
