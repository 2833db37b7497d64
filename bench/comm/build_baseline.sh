#!/usr/bin/env bash
# Builds comm_bench against ShardTrain's comm/ library as of git revision REV
# (default eec0c67, the GlooCommunicator before its W=2 fast paths), for the
# "before" column of bench/comm/run.sh --baseline-rev. Plain g++ against the
# venv's LibTorch, outside Bazel, so the working tree is never touched. comm/'s
# headers and sources come from REV; bench/comm/comm_bench.cc is today's, so it
# must only use API that REV already had.
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
mkdir -p "$WORK/src/comm"
for f in communicator.h communicator.cc errors.h gloo_communicator.h gloo_communicator.cc rendezvous.h rendezvous.cc; do
  git show "$REV:comm/$f" >"$WORK/src/comm/$f"
done
# REV's comm/ first on the include path; the rest (none today) from the working tree.
FLAGS=(-std=c++20 -O2 -g0 -D_GLIBCXX_USE_CXX11_ABI=1 -DUSE_DISTRIBUTED -DUSE_C10D_GLOO -I"$WORK/src" -I"$ROOT"
       -isystem "$TORCH/include" -isystem "$TORCH/include/torch/csrc/api/include")
pids=()
for f in "$WORK"/src/comm/communicator.cc "$WORK"/src/comm/rendezvous.cc "$WORK"/src/comm/gloo_communicator.cc \
         bench/comm/comm_bench.cc; do
  g++ "${FLAGS[@]}" -c "$f" -o "$WORK/$(basename "$f" .cc).o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
g++ -o "$OUTBIN" "$WORK"/*.o -L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -ltorch -ltorch_cpu -lc10 -lgflags -lglog -lpthread
echo "built $OUTBIN (comm/ at $REV)"
