#!/usr/bin/env bash
# Builds the csrc FFI extension with Bazel (Debian's bazel-bootstrap 4.2.3, offline
# once the packages are installed) and prints the library's path on the last line:
#   JAXTDIST_BAZEL_LIB=$(bash .ci/bazel.sh | tail -1)
# Progress goes to stderr. Env: JAXTDIST_BAZEL_CLEAN=1 runs `bazel clean --expunge`
# first; JAXTDIST_BAZEL_KEEP_SERVER=1 leaves the Bazel server running.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TARGET=//csrc:_jaxtdist_ffi.so
PKGS=(bazel-bootstrap bazel-rules-cc bazel-rules-java)
log() { echo "[bazel.sh] $*" >&2; }

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  command -v apt-get >/dev/null || { log "need ${missing[*]} but apt-get is unavailable"; exit 1; }
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  log "installing ${missing[*]} with apt"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >&2
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
command -v bazel >/dev/null || { log "bazel is not on PATH after installing ${PKGS[*]}"; exit 1; }
# The Bazel rule takes pybind11's headers from the Python it runs; README command 1
# builds csrc in pip's isolated build environment, so pybind11 may be absent here.
PY=${PYTHON_BIN_PATH:-${JAXTDIST_PYTHON:-python3}}
"$PY" -c "import pybind11" 2>/dev/null || { log "installing pybind11 (headers for the Bazel build)"; "$PY" -m pip install -q "pybind11>=2.11" >&2; }

if [[ "${JAXTDIST_BAZEL_CLEAN:-0}" == 1 ]]; then
  log "bazel clean --expunge"
  bazel clean --expunge >&2 2>&1 || true
fi

start=$(date +%s.%N)
bazel build "$TARGET" >&2
end=$(date +%s.%N)
log "bazel build $TARGET took $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }') s"

lib=$(readlink -f bazel-bin/csrc/_jaxtdist_ffi.so)
[[ -f "$lib" ]] || { log "built library not found at bazel-bin/csrc/_jaxtdist_ffi.so"; exit 1; }
[[ "${JAXTDIST_BAZEL_KEEP_SERVER:-0}" == 1 ]] || bazel shutdown >&2 2>&1 || true
echo "$lib"
