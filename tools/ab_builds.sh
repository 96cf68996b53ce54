#!/usr/bin/env bash
# Two builds of the package measured against each other in alternating processes on one GPU
# (docs/perf-notes.md's method: the baseline in the same run, on the same card). A kernel change
# needs its own build, and the loader rebuilds any build whose sources differ, so the base runs
# from a copy of its own tree with its own build.
#
# Here (this checkout, no GPU):
#   bash tools/ab_builds.sh prepare [COMMIT] [BUILD_XZ]
#     COMMIT's recom_rec/, csrc/, tools/ and setup.py (default HEAD) into .ab_base/ (git-ignored,
#     ~3 MB), beside BUILD_XZ (default .cuda_ext_xz/_lookup_cuda.so.xz: the CUDA build of COMMIT's
#     sources, as tools/gpu_session.sh returns it).
# On the GPU machine (device tool, carry [".gpu", ".ab_base"]; where that passes the 64 MiB the tool
# carries, leave out .gpu/redis, which no ab run needs: [".gpu/setup.sh", ".gpu/whl",
# ".gpu/fbgemm-sm90.tar.xz", ".ab_base"]):
#   ROUNDS=2 AB_TIMEOUT=120 bash tools/ab_builds.sh run python3 tools/gather_ceiling.py --dims 16 --ids 50
#     builds the working tree in place (tools/gpu_session.sh, ~3 min), then runs the command from
#     each tree in turn, base first, ROUNDS times: $OUT/ab-base-N.log and $OUT/ab-new-N.log.
set -o pipefail
case "$1" in
  prepare)
    commit="${2:-HEAD}"; build="${3:-.cuda_ext_xz/_lookup_cuda.so.xz}"
    [ -f "$build" ] || { echo "no build at $build" >&2; exit 1; }
    rm -rf .ab_base && mkdir .ab_base
    git archive "$commit" recom_rec csrc tools setup.py | tar -x -C .ab_base
    cp "$build" .ab_base/_lookup_cuda.so.xz
    echo ".ab_base/: $(git rev-parse --short "$commit") and its build ($(du -sh .ab_base | cut -f1))" ;;
  run)
    shift
    source .gpu/setup.sh
    export PYTHONUNBUFFERED=1
    OUT="${OUT:-out}"; mkdir -p "$OUT"
    new="$PWD"; base="$PWD/.ab_base"
    suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    xz -dc "$base/_lookup_cuda.so.xz" > "$base/recom_rec/kernels/_lookup_cuda$suffix"
    (cd "$base" && PYTHONPATH="$base:$PYTHONPATH" python3 -m recom_rec.kernels.cuda_ext --installed) \
      || { echo "the base's build is not the build of its sources" >&2; exit 1; }
    OUT="$OUT" STAGES="" bash tools/gpu_session.sh | grep "build/load"
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for side in base new; do
        tree=$([ $side = base ] && echo "$base" || echo "$new")
        (cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" timeout "${AB_TIMEOUT:-120}" "$@") > "$OUT/ab-$side-$round.log" 2>&1
        echo "round $round $side: exit $?, $(wc -l < "$OUT/ab-$side-$round.log") lines"
      done
    done ;;
  *)
    sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
