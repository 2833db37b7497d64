# The memory benches' setup (sourced by run.sh and async_save.sh): ROOT, PY,
# the memory_bench binary BIN (built), the model flags MODEL and its LABEL
# (SIZE=small: a 2-layer model for a quick check), and WORK with RESULTS.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.deps/venv/bin/python"
tools/bazel build --config=ci //bench/memory:memory_bench >&2
BIN="$ROOT/bazel-bin/bench/memory/memory_bench"
if [[ "${SIZE:-}" == small ]]; then
  LABEL=small; MODEL=(--n_layer=2 --n_embd=64 --n_head=2)
else
  LABEL=gpt-201.7M; MODEL=(--n_layer=16 --n_embd=1024 --n_head=16)
fi
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$WORK"
RESULTS="$WORK/results.jsonl"
: > "$RESULTS"
