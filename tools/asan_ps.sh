#!/usr/bin/env bash
# The parameter-server host library (csrc/ps) under AddressSanitizer, on the CPU: builds it with
# -fsanitize=address into recom_rec/ps/_host*.so (carrying the sources' hash, so the loader takes
# it as the install-time build), runs pytest with libasan preloaded, and puts the usual build back
# afterwards. An ASan report aborts the process; the reports go to $ASAN_LOGS/asan.<pid> (the
# workers a test spawns included).
#
#   bash tools/asan_ps.sh                        # tests/ps
#   bash tools/asan_ps.sh tests/ps tests/distributed/test_ps_placement.py
#   PYTHONMALLOC=malloc RECOM_REC_PS_THREADS=4 bash tools/asan_ps.sh tests/ps
#   PY=python3 TRITON_INTERPRET=0 RECOM_TEST_DEVICE=cuda bash tools/asan_ps.sh   # the GPU's ops (ps_cuda.c)
#
# PYTHONMALLOC=malloc makes Python's own small allocations (ctypes structs such as a staging Job)
# plain mallocs that ASan watches; torch and numpy buffers are watched either way. libstdc++ is
# preloaded beside libasan: without it ASan's __cxa_throw interceptor aborts at the first C++
# exception (TorchScript throws some while it infers types).
set -o pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
ASAN_LOGS="${ASAN_LOGS:-/tmp/recom_rec-asan}"
mkdir -p "$ASAN_LOGS"
suffix=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
target="recom_rec/ps/_host$suffix"
read -r sha flags sources < <("$PY" - <<'EOF'
import pathlib, runpy
s = runpy.run_path("recom_rec/native_build.py")
print(s["ps_sha256"](pathlib.Path("csrc")), ",".join(s["PS_CFLAGS"]),
      ",".join("csrc/ps/" + n for n in s["PS_SOURCES"]))
EOF
)
backup=""
if [ -f "$target" ]; then
  backup="$(mktemp)"
  cp -p "$target" "$backup"
fi
restore() {
  if [ -n "$backup" ]; then mv -f "$backup" "$target"; else rm -f "$target"; fi
}
trap restore EXIT
# a new inode (rm first): a process that has the old library loaded keeps its mapping intact
rm -f "$target"
gcc ${flags//,/ } -fsanitize=address -fno-omit-frame-pointer -g -DRECOM_REC_SOURCES_SHA256="$sha" -shared \
  -o "$target" ${sources//,/ } -ldl || exit 1
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
# protect_shadow_gap=0: the CUDA driver maps memory where ASan would otherwise reserve its shadow gap
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:symbolize=1:protect_shadow_gap=0:log_path=$ASAN_LOGS/asan}"
export TRITON_INTERPRET="${TRITON_INTERPRET-1}"  # on a GPU (RECOM_TEST_DEVICE=cuda) pass TRITON_INTERPRET=0
"$PY" -c "from recom_rec.ps import host_lib; print('recom_rec: under ASan:', host_lib.where())" || exit 1
"$PY" -m pytest -q -p no:cacheprovider "${@:-tests/ps}"
rc=$?
if ls "$ASAN_LOGS"/asan.* >/dev/null 2>&1; then
  echo "ASan reports in $ASAN_LOGS:"; grep -h "ERROR: AddressSanitizer" "$ASAN_LOGS"/asan.* | sort | uniq -c
fi
exit $rc
