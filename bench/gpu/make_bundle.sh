#!/usr/bin/env bash
# Builds the GPU run's binaries HERE (Bazel, --config=cuda) and
# gathers them, with the shared libraries a GPU machine lacks, into a bundle
# folder that the device tool carries (nothing is compiled on the GPU
# machine). bench/gpu/device_run.sh runs the bundle there.
#
#   bench/gpu/make_bundle.sh                # -> .gpu_bundle/ (git-ignored)
#   BUNDLE=/tmp/b bench/gpu/make_bundle.sh
#
# What the GPU machine is expected to have (and so is NOT bundled): glibc,
# libstdc++/libgcc_s, the NVIDIA driver (libcuda), and a Python whose pip
# torch is the one pinned here (LibTorch and the nvidia-* wheels beside it:
# cudart, NCCL, cuBLAS, ...). device_run.sh checks that version there before
# it runs a binary. Everything else the binaries load (Abseil, glog, gflags,
# GoogleTest from Debian) is copied into <bundle>/lib.
#
# Writes <bundle>/MANIFEST (torch version, binaries, copied libraries, each
# binary's libraries and where each is expected on the GPU machine) and fails
# when the bundle is over BUNDLE_LIMIT_MB (default 48: the carried tree must
# stay under the device tool's 64 MiB with the working tree).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUNDLE="${BUNDLE:-$ROOT/.gpu_bundle}"
LIMIT_MB="${BUNDLE_LIMIT_MB:-48}"
# label -> path under bazel-bin
TARGETS=(
  "//bench/gpu:gpt_gpu_bench=bench/gpu/gpt_gpu_bench"
  "//tests/comm:nccl_communicator_test=tests/comm/nccl_communicator_test"
  "//tests/cuda:cuda_fixes_test=tests/cuda/cuda_fixes_test"
  "//tests/cuda:multi_gpu_test=tests/cuda/multi_gpu_test"
  "//examples/gpt:train=examples/gpt/train"
)
cd "$ROOT"

labels=()
for t in "${TARGETS[@]}"; do labels+=("${t%%=*}"); done
echo "== build (--config=cuda): ${labels[*]}"
tools/bazel build --config=ci --config=cuda "${labels[@]}"
BIN_DIR="$(tools/bazel info --config=ci --config=cuda bazel-bin 2>/dev/null)"

PY="$ROOT/.deps/venv/bin/python"
SITE="$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
# Where a library comes from on the GPU machine: "site:<path under site-packages>"
# (the pip torch and its nvidia-* wheels), "system" (glibc, libstdc++, the
# driver), or "bundle" (copied here).
origin_of() {
  local path name
  path="$(readlink -f "$1")"  # Bazel's solib and external/ links lead into the venv
  name="$(basename "$1")"
  if [[ "$path" == "$SITE"/* ]]; then
    echo "site:${path#"$SITE"/}"
    return
  fi
  case "$name" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | \
      libutil.so* | libresolv.so* | libstdc++.so* | libgcc_s.so* | libcuda.so* | libnvidia-*.so*)
      echo system ;;
    *) echo bundle ;;
  esac
}

{
  echo "# ShardTrain GPU bundle, made $(date -u '+%Y-%m-%d %H:%M UTC') at $(git rev-parse --short HEAD)"
  echo "torch_version=$TORCH_VERSION"
  echo "python_site=$SITE"
} >"$BUNDLE/MANIFEST"

for t in "${TARGETS[@]}"; do
  rel="${t#*=}"
  name="$(basename "$rel")"
  cp "$BIN_DIR/$rel" "$BUNDLE/bin/$name"
  chmod u+w "$BUNDLE/bin/$name"
  strip --strip-debug "$BUNDLE/bin/$name"
  echo "binary=$name" >>"$BUNDLE/MANIFEST"
  # ldd of the built binary (its Bazel RUNPATH resolves here).
  while read -r lib _ path _; do
    [[ "$path" == /* ]] || continue
    where="$(origin_of "$path")"
    echo "needs=$name $lib $where" >>"$BUNDLE/MANIFEST"
    if [[ "$where" == bundle && ! -e "$BUNDLE/lib/$lib" ]]; then
      cp -L "$path" "$BUNDLE/lib/$lib"
      chmod u+w "$BUNDLE/lib/$lib"
      strip --strip-debug "$BUNDLE/lib/$lib" 2>/dev/null || true
    fi
  done < <(ldd "$BIN_DIR/$rel" | grep '=>')
done

# The Trainer item's data and CPU reference curves (bench/gpu/trainer_curves.py),
# computed here with the bundled binary on the CPU: the toolkit's stub libcuda
# lets it start without a driver.
mkdir -p "$BUNDLE/trainer"
head -c 200000 docs/scaling.md >"$BUNDLE/trainer/corpus.txt"
STUB_DIR="$(mktemp -d)"
ln -s "${CUDA_HOME:-/usr/local/cuda}/lib64/stubs/libcuda.so" "$STUB_DIR/libcuda.so.1"
LIBS="$BUNDLE/lib:$SITE/torch/lib"
for d in "$SITE"/nvidia/*/lib; do [[ -d "$d" ]] && LIBS="$LIBS:$d"; done
echo "== CPU reference curves of the Trainer (32-true, bf16-mixed, 16-mixed)"
LD_LIBRARY_PATH="$LIBS:$STUB_DIR" "$PY" bench/gpu/trainer_curves.py record --train "$BUNDLE/bin/train" \
  --data "$BUNDLE/trainer/corpus.txt" --device cpu --out "$BUNDLE/trainer/cpu_curves.json"
rm -rf "$STUB_DIR"

size_kb="$(du -sk "$BUNDLE" | cut -f1)"
echo "size_kb=$size_kb" >>"$BUNDLE/MANIFEST"
echo "== bundle $BUNDLE: $((size_kb / 1024)) MiB, torch $TORCH_VERSION"
ls -la "$BUNDLE/bin" "$BUNDLE/lib"
if ((size_kb > LIMIT_MB * 1024)); then
  echo "make_bundle.sh: error: the bundle is $((size_kb / 1024)) MiB, over BUNDLE_LIMIT_MB=$LIMIT_MB" >&2
  exit 1
fi
