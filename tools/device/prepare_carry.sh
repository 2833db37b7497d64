#!/usr/bin/env bash
# Builds what a one-shot run on a lent machine (no Bazel, no network, a Python
# with the same torch 2.11 wheel) needs, and copies it into .devcarry/ (an
# ignored folder: pass it as `carry` to the device tool):
#
#   .devcarry/bin/memory_bench            bench/memory's ShardTrain side
#   .devcarry/nccl_communicator_test      only with the argument `nccl` (--config=cuda)
#   .devcarry/lib/                        every shared library they need that is
#                                         not torch's, nvidia's or glibc's
#                                         (glog, gflags, unwind, crypto, lzma, ...)
#   .devcarry/lib-fallback/               libstdc++ and libgcc_s, put LAST on the
#                                         library path (only used where the
#                                         machine has none)
#   .devcarry/MANIFEST                    what was built from which commit
#
#   tools/device/prepare_carry.sh          # memory_bench only
#   tools/device/prepare_carry.sh nccl     # and tests/comm:nccl_communicator_test
#
# Then: bench/memory/device_run.sh on the lent machine (see its header).
# Fails when the folder exceeds CARRY_MAX_MIB (default 50; the device tool
# carries at most 64 MiB with the working tree).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
CARRY="$ROOT/.devcarry"
MAX_MIB="${CARRY_MAX_MIB:-50}"
WANT_NCCL=0
for a in "$@"; do
  case "$a" in
    nccl) WANT_NCCL=1 ;;
    *) echo "prepare_carry.sh: unknown argument '$a' (valid: nccl)" >&2; exit 2 ;;
  esac
done

# The folder must stay out of git (worktrees share the main repository's exclude file).
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.devcarry/' "$EXCLUDE" 2>/dev/null || echo '/.devcarry/' >> "$EXCLUDE"

rm -rf "$CARRY"
mkdir -p "$CARRY/bin" "$CARRY/lib" "$CARRY/lib-fallback"

tools/bazel build --config=ci //bench/memory:memory_bench
install -m 755 "$(readlink -f bazel-bin/bench/memory/memory_bench)" "$CARRY/bin/memory_bench"
BINS=("$CARRY/bin/memory_bench")
if (( WANT_NCCL )); then
  tools/bazel build --config=ci --config=cuda //tests/comm:nccl_communicator_test
  install -m 755 "$(readlink -f bazel-bin/tests/comm/nccl_communicator_test)" "$CARRY/nccl_communicator_test"
  BINS+=("$CARRY/nccl_communicator_test")
fi

# Libraries the machine provides: torch's (torch/lib), nvidia's wheels, glibc.
provided() {
  case "$1" in
    libtorch*|libc10*|libshm*|libgomp*|libcaffe2*) return 0 ;;
    libcuda.so*|libcu*|libnv*|libnccl*|libcudnn*|libcusparse*|libcufft*|libcurand*|libcublas*|libnvshmem*) return 0 ;;
    libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|linux-vdso*|libutil.so*|libresolv.so*) return 0 ;;
    libstdc++*|libgcc_s*) return 0 ;;  # lib-fallback/, last on the path
  esac
  return 1
}

TORCH_LIB="$(.deps/venv/bin/python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
SITE="$(dirname "$(dirname "$TORCH_LIB")")"
LIBPATH="$TORCH_LIB$(for d in "$SITE"/nvidia/*/lib; do printf ':%s' "$d"; done)"
for bin in "${BINS[@]}"; do
  while read -r name _ path _; do
    [[ -n "$name" ]] || continue
    provided "$name" && continue  # (libcuda.so.1, the driver's, may be "not found" here)
    if [[ "$path" == "not" ]]; then
      echo "prepare_carry.sh: $bin needs $name, which is not found here" >&2; exit 1
    fi
    [[ -f "$path" ]] || continue
    cp -L "$path" "$CARRY/lib/$name"
  done < <(LD_LIBRARY_PATH="$LIBPATH" ldd "$bin" | awk '/=>/ {print $1, $2, $3, $4}')
done
for lib in libstdc++.so.6 libgcc_s.so.1; do
  p="$(LD_LIBRARY_PATH="$LIBPATH" ldd "$CARRY/bin/memory_bench" | awk -v n="$lib" '$1 == n {print $3}')"
  [[ -n "$p" ]] && cp -L "$p" "$CARRY/lib-fallback/$lib"
done
chmod u+w "$CARRY"/bin/* "$CARRY"/lib/* "$CARRY"/lib-fallback/* 2>/dev/null || true

size_mib() { du -sm "$CARRY" | cut -f1; }
if (( $(size_mib) > MAX_MIB )); then
  echo "prepare_carry.sh: $(size_mib) MiB > ${MAX_MIB} MiB; stripping" >&2
  strip --strip-unneeded "$CARRY"/bin/* "$CARRY"/nccl_communicator_test "$CARRY"/lib/*.so* 2>/dev/null || true
fi
{
  echo "built $(date -u +%FT%TZ) on $(hostname) from $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.devcarry' || echo '+dirty')"
  echo "torch $(.deps/venv/bin/python -c 'import torch; print(torch.__version__)')"
  (cd "$CARRY" && find . -type f ! -name MANIFEST -printf '%P %s\n' | sort)
} > "$CARRY/MANIFEST"
cat "$CARRY/MANIFEST"
total="$(size_mib)"
if (( total > MAX_MIB )); then
  echo "prepare_carry.sh: .devcarry is ${total} MiB, more than ${MAX_MIB} MiB even stripped" >&2
  exit 1
fi
echo "prepare_carry.sh: .devcarry ready, ${total} MiB" >&2
