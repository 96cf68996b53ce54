#!/usr/bin/env bash
# Device-side investigation (not a benchmark): where the backward's piece kernel spends its
# instructions and stalls, per line of csrc/lookup/kernels.cuh, from Nsight Compute's source
# counters. Builds tools/backward_kernel_bench.cu with -lineinfo, profiles one piece_kernel launch
# per layout, and writes per layout: the instruction mix and stall sections ($OUT/ncu-<i>.txt) and
# the SASS table with its source lines ($OUT/ncu-<i>-sass.csv; tools/ncu_lines.py sums it by line).
#   bash tools/ncu_piece_lines.sh "16 100000 256 4096 200 0 0" "16 100000 256 4096 50 1 0"
set -o pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
exe=/tmp/piece_bench_lineinfo
nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90,code=sm_90 -Xptxas=-v \
  -DKERNEL_SOURCE="\"$PWD/csrc/lookup/kernels.cuh\"" tools/backward_kernel_bench.cu -o $exe 2> "$OUT/ptxas.txt" || {
  tail -20 "$OUT/ptxas.txt"; exit 1; }
i=0
for layout in "$@"; do
  i=$((i + 1))
  echo "== layout $i: $layout: $($exe $layout 5)"
  ncu --clock-control none --kernel-name regex:piece_kernel --launch-skip 1 --launch-count 1 --import-source yes \
    --section SourceCounters --section InstructionStats --section WarpStateStats --section SpeedOfLight \
    -o /tmp/piece_$i -f $exe $layout 2 > /dev/null 2>&1
  ncu --import /tmp/piece_$i.ncu-rep --page details > "$OUT/ncu-$i.txt" 2>&1
  ncu --import /tmp/piece_$i.ncu-rep --page source --csv --print-source cuda,sass > "$OUT/ncu-$i-sass.csv" 2>&1 \
    || ncu --import /tmp/piece_$i.ncu-rep --page source --csv > "$OUT/ncu-$i-sass.csv" 2>&1
  grep -E "Duration|Executed Ipc|Issued Warp|Warp Cycles Per Issued" "$OUT/ncu-$i.txt" | head -6
  wc -c "$OUT/ncu-$i-sass.csv"; head -c 600 "$OUT/ncu-$i-sass.csv"; echo
done
