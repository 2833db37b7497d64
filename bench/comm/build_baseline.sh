#!/usr/bin/env bash
# Builds comm_bench against comm/gloo_communicator.cc as of git revision REV
# (default eec0c67, the GlooCommunicator before its W=2 fast path), for the
# "before" column of bench/comm/run.sh --baseline-rev. Plain g++ against the
# venv's LibTorch, outside Bazel, so the working tree is never touched.
#
#   bench/comm/build_baseline.sh OUTPUT_BINARY [REV]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUTBIN="$1"
REV="${2:-eec0c67}"
cd "$ROOT"
TORCH="$(ls -d "$ROOT"/.deps/venv/lib/python3*/site-packages/torch | head -1)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
git show "$REV:comm/gloo_communicator.cc" >"$WORK/gloo_communicator_baseline.cc"
FLAGS=(-std=c++20 -O2 -g0 -D_GLIBCXX_USE_CXX11_ABI=1 -DUSE_DISTRIBUTED -DUSE_C10D_GLOO -I"$ROOT"
       -isystem "$TORCH/include" -isystem "$TORCH/include/torch/csrc/api/include")
pids=()
for f in comm/communicator.cc comm/rendezvous.cc "$WORK/gloo_communicator_baseline.cc" bench/comm/comm_bench.cc; do
  g++ "${FLAGS[@]}" -c "$f" -o "$WORK/$(basename "$f" .cc).o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
g++ -o "$OUTBIN" "$WORK"/*.o -L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -ltorch -ltorch_cpu -lc10 -lgflags -lglog -lpthread
echo "built $OUTBIN (comm/gloo_communicator.cc at $REV)"
