#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmark from .gpu/ (see .ci/gpu-build.sh)
# on a machine with an NVIDIA GPU. Logs and JSON go to $OUT (or ./gpu-out).
#   what=tests|multi|sanitize|bench|fm|all (default all), scorer|ffi|loads|variants|defines|baseline
#   (kernel development), or a profiling mode:
#   profile|sass|ncu-detail|pipes (see README.md)
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
NGPU=$(nvidia-smi -L | wc -l)
SKIP=(); [ "$NGPU" -ge 2 ] || SKIP=(--skip multi_gpu)
# The quick scorer benchmarks' JSON files $OUT/PREFIX-NAME-ROUND.json side by
# side: a row per (scope, keys, chunks), a column per NAME, the rounds of a
# cell joined by " / " (us: one call per graph; batch rows per sequence).
fm_table() {
  python3 - "$OUT" "$1" <<'PY'
import glob, json, os, re, sys
out, prefix = sys.argv[1], sys.argv[2]
rows = {}
for f in sorted(glob.glob(os.path.join(out, f"{prefix}-*-*.json"))):
    stem = os.path.basename(f)[len(prefix) + 1:-5]
    if not re.fullmatch(r".+-[0-9]+", stem):
        continue
    name, rnd = stem.rsplit("-", 1)
    j = json.load(open(f))
    for r in j.get("rows", []):
        rows.setdefault((r["scope"], r["keys"], r["chunks"]), {}).setdefault(name, []).append(r["kvswap_us"])
    for r in j.get("spread", []):  # score distributions (score scope, bf16)
        rows.setdefault(("scores", r["scores"], r["chunks"]), {}).setdefault(name, []).append(r["kvswap_us"])
    for r in j.get("batch", []):  # batched form: us per sequence
        rows.setdefault(("batch", f"B={r['seqs']} per seq", r["chunks_per_seq"]), {}).setdefault(name, []).append(r["per_seq_us"])
names = sorted({n for v in rows.values() for n in v})
kw = max([4] + [len(k[1]) for k in rows])  # the keys column: dtypes, or score-distribution names
print(f"scope  {'keys':{kw}s} chunks   " + "  ".join(f"{n:>22s}" for n in names))
for key, v in sorted(rows.items()):
    print(f"{key[0]:6s} {key[1]:{kw}s} {key[2]:7d}  " + "  ".join(f"{' / '.join(f'{x:.1f}' for x in v.get(n, [])):>22s}" for n in names))
PY
}
# The scorer's GPU tests on every kernel and load path: the defaults (fp8
# keys of one sequence by TMA: the log says whether that kernel ran), the
# cp.async ring, the mma.sync kernel, fp8 keys by conversion.
scorer_suite() {
  step scorer-gpu env KVSWAP_LOG=info $T/scorer_gpu --ignored --test-threads=1 --nocapture
  echo "    fm_score_wg_fp8q_tma launched: $(grep -c 'fm_score_wg_fp8q_tma launched' "$OUT/scorer-gpu.log") time(s) (1 expected)"
  step scorer-gpu-cp-async env KVSWAP_FM_LOAD=cp.async $T/scorer_gpu --ignored --test-threads=1 \
    cuda_scorer_matches cuda_scorer_long_call cuda_scorer_scale_beyond_float_range cuda_scorer_adversarial
  step scorer-gpu-mma env KVSWAP_FM_KERNEL=mma $T/scorer_gpu --ignored --test-threads=1
  step scorer-gpu-fp8-convert env KVSWAP_FM_KERNEL=wgmma-convert $T/scorer_gpu --ignored --test-threads=1 cuda_scorer_matches cuda_scorer_long_call cuda_scorer_scale_beyond_float_range
}
if [[ $what == scorer ]]; then
  scorer_suite
fi
if [[ $what == loads ]]; then
  # fm_score_wg_fp8q's load paths side by side: the quick bench, ROUNDS
  # (default 3) rounds of the cp.async ring and TMA (the default), a table.
  rm -f "$OUT"/loads-*.json "$OUT"/loads-*.log  # this run's results only
  for round in $(seq 1 "${ROUNDS:-3}"); do
    step loads-cp-async-$round env KVSWAP_FM_LOAD=cp.async KVSWAP_LOG=info .gpu/kvswap bench --backend cuda --scorer --quick --json "$OUT/loads-cp.async-$round.json"
    step loads-tma-$round env KVSWAP_LOG=info .gpu/kvswap bench --backend cuda --scorer --quick --json "$OUT/loads-tma-$round.json"
  done
  echo "    fm_score_wg_fp8q_tma launched in $(cat "$OUT"/loads-tma-*.log | grep -c 'fm_score_wg_fp8q_tma launched') of ${ROUNDS:-3} TMA runs;" \
    "the ring in $(cat "$OUT"/loads-cp-async-*.log | grep -c 'fp8_loads=cp.async') of ${ROUNDS:-3} cp.async runs (one scorer each)"
  fm_table loads
