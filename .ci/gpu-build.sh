#!/usr/bin/env bash
# Builds everything the GPU machine runs, here (it has no Rust), into .gpu/:
# the kvswap CLI, the cdylib, the test binaries and the C/C++ ABI tests.
# Then, on the GPU machine (device tool, carry [".gpu"]): bash .ci/gpu-run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/tests
cargo build --release --bin kvswap --lib
cp target/release/kvswap target/release/libkvswap.so .gpu/
# Built once with the usual output (a compile error shows here), then listed.
cargo test --release --no-run
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        name = m["target"]["name"]
        if m["target"]["kind"] == ["lib"]:
            name = "unit"
        if name in ("gpu", "model", "threads", "multi", "scorer_gpu"):
            shutil.copy(m["executable"], ".gpu/tests/" + name)
            print("test binary:", name)
'
make -s -C ffi-tests LIBDIR="$PWD/target/release" BUILD="$PWD/.gpu/ffi" build
cp -r ffi-tests/Makefile .gpu/ffi/ 2>/dev/null || true
cp ../shared/bench/torch_fm_baseline.py .gpu/ 2>/dev/null || echo "note: ../shared/bench/torch_fm_baseline.py not found (scorer baseline not carried)"
# Kernel variants to compare with one build (development): FM_VARIANTS="name=rev ..."
# writes .gpu/variants/name.cu, the scorer source at git revision rev, which
# `gpu-run.sh variants` loads through KVSWAP_FM_SOURCE.
for v in ${FM_VARIANTS:-}; do
  [[ ${v%%=*} != builtin ]] || { echo "FM_VARIANTS: 'builtin' names the embedded kernels; pick another name" >&2; exit 1; }
  mkdir -p .gpu/variants
  python3 .ci/fm-source.py "${v#*=}" > ".gpu/variants/${v%%=*}.cu"
  echo "variant: ${v%%=*} = $(git rev-parse --short "${v#*=}")"
done
# A baseline build to time beside this one (development: host and kernel
# changes together): BASELINE_REV=rev builds the kvswap CLI of revision rev
# into .gpu/baseline/ (a git worktree removed afterwards, built in
# target/baseline/, kept as a cache), which `gpu-run.sh baseline` benchmarks
# alternately with .gpu/kvswap.
if [[ -n ${BASELINE_REV:-} ]]; then
  rev=$(git rev-parse --verify --short "$BASELINE_REV^{commit}") || { echo "BASELINE_REV=$BASELINE_REV: not a revision" >&2; exit 1; }
  bt="$PWD/target/baseline"
  wt=$(mktemp -d)
  trap 'git worktree remove --force "$wt" 2>/dev/null; rm -rf "$wt"' EXIT
  git worktree add -q --detach "$wt" "$rev"
  (cd "$wt" && CARGO_TARGET_DIR="$bt" cargo build --release --bin kvswap)
  mkdir -p .gpu/baseline && cp "$bt/release/kvswap" .gpu/baseline/
  echo "$rev" > .gpu/baseline/REV
  echo "baseline: $rev"
fi
strip --strip-debug .gpu/kvswap .gpu/libkvswap.so .gpu/tests/* .gpu/baseline/kvswap 2>/dev/null || true
du -sh .gpu
