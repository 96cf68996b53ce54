#!/usr/bin/env bash
# On the GPU machine (device tool, carry [".gpu"] and, when built before, [".cuda_ext_xz"]): build the
# CUDA kernels in place as an install does (setup.py build_ext --inplace, ~190 s, skipped when a
# current build is there), run the GPU suites (kernels on every backend, NCCL sharding on every
# GPU), then the benchmarks. Each stage has its own time limit; logs under $OUT. A fresh build comes
# back as $OUT/_lookup_cuda.so.xz: put it in .cuda_ext_xz/ (git-ignored, ~1 MB) and carry that
# folder, so the next machine loads it instead of building while the source is unchanged.
# Likewise SAVE_TRITON_CACHE=1 returns Triton's kernel cache as $OUT/triton_cache.tar.xz: carried
# in .triton_cache_xz/ (git-ignored), it spares the next machine the suite's first compiles.
#   STAGES="tests asan soak nccl dlrm bench sequence random serving cold prior sweep ps quant psprof bwdvar profile" SWEEP_RUNS=2 BENCH_ARGS="..." PROFILE_ARGS="..." bash tools/gpu_session.sh
#   (random and cold draw a fresh seed; SEED=N draws that one again: a change measured at the layouts
#   an earlier run found)
#   (the tests stage runs the whole suite, tests/, with CUDA tensors in one process; TESTS="files or
#   node ids" and TEST_K="a pytest -k expression" narrow it, TEST_TIMEOUT (default 540 s) bounds it;
#   TEST_DETACH=1 lets it run past the call, and the next call's STAGES=tests-wait awaits it;
#   SUITE_CPUS=0-15 keeps the suite to those cores (a benchmark beside it on another GPU takes the rest);
#   NATIVE_BACKTRACE=1 and HEAP_CHECK=1 for a process that crashes: native frames, glibc's checked malloc;
#   RESOURCE_LOG=1: mappings, threads, files and memory after each test, and the garbage collector's
#   last state, tools/pytest_resources.py; GC_EACH_TEST=1 (or file) collects after each test (or file))
# (ps: the parameter-server workload on memory:// and on a Redis server and 3-shard cluster the bench starts)
set -o pipefail
source .gpu/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
STAGES="${STAGES-tests nccl dlrm bench}"  # set but empty: build/load only
t0=$(date +%s)
if [ -f .cuda_ext_xz/_lookup_cuda.so.xz ]; then  # a carried build (checked against the sources below)
  # Written beside and renamed over, only when it differs: a detached suite from the last call has
  # the library mapped, and rewriting that file in place killed it (v50: SIGBUS on its next launch).
  so="recom_rec/kernels/_lookup_cuda$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  if xz -dc .cuda_ext_xz/_lookup_cuda.so.xz > "$so.new"; then
    if cmp -s "$so.new" "$so"; then rm "$so.new"; else mv "$so.new" "$so"; fi
  else
    rm -f "$so.new"  # (a broken copy is not installed: the check below then builds)
  fi
fi
if ! python3 -m recom_rec.kernels.cuda_ext --installed; then
  python3 setup.py -q build_ext --inplace 2>&1 | grep "^recom_rec:\|error" | head -20
  python3 -m recom_rec.kernels.cuda_ext --installed && xz -T0 -c recom_rec/kernels/_lookup_cuda*.so > "$OUT/_lookup_cuda.so.xz"
fi
if [ -f .triton_cache_xz/triton_cache.tar.xz ]; then  # Triton's compiled kernels from an earlier machine
  # files already there are kept: a running suite may be reading them
  mkdir -p ~/.triton && tar xJf .triton_cache_xz/triton_cache.tar.xz -C ~ --skip-old-files 2>/dev/null