fi
if [[ $what == variants ]]; then
  # Kernel variants (.gpu/variants/*.cu, see gpu-build.sh FM_VARIANTS) beside
  # the built-in source: the scorer's random and long-call tests, then the
  # quick scorer benchmark, each variant in turn, twice (order effects).
  # VARIANT_TESTS: the scorer_gpu tests each variant runs first (empty: none).
  VARIANT_TESTS=${VARIANT_TESTS-cuda_scorer_matches cuda_scorer_long_call}
  rm -f "$OUT"/variant-*.json  # the table below reads this run's results only
  # The variants: builtin, then each source file; `with_source V cmd...`
  # runs cmd with variant V's kernels.
  variants=(builtin)
  for v in .gpu/variants/*.cu; do [[ -f $v ]] && variants+=("$v"); done
  with_source() { local v=$1; shift; if [[ $v == builtin ]]; then "$@"; else KVSWAP_FM_SOURCE=$v "$@"; fi; }
  if [[ -n $VARIANT_TESTS ]]; then
    for v in "${variants[@]}"; do
      step "variant-$(basename "$v" .cu)-test" with_source "$v" $T/scorer_gpu --ignored --test-threads=1 $VARIANT_TESTS
    done
  fi
  for round in 1 2; do
    for v in "${variants[@]}"; do
      n=$(basename "$v" .cu)
      step "variant-$n-bench$round" with_source "$v" .gpu/kvswap bench --backend cuda --scorer --quick --json "$OUT/variant-$n-$round.json"
    done
  done
  fm_table variant
fi
if [[ $what == defines ]]; then
  # Experiment defines of the scorer source (KVSWAP_FM_DEFINES) side by side
  # in one build: FM_DEFINE_SETS="name=-DA=1,-DB=2 other=-DC=1" (a set's
  # options joined by commas; "base=" for none; an option src=FILE loads the
  # kernels from FILE, e.g. .gpu/variants/NAME.cu), each set's scorer tests
  # first (VARIANT_TESTS, empty for none), then the quick scorer benchmark,
  # sets round-robin, ROUNDS rounds (default 3), then a table.
  VARIANT_TESTS=${VARIANT_TESTS-cuda_scorer_matches cuda_batch_equals_single_calls}
  read -r -a sets <<< "${FM_DEFINE_SETS:?FM_DEFINE_SETS=\"name=-DX=1,... name2=...\"}"
  rm -f "$OUT"/defines-*.json
  with_set() {
    local opts=() src= o; IFS=, read -r -a opts <<< "${1#*=}"; shift
    local defs=()
    for o in "${opts[@]}"; do
      if [[ $o != src=* ]]; then defs+=("$o")
      elif [[ -z $src ]]; then src=${o#src=}
      else echo "FM_DEFINE_SETS: one src= per set" >&2; return 1; fi
    done
    if [[ -n $src ]]; then KVSWAP_FM_SOURCE=$src KVSWAP_FM_DEFINES="${defs[*]}" "$@"; else KVSWAP_FM_DEFINES="${defs[*]}" "$@"; fi
  }
  if [[ -n $VARIANT_TESTS ]]; then
    for set in "${sets[@]}"; do step "defines-${set%%=*}-test" with_set "$set" $T/scorer_gpu --ignored --test-threads=1 $VARIANT_TESTS; done
  fi
  for round in $(seq 1 "${ROUNDS:-3}"); do
    for set in "${sets[@]}"; do
      step "defines-${set%%=*}-bench$round" with_set "$set" .gpu/kvswap bench --backend cuda --scorer --quick --json "$OUT/defines-${set%%=*}-$round.json"
    done
  done
  fm_table defines
  # Sets built with -DFM_CTRACE: their call timelines side by side.
  python3 .ci/fm-ctrace.py "$OUT" defines
fi
if [[ $what == baseline ]]; then
  # The scorer benchmark of this build and of .gpu/baseline/kvswap
  # (gpu-build.sh BASELINE_REV=rev): baseline, this, this, baseline (order
  # effects cancel), then a table. BASELINE_ARGS: the benchmark's options
  # (default --quick: 262,144 chunks, decode step on 65,536; empty: the
  # whole benchmark, decode step on 262,144).
  [[ -x .gpu/baseline/kvswap ]] || { echo "no .gpu/baseline/kvswap: run gpu-build.sh with BASELINE_REV=rev"; exit 1; }
  rm -f "$OUT"/{baseline,this}-[12].json  # the table reads this run's results only
  for run in baseline-1:.gpu/baseline/kvswap this-1:.gpu/kvswap this-2:.gpu/kvswap baseline-2:.gpu/baseline/kvswap; do
    step "${run%%:*}" "${run#*:}" bench --backend cuda --scorer ${BASELINE_ARGS---quick} --json "$OUT/${run%%:*}.json"
  done
  python3 - "$OUT" "$(cat .gpu/baseline/REV)" <<'PY' || fail=1
import json, os, sys
out, rev = sys.argv[1], sys.argv[2]
def load(name, r):
    f = os.path.join(out, f"{name}-{r}.json")
    return json.load(open(f)) if os.path.exists(f) else None
runs = {name: {r: load(name, r) for r in (1, 2)} for name in ("baseline", "this")}
if not any(runs["this"].values()) or not any(runs["baseline"].values()):
    sys.exit("baseline: a build has no results (see the step logs above)")
def cells(name, f):
    return "  ".join(f"r{r} " + (f(j) if j else "failed") for r, j in runs[name].items())
def row_cell(key):
    def f(j):
        r = next((r for r in j.get("rows", []) if (r["scope"], r["keys"], r["chunks"]) == key), None)
        if r is None:
            return "-"
        b2b = r.get("back_to_back_us")  # absent before 89838b5
        return f"{r['kvswap_us']:6.1f} / " + (f"{b2b:6.1f}" if b2b is not None else "     -")
    return f
print(f"one call per graph / back to back, us, rounds r1 and r2; baseline = {rev}")
first = next(j for j in list(runs["this"].values()) + list(runs["baseline"].values()) if j)
for key in [(r["scope"], r["keys"], r["chunks"]) for r in first.get("rows", [])]:
    print(f"{key[0]:6s} {key[1]:9s} {key[2]:8d}   baseline {cells('baseline', row_cell(key))}   this {cells('this', row_cell(key))}")
for seqs in [b["seqs"] for b in first.get("batch", [])]:
    def f(j, seqs=seqs):
        b = next((b for b in j.get("batch", []) if b["seqs"] == seqs), None)
        return f"{b['per_seq_us']:6.1f} (single {b['single_call_us']:6.1f})" if b else "-"
    print(f"batch B={seqs:<3d} per sequence   baseline {cells('baseline', f)}   this {cells('this', f)}")
step = lambda j: f"scorer {j['step']['scorer_us']:6.1f} step {j['step']['step_us']:6.1f}" if j.get("step") else "-"
print(f"decode step              baseline {cells('baseline', step)}   this {cells('this', step)}")
def layers_call(j):
    w = (j.get("step") or {}).get("layers_call")  # absent before s29
    return f"step {w['step_us']:6.1f}" if w else "-"
print(f"  kvswap_swap_in_layers    baseline {cells('baseline', layers_call)}   this {cells('this', layers_call)}")
for p in [w["streams"] for w in (first.get("step") or {}).get("streams", [])]:
    def f(j, p=p):
        w = next((w for w in (j.get("step") or {}).get("streams", []) if w["streams"] == p), None)
        return f"step {w['step_us']:6.1f}" if w else "-"
    print(f"  layers on {p:2d} streams      baseline {cells('baseline', f)}   this {cells('this', f)}")
PY
fi
if [[ $what == ffi ]]; then
  .gpu/kvswap fm init --hidden 64 --heads 16 --head-dim 64 --scorers 2 --dtype bf16 --seed 7 --out "$OUT/fm-test.safetensors" >/dev/null
  FM="KVSWAP_TEST_FM_CKPT=$OUT/fm-test.safetensors KVSWAP_TEST_REQUIRE_FM_CKPT=1"
  step ffi-c-cuda   env KVSWAP_TEST_BACKEND=cuda $FM .gpu/ffi/test_abi
  step ffi-cpp-cuda env KVSWAP_TEST_BACKEND=cuda $FM .gpu/ffi/test_abi_cpp
  tail -15 "$OUT/ffi-c-cuda.log"
fi
if [[ $what == multi || ( $what == all && $NGPU -ge 2 ) ]]; then
  # The CUDA backend's GPU suite on every device at once: one process per GPU,
  # each seeing only its own (CUDA_VISIBLE_DEVICES), all started together.
  echo "=== gpu-tests on $NGPU device(s) at once"; t=$SECONDS
  for d in $(seq 0 $((NGPU - 1))); do
    ( CUDA_VISIBLE_DEVICES=$d $T/gpu --ignored --test-threads=1 --skip multi_gpu >"$OUT/gpu-tests-dev$d.log" 2>&1
      echo $? >"$OUT/gpu-tests-dev$d.rc" ) &
  done
  wait
  for d in $(seq 0 $((NGPU - 1))); do
    rc=$(cat "$OUT/gpu-tests-dev$d.rc"); echo "    device $d: rc $rc, $(grep -E '^test result' "$OUT/gpu-tests-dev$d.log" | tail -1)"
    [ "$rc" = 0 ] || { tail -40 "$OUT/gpu-tests-dev$d.log"; fail=1; }
  done
  echo "    ($((SECONDS - t)) s)"
  # Pointers and streams of another device are refused (needs 2 GPUs).
  [ "$NGPU" -ge 2 ] && step multi-gpu-pointers $T/gpu --ignored --test-threads=1 multi_gpu
fi
if [[ $what == multi ]]; then  # (`all` runs these in its tests and bench parts)
  # One process, one thread per context, contexts spread over the GPUs.
  step multi-cuda     env KVSWAP_TEST_BACKEND=cuda $T/multi
  step bench-multi .gpu/kvswap bench --backend cuda --multi-gpu --json "$OUT/bench-multi.json"
  cat "$OUT/bench-multi.log"
fi
if [[ $what == tests || $what == all ]]; then
  step gpu-tests      $T/gpu --ignored --test-threads=1 "${SKIP[@]}"
  step multi-cuda     env KVSWAP_TEST_BACKEND=cuda $T/multi
  scorer_suite
  step model-cuda     env KVSWAP_TEST_BACKEND=cuda $T/model
  step threads-cuda   env KVSWAP_TEST_BACKEND=cuda $T/threads
  if [[ ! -x .gpu/ffi/test_abi || ! -x .gpu/ffi/test_abi_cpp ]]; then
    echo "=== ffi: .gpu/ffi/test_abi(_cpp) missing: run .ci/gpu-build.sh"; fail=1
  else
    # The scorer groups of the C tests read a small checkpoint (as tests/ffi_c.rs makes it).
    .gpu/kvswap fm init --hidden 64 --heads 16 --head-dim 64 --scorers 2 --dtype bf16 --seed 7 --out "$OUT/fm-test.safetensors" >/dev/null
    FM="KVSWAP_TEST_FM_CKPT=$OUT/fm-test.safetensors KVSWAP_TEST_REQUIRE_FM_CKPT=1"
    step ffi-c-cuda   env KVSWAP_TEST_BACKEND=cuda $FM .gpu/ffi/test_abi
    step ffi-cpp-cuda env KVSWAP_TEST_BACKEND=cuda $FM .gpu/ffi/test_abi_cpp
  fi
fi
if [[ $what == sanitize || $what == all ]]; then
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # Under the sanitizer a kernel launched on one stream invalidates another
  # stream's global-mode capture, relaxed mode or not (.ci/capture-probe.py
  # shows it with plain driver calls): the global-capture test is skipped.
  # The scorer's suite too (its global-capture test skipped the same way):
  # H200, session 45, 16 tests each, memcheck ~75 s, racecheck ~165 s.
  for tool in memcheck racecheck; do
    step "sanitizer-$tool" timeout ${SAN_TIMEOUT:-300} env KVSWAP_TEST_SCALE=${SAN_SCALE:-0.01} "$CS" --tool $tool --error-exitcode 1 $T/gpu --ignored --test-threads=1 "${SKIP[@]}" --skip global_capture
    step "sanitizer-scorer-$tool" timeout ${SAN_TIMEOUT:-300} env KVSWAP_TEST_SCALE=${SAN_SCALE:-0.01} "$CS" --tool $tool --error-exitcode 1 $T/scorer_gpu --ignored --test-threads=1 --skip global_capture
  done
fi
if [[ $what == fm || $what == all ]]; then
  step bench-fm .gpu/kvswap bench --backend cuda --scorer --json "$OUT/bench-fm.json" ${BENCH_ARGS:-}
  cat "$OUT/bench-fm.log"
  if [[ -f .gpu/torch_fm_baseline.py ]]; then
    SIZES=${FM_SIZES:-16384,65536,262144,1048576}
    step torch-score python3 .gpu/torch_fm_baseline.py --scope score --sizes $SIZES --json "$OUT/torch-score.json"
    step torch-full  python3 .gpu/torch_fm_baseline.py --scope full --sizes $SIZES --json "$OUT/torch-full.json"
    step torch-floor python3 .ci/torch-graph-floor.py --json "$OUT/torch-floor.json"
    FLOOR=(); [[ -f $OUT/torch-floor.json ]] && FLOOR=("$OUT/torch-floor.json")  # the table without it if that step failed
    python3 .ci/fm-compare.py "$OUT/bench-fm.json" "$OUT/torch-score.json" "$OUT/torch-full.json" "${FLOOR[@]}" | tee "$OUT/fm-compare.txt"
  fi
fi
if [[ $what == ncu-detail ]]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  step ncu-detail "$NCU" --clock-control none --kernel-name "regex:fm_score" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    .gpu/kvswap bench --backend cuda --scorer --quick
  grep -E "Duration|Throughput|Stall|Issued|Eligible|Active Warps|No Eligible|Warp Cycles|smsp__pcsamp|L1|L2|DRAM|Bank" "$OUT/ncu-detail.log" | head -60
fi
if [[ $what == pipes ]]; then
  # Pipe utilisation and instruction mix of the scoring kernels (one launch
  # each after warm-up): which execution pipe a warp tile's instructions load.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  step ncu-pipes "$NCU" --clock-control none --kernel-name "regex:${NCU_KERNELS:-fm_score_wg}" --launch-skip ${NCU_SKIP:-6} \
    --launch-count ${NCU_COUNT:-2} --section ComputeWorkloadAnalysis --section InstructionStats --section SpeedOfLight \
    --metrics smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_fmaheavy.sum,smsp__inst_executed_pipe_fp16.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed_pipe_adu.sum,smsp__inst_executed_pipe_cbu.sum,smsp__inst_executed_pipe_uniform.sum,smsp__inst_executed.sum,smsp__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,smsp__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,smsp__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,smsp__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,smsp__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_tensor_op_gmma.sum,sm__cycles_elapsed.avg \
    .gpu/kvswap bench --backend cuda --scorer --quick
  grep -vE "^==PROF==|^\s*$" "$OUT/ncu-pipes.log" | grep -E "fm_score|pipe|Pipe|inst_executed|Duration|Issue|cycles" | head -120
fi
if [[ $what == sass ]]; then
  # Per-instruction stall samples (SASS) and the details page of the kernels
  # matching $NCU_KERNELS, from one launch each after warm-up.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  step ncu-rep "$NCU" --clock-control none --kernel-name "regex:${NCU_KERNELS:-fm_score_wg|fm_select|fm_order}" --launch-skip ${NCU_SKIP:-6} \
    --launch-count ${NCU_COUNT:-3} --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    -o "$OUT/prof" .gpu/kvswap bench --backend cuda --scorer --quick
  "$NCU" -i "$OUT/prof.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
  "$NCU" -i "$OUT/prof.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-sass.csv" 2>&1
  grep -E "fm_|Duration|Eligible|Issued Warp|No Eligible|Active Warps|Warp Cycles Per Issued|DRAM Throughput|Registers" "$OUT/ncu-details.txt" | head -60
  for k in ${NCU_KERNELS:-fm_score_wg_fp8q fm_score_wg_fp8 fm_score_wg_bf16 fm_score_wg}; do python3 .ci/fm-ncu-phases.py "$OUT/ncu-sass.csv" $k --opcodes 2>/dev/null && break; done
fi
if [[ $what == profile ]]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  step ncu "$NCU" --clock-control none --csv --metrics gpu__time_duration.sum --kernel-name "regex:fm_|kvswap_" \
    --launch-count ${NCU_COUNT:-60} .gpu/kvswap bench --backend cuda --scorer --quick
  python3 - "$OUT/ncu.log" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; k = head.index("Kernel Name"); v = head.index("Metric Value")
d = collections.defaultdict(list)
for r in rows[1:]:
    try: d[r[k]].append(float(r[v].replace(",", "")))
    except ValueError: pass
for name, xs in d.items():
    xs.sort(); print(f"{name:30s} n={len(xs):3d} median {xs[len(xs)//2]/1e3:9.1f} us  min {xs[0]/1e3:9.1f} us")
PY
fi
if [[ $what == bench || $what == all ]]; then
  step bench .gpu/kvswap bench --backend cuda --json "$OUT/bench.json" ${BENCH_ARGS:-}
  cat "$OUT/bench.log"
  step bench-multi .gpu/kvswap bench --backend cuda --multi-gpu --json "$OUT/bench-multi.json"
  cat "$OUT/bench-multi.log"
  step demo-cuda .gpu/kvswap demo --backend cuda --steps 500
  cat "$OUT/demo-cuda.log"
fi
exit $fail
