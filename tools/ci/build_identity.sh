# Sourced by tools/bazel (and tools/ci/cache_invalidation.sh).
# shardtrain_build_identity ROOT exports what the build's outputs depend on but
# Bazel does not hash, each as a short text without any path:
#   SHARDTRAIN_TORCH_STAMP  the LibTorch build: its version.py (version, git
#                           revision, CUDA variant) or build-version/build-hash,
#                           plus the bootstrap's stamp. It also re-runs LibTorch
#                           discovery (the repository rule's `environ`).
#   SHARDTRAIN_CC_ID        the compiler ($CC or gcc), the linker and the C library,
#                           by their full (Debian) versions: Bazel's autodetected
#                           toolchain names /usr/bin/gcc and gcc's include
#                           directories, which do not change on a compiler update.
#   SHARDTRAIN_CUDA_ID      the CUDA toolkit at ${CUDA_HOME:-/usr/local/cuda}
#                           (CUDART_VERSION and nvcc's build line), or "none".
# .bazelrc passes them to every action (--action_env), so a change of any of them
# changes every action key: cache misses, never stale hits.
shardtrain_build_identity() {
  local root="$1" torch_files cc cuda
  if [[ -n "${LIBTORCH_HOME:-}" ]]; then
    torch_files=("$LIBTORCH_HOME"/version.py "$LIBTORCH_HOME"/build-version "$LIBTORCH_HOME"/build-hash)
  else
    torch_files=("$root"/.deps/venv/.shardtrain-torch-* "$root"/.deps/venv/lib/python3*/site-packages/torch/version.py)
  fi
  SHARDTRAIN_TORCH_STAMP="$(cat "${torch_files[@]}" 2>/dev/null | md5sum | cut -c1-12)"
  cc="${CC:-gcc}"
  SHARDTRAIN_CC_ID="$({ "$cc" -v 2>&1 | tail -n1; ld -v 2>&1 | sed -n 1p; ldd --version 2>&1 | sed -n 1p; } | tr '\n' ';')"
  cuda="${CUDA_HOME:-/usr/local/cuda}"
  if [[ -f "$cuda/include/cuda_runtime_api.h" ]]; then
    SHARDTRAIN_CUDA_ID="$({ grep -m1 'define CUDART_VERSION' "$cuda/include/cuda_runtime_api.h"; "$cuda/bin/nvcc" --version 2>/dev/null | tail -n1; } | tr -s ' \n' ' ')"
  else
    SHARDTRAIN_CUDA_ID=none
  fi
  export SHARDTRAIN_TORCH_STAMP SHARDTRAIN_CC_ID SHARDTRAIN_CUDA_ID
}
