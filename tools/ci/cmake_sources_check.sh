#!/usr/bin/env bash
# Checks that bench/gpu/CMakeLists.txt (the fallback build of the GPU
# binaries on a machine without Bazel) compiles every source file of this
# repository that Bazel links into the same binaries, so it cannot go stale
# unseen: a .cc added to a dependency of //bench/gpu:gpt_gpu_bench or
# //tests/comm:nccl_communicator_test must appear there (by path, or under a
# folder it globs). Exit 1 naming each missing file. Cheap: one bazel query.
#
#   tools/ci/cmake_sources_check.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
CMAKE="bench/gpu/CMakeLists.txt"
TARGETS="//bench/gpu:gpt_gpu_bench + //tests/comm:nccl_communicator_test"

# This repository's .cc files the targets depend on (query ignores
# target_compatible_with, so no --config=cuda is needed).
mapfile -t bazel_srcs < <(tools/bazel query --noshow_progress \
  "kind('source file', deps($TARGETS)) intersect //...:*" 2>/dev/null |
  grep '\.cc$' | sed -e 's|^//||' -e 's|:|/|' -e 's|^/||')
((${#bazel_srcs[@]} > 0)) || { echo "cmake_sources_check: bazel query found no sources" >&2; exit 1; }

# What CMakeLists.txt names: "${ST_ROOT}/path.cc", and folders it globs ("${ST_ROOT}/dir/*.cc").
listed="$(grep -o '\${ST_ROOT}/[A-Za-z0-9_/.*-]*\.cc' "$CMAKE" | sed 's|^\${ST_ROOT}/||')"
listed="$listed
$(grep -o '\${CMAKE_CURRENT_SOURCE_DIR}/[A-Za-z0-9_/.-]*\.cc' "$CMAKE" | sed 's|^\${CMAKE_CURRENT_SOURCE_DIR}/|bench/gpu/|')"
missing=()
for src in "${bazel_srcs[@]}"; do
  found=0
  while read -r entry; do
    [[ -z "$entry" ]] && continue
    if [[ "$entry" == *'*'* ]]; then
      # shellcheck disable=SC2053
      [[ "$src" == $entry && "$(dirname "$src")" == "$(dirname "$entry")" ]] && found=1
    else
      [[ "$src" == "$entry" ]] && found=1
    fi
    ((found)) && break
  done <<<"$listed"
  ((found)) || missing+=("$src")
done
if ((${#missing[@]})); then
  echo "cmake_sources_check: $CMAKE lacks ${#missing[@]} source file(s) that Bazel links into $TARGETS:" >&2
  printf '  %s\n' "${missing[@]}" >&2
  echo "add each to the CMake library that mirrors its Bazel target" >&2
  exit 1
fi
echo "cmake_sources_check: $CMAKE names all ${#bazel_srcs[@]} source files Bazel links into $TARGETS"