fi
echo "build/load $(( $(date +%s) - t0 )) s"
stage() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
# The stages' output without the stack's noise: warnings (fbgemm's compat table, FX tracing,
# autograd), their colour codes, blank lines and progress bars.
quiet() { grep -v "Warning\|warn\|WARNING\|^ *$\|\[33m\|\[0m\|compat\|cannot determine\|is_fx_tracing\|run_backward\|it/s\]"; }
SUITE=/tmp/gpu-suite  # the detached suite's pid and log (the machine keeps /tmp while warm)
suite_report() {
  cp "$SUITE/tests.log" "$OUT/tests.log"; tail -3 "$OUT/tests.log"
  if [ -f "$SUITE/resources.log" ]; then  # the first and the last tests' holdings, and the limit on mappings
    cp "$SUITE/resources.log" "$OUT/"; echo "vm.max_map_count $(cat /proc/sys/vm/max_map_count)"
    head -2 "$SUITE/resources.log"; tail -3 "$SUITE/resources.log"
    cp "$SUITE/resources.log.gc" "$OUT/" 2>/dev/null; echo "gc: $(sed 's/ *$//' "$SUITE/resources.log.gc" 2>/dev/null)"
  fi
  grep -E " (FAILED|ERROR)( |$)" "$OUT/tests.log" | head -40; grep -cE " PASSED( |$)" "$OUT/tests.log"
  # a crash: the test it happened in, the Python frames nearest to it, and the native ones
  grep -m1 -B1 "Fatal Python error" "$OUT/tests.log" | cut -c1-300
  grep -m1 -A8 "^Current thread" "$OUT/tests.log" | cut -c1-200
  # Inductor's generated modules in the crash's frames: what the compiled graph ran before the call
  grep -A60 "^Current thread" "$OUT/tests.log" | grep -o '/tmp/torchinductor_[^"]*\.py' | sort -u | head -4 |
    while read -r module; do mkdir -p "$OUT/inductor"; cp "$module" "$OUT/inductor/" 2>/dev/null; done
  grep -A40 "=== native backtrace" "$OUT/tests.log" | cut -c1-200
  # frames given as library(+offset): named by addr2line where the library has symbols
  grep -A40 "=== native backtrace" "$OUT/tests.log" | sed -n 's/^\(\/[^(]*\)(+\(0x[0-9a-f]*\)).*/\1 \2/p' |
    while read -r lib off; do
      command -v addr2line >/dev/null && echo "$(basename "$lib") $off: $(addr2line -f -C -e "$lib" "$off" 2>/dev/null | paste -sd' ')"
    done
}
suite_wait() {  # until the detached suite ends or $1 seconds pass
  local end=$(( $(date +%s) + $1 ))
  while kill -0 "$(cat $SUITE/pid)" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  if kill -0 "$(cat $SUITE/pid)" 2>/dev/null; then echo "suite still running: call again with STAGES=tests-wait"; fi
}
if [[ " $STAGES " == *" tests "* ]]; then
  stage tests
  # NATIVE_BACKTRACE=1: a crash prints its native frames too (tools/segv_backtrace.c); HEAP_CHECK=1:
  # glibc's checked malloc, which aborts where a corrupted heap block is next touched
  preload=()
  if [ -n "${NATIVE_BACKTRACE:-}" ] && gcc -shared -fPIC -O1 -o /tmp/segv_backtrace.so tools/segv_backtrace.c -ldl; then
    preload+=(/tmp/segv_backtrace.so)
  fi
  debug_malloc=$(ls /lib/x86_64-linux-gnu/libc_malloc_debug.so.0 /usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 2>/dev/null | head -1)
  if [ -n "${HEAP_CHECK:-}" ] && [ -n "$debug_malloc" ]; then
    preload+=("$debug_malloc"); export GLIBC_TUNABLES=glibc.malloc.check=3
  fi
  if [ ${#preload[@]} -gt 0 ]; then export LD_PRELOAD="${preload[*]}${LD_PRELOAD:+ $LD_PRELOAD}"; echo "LD_PRELOAD=$LD_PRELOAD"; fi
  # SUITE_CPUS (a taskset list, e.g. 0-15): the suite keeps to those cores, so that a benchmark run
  # beside it on another GPU and the other cores does not share its host (v52 shared it)
  pin=()
  if [ -n "${SUITE_CPUS:-}" ] && command -v taskset > /dev/null; then pin=(taskset -c "$SUITE_CPUS"); fi
  # -v: a line a test as it ends, so that a run the time limit stops still names what failed
  # --durations: the slowest tests, for planning the next call's split
  # -p no:benchmark: pytest-benchmark (installed on the GPU image, unused here) ends a crashing process
  # under segv_backtrace.so without faulthandler's Python frames (v52)
  args=(-m pytest -v -rfE --tb=short --durations=40 -p no:cacheprovider -p no:benchmark ${TESTS:-tests} ${TEST_K:+-k "$TEST_K"})
  if [ -n "${RESOURCE_LOG:-}" ]; then
    mkdir -p "$SUITE"; rm -f "$SUITE"/resources.log*
    export RESOURCE_LOG="$SUITE/resources.log" PYTHONPATH="$PWD/tools:$PYTHONPATH"; args+=(-p pytest_resources)
  fi
  if [ -n "${TEST_DETACH:-}" ]; then
    # The whole suite outlasts one device call: one process in a session of its own, which the
    # machine keeps while it stays warm; the next call's stage tests-wait awaits it (<30 s apart).
    mkdir -p "$SUITE"
    RECOM_TEST_DEVICE=cuda setsid "${pin[@]}" python3 "${args[@]}" > "$SUITE/tests.log" 2>&1 < /dev/null &
    echo $! > "$SUITE/pid"
    suite_wait ${TEST_TIMEOUT:-540}; suite_report
  else
    # SIGINT at the limit: pytest then stops as after Ctrl-C and still prints its summary and durations
    # (the log is written under $OUT as it runs: a call that outruns its own limit still returns it)
    mkdir -p "$SUITE"
    RECOM_TEST_DEVICE=cuda timeout -s INT -k 20 ${TEST_TIMEOUT:-540} "${pin[@]}" python3 "${args[@]}" 2>&1 | tee "$SUITE/tests.log" > "$OUT/tests.log"
    suite_report
  fi
fi
if [[ " $STAGES " == *" tests-wait "* ]]; then
  stage tests-wait
  suite_wait ${TEST_TIMEOUT:-540}; suite_report
fi
if [[ " $STAGES " == *" soak "* ]]; then
  stage soak  # serving under bad batches from 4 threads, PS training through a killed cluster master
  timeout ${SOAK_TIMEOUT:-420} python3 tools/soak.py ${SOAK_ARGS:-} 2>&1 | quiet > "$OUT/soak.log"
  grep -v "it/s\|s/s" "$OUT/soak.log" | tail -12
fi
if [[ " $STAGES " == *" nccl "* ]]; then
  stage nccl
  RECOM_TEST_DEVICE=cuda timeout ${NCCL_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -k nccl \
    tests/distributed/test_sharded_parity.py > "$OUT/nccl.log" 2>&1; tail -2 "$OUT/nccl.log"
  grep -E "checkpoint |Error|error" "$OUT/nccl.log" | grep -v Warning | head -8
fi
if [[ " $STAGES " == *" dlrm "* ]]; then
  stage sharded-dlrm
  timeout ${DLRM_TIMEOUT:-150} python3 -m recom_rec.bench --workloads sharded-dlrm --iters 20 --out "$OUT/dlrm" 2>&1 \
    | quiet | tail -8
fi
if [[ " $STAGES " == *" bench "* ]]; then
  stage bench
  timeout ${BENCH_TIMEOUT:-240} python3 -m recom_rec.bench --out /tmp/bench ${BENCH_ARGS:-} 2>&1 \
    | quiet \
    | tee "$OUT/bench.log" | tail -30; cp /tmp/bench.json "$OUT/" 2>/dev/null
fi
if [[ " $STAGES " == *" sweep "* ]]; then
  for run in $(seq 1 ${SWEEP_RUNS:-1}); do  # a second run shows whether the measured choices are stable
    name=sweep$([ $run = 1 ] || echo $run)
    stage $name
    timeout ${SWEEP_TIMEOUT:-300} python3 -m recom_rec.bench --workloads sweep --out "$OUT/$name" ${SWEEP_ARGS:---iters 20} 2>&1 \
      | quiet > "$OUT/$name.log"
    tail -6 "$OUT/$name.log"; [ $run = 1 ] || rm -f "$OUT/$name.png"
  done
  for run in $(seq 2 ${SWEEP_RUNS:-1}); do  # the stability report: choices and ratios, run 1 against run N
    stage "sweep-compare 1 vs $run"
    # the whole report to the log (a `tee | head` pipe would cut the log off where head stops)
    python3 -m recom_rec.bench --compare "$OUT/sweep.json" "$OUT/sweep$run.json" 2>&1 \
      | quiet > "$OUT/sweep-compare$run.log"
    head -40 "$OUT/sweep-compare$run.log"
  done
fi
if [[ " $STAGES " == *" ps "* ]]; then
  stage ps
  # redis://local and redis+cluster://local: the bench starts a server and a 3-shard cluster itself
  timeout ${PS_TIMEOUT:-360} python3 -m recom_rec.bench --workloads ps --ps-urls memory://bench \
    redis://local redis+cluster://local --out /tmp/ps 2>&1 | quiet \
    | tee "$OUT/ps.log" | tail -36; cp /tmp/ps.json "$OUT/" 2>/dev/null
fi
if [[ " $STAGES " == *" sequence "* ]]; then
  stage sequence  # EmbeddingCollection (and VBE): ours vs fbgemm's unpooled (VBE) TBE and torchrec's modules
  timeout ${SEQ_TIMEOUT:-300} python3 -m recom_rec.bench --workloads sequence vbe --out /tmp/sequence ${SEQ_ARGS:-} 2>&1 \
    | quiet | tee "$OUT/sequence.log" | tail -14; cp /tmp/sequence.json "$OUT/" 2>/dev/null
fi
if [[ " $STAGES " == *" random "* ]]; then
  # layouts drawn from one fresh seed (pooled, sequence, VBE), in two processes one after the
  # other: steady-state ratios against fbgemm and how far a second process moves them (issue 51)
  seed=${SEED:-$(( RANDOM * 32768 + RANDOM ))}
  for run in 1 2; do
    stage "random $run (seed $seed)"
    timeout ${RANDOM_TIMEOUT:-240} python3 -m recom_rec.bench --workloads random --random-count ${RANDOM_LAYOUTS:-8} \
      --seed $seed --peers recom_rec fbgemm --phases forward sgd --out "$OUT/random$run" 2>&1 \
      | quiet > "$OUT/random$run.log"
    grep "at or above\|padded" "$OUT/random$run.log"
  done
fi
if [[ " $STAGES " == *" serving "* ]]; then
  stage serving  # request streams of batch sizes 1-1024 (issue 51): latency percentiles, throughput, first 100 requests
  timeout ${SERVE_TIMEOUT:-420} python3 -m recom_rec.bench --workloads serving --out /tmp/serving ${SERVE_ARGS:-} 2>&1 \
    | quiet | tee "$OUT/serving.log" | tail -24; cp /tmp/serving.json "$OUT/" 2>/dev/null
fi
if [[ " $STAGES " == *" cold "* ]]; then
  stage cold  # each peer's first calls in a fresh process (issue 51); twice with RECOM_REC_CACHE: measure, then reuse
  export RECOM_REC_CACHE=/tmp/recom-cache
  seed=${SEED:-$(( RANDOM * 32768 + RANDOM ))}  # one fresh draw for both runs: the second reuses the first's decisions
  for run in 1 2; do
    # (the bench's own default, every training workload with 1000 calls a process, takes far longer
    # than a call: v49's two runs printed nothing in 150 s each; v53's 14 processes, ~12 s each,
    # outran a 170 s limit: 10 now, without fbgemm_unchecked, and each row printed as it ends)
    timeout ${COLD_TIMEOUT:-200} python3 -m recom_rec.bench --phases cold --out /tmp/cold$run --seed $seed \
      ${COLD_ARGS:---workloads random --random-count 1 --cold-calls 200 --peers recom_rec fbgemm torchrec} 2>&1 \
      | quiet | tee "$OUT/cold$run.log" | tail -12
  done
  unset RECOM_REC_CACHE
fi
if [[ " $STAGES " == *" prior "* ]]; then
  stage prior  # the tuners' decisions over the sweep and drawn layouts, recorded, then fitted into this GPU's prior (issue 51)
  export RECOM_REC_CACHE=/tmp/prior-cache RECOM_REC_PRIOR=off  # every candidate measured, as a prior is fitted from
  timeout ${PRIOR_SWEEP_TIMEOUT:-300} python3 -m recom_rec.bench --workloads sweep --out /tmp/prior-sweep --iters 5 2>&1 \
    | quiet > "$OUT/prior-sweep.log"; tail -2 "$OUT/prior-sweep.log"
  timeout ${PRIOR_RANDOM_TIMEOUT:-300} python3 -m recom_rec.bench --workloads random --random-count ${PRIOR_LAYOUTS:-16} \
    --random-kinds pooled --peers recom_rec --phases forward sgd --iters 5 --out /tmp/prior-random 2>&1 | quiet > "$OUT/prior-random.log"; tail -4 "$OUT/prior-random.log"
  arch=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}')")
  python3 -m recom_rec.kernels.decision_prior fit /tmp/prior-cache/decisions.json --arch "$arch" --out "$OUT/$arch.json"
  unset RECOM_REC_CACHE RECOM_REC_PRIOR
fi
if [[ " $STAGES " == *" quant "* ]]; then
  stage quant-tests  # quantized inference (issue 21): kernel and module against torchrec/fbgemm, serving
  RECOM_TEST_DEVICE=cuda timeout ${QTEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider \
    tests/test_quantized_lookup.py tests/test_quant_module.py tests/test_quant_serving.py > "$OUT/quant-tests.log" 2>&1
  tail -3 "$OUT/quant-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/quant-tests.log" | head
  stage inference
  timeout ${INFER_TIMEOUT:-300} python3 -m recom_rec.bench --phases inference --out /tmp/inference ${INFER_ARGS:-} 2>&1 \
    | quiet | tee "$OUT/inference.log" | tail -40
  cp /tmp/inference*.json "$OUT/" 2>/dev/null
  stage quant-auc
  timeout ${AUC_TIMEOUT:-200} python3 examples/dlrm_criteo.py --device cuda --quantize int8 int4 --out /tmp/dlrm-q 2>&1 \
    | quiet | tail -12 | tee "$OUT/quant-auc.log"
fi
if [[ " $STAGES " == *" psprof "* ]]; then
  stage psprof
  timeout ${PSPROF_TIMEOUT:-150} python3 tools/profile_ps.py --prefetch 1 --top 25 2>&1 \
    | quiet > "$OUT/psprof.log"; head -12 "$OUT/psprof.log"
fi
if [[ " $STAGES " == *" bwdvar "* ]]; then
  stage bwdvar  # backward kernel variants by nvcc alone (tools/backward_kernel_variants.py; --old-source F to carry)
  timeout ${BWDVAR_TIMEOUT:-300} python3 tools/backward_kernel_variants.py --out /tmp/bwdvar ${BWDVAR_ARGS:-} \
    > "$OUT/bwdvar.log" 2>&1; tail -40 "$OUT/bwdvar.log"
fi
if [[ " $STAGES " == *" profile "* ]]; then
  stage profile
  timeout ${PROFILE_TIMEOUT:-150} python3 tools/profile_step.py ${PROFILE_ARGS:---workloads many-1000 many-500 --backends auto} 2>&1 \
    | quiet > "$OUT/profile.log"; grep -A8 "^==" "$OUT/profile.log"
fi
if [[ " $STAGES " == *" asan "* ]]; then
  stage asan  # the PS host library under ASan with CUDA tensors: ps_cuda.c's paths, which the CPU's run misses
  PY=python3 TRITON_INTERPRET=0 RECOM_TEST_DEVICE=cuda PYTHONMALLOC=malloc ASAN_LOGS="$OUT/asan" \
    timeout -s INT -k 20 ${ASAN_TIMEOUT:-240} bash tools/asan_ps.sh ${ASAN_TESTS:-tests/ps} 2>&1 | quiet > "$OUT/asan.log"
  tail -15 "$OUT/asan.log"
fi
if [ -n "${SAVE_TRITON_CACHE:-}" ]; then  # for .triton_cache_xz/: the next machine skips these compiles
  (cd ~ && tar cf - .triton/cache | xz -T0 -3 > "$OUT/triton_cache.tar.xz")
fi
stage done
