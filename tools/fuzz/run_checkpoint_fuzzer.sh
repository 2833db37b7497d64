#!/usr/bin/env bash
# Builds the checkpoint-reader fuzz target (tests/fuzz/checkpoint_readers_fuzz.h)
# with Debian's clang and libFuzzer + AddressSanitizer against the venv's
# LibTorch (not instrumented: coverage and ASan cover ShardTrain's readers
# and whatever they allocate), then fuzzes for a bounded time.
#
#   tools/fuzz/run_checkpoint_fuzzer.sh [SECONDS]      (default 60; CI uses 60)
#
# Starts from the checked-in seed corpus tests/fuzz/corpus (read-only here);
# the growing corpus and any crash/oom/leak reproducer go to
# $SHARDTRAIN_FUZZ_DIR (default ~/.cache/shardtrain/fuzz), outside the clone.
# Limits: inputs up to 64 KiB, and one allocation or the process's RSS past
# 256 MiB / 2 GiB counts as a finding (an input that makes a reader allocate
# far beyond its own size). Exit status: 0 when nothing was found, else
# libFuzzer's (the reproducer's path is printed; replay it with
# `$SHARDTRAIN_FUZZ_DIR/checkpoint_fuzzer FILE`).
# Needs: clang-14 and libclang-rt-14-dev (tools/bootstrap.sh installs them).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SECONDS_TO_RUN="${1:-60}"
WORK="${SHARDTRAIN_FUZZ_DIR:-$HOME/.cache/shardtrain/fuzz}"
CXX="${SHARDTRAIN_FUZZ_CXX:-$(command -v clang++-14 || command -v clang++ || true)}"
[[ -n "$CXX" ]] || { echo "run_checkpoint_fuzzer: no clang++ (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 1; }
TORCH="$(cd "$ROOT/.deps/venv/lib/"python3*/site-packages/torch && pwd)" ||
  { echo "run_checkpoint_fuzzer: no torch under $ROOT/.deps/venv (run tools/bootstrap.sh)" >&2; exit 1; }
# Which C++ ABI LibTorch was built with (as third_party/libtorch.bzl decides; grep -c, not
# grep -q: an early exit would fail nm with SIGPIPE under pipefail).
ABI=1
[[ "$(nm -D --defined-only "$TORCH/lib/libc10.so" | grep -c __cxx11 || true)" != 0 ]] || ABI=0

SRCS=(trainer/checkpoint_io/archive.cc trainer/checkpoint_io/pickle_scan.cc trainer/checkpoint_io/checkpoint.cc
      trainer/checkpoint_io/checkpoint_legacy.cc trainer/checkpoint_io/layout.cc trainer/checkpoint_io/state_value.cc
      trainer/optim/grad_scaler.cc trainer/optim/lr_scheduler.cc trainer/optim/lr_scheduler_stateful.cc base/numbers.cc
      trainer/checkpoint_io/sharded_checkpoint.cc trainer/checkpoint_io/sharded_checkpoint_consolidate.cc
      trainer/checkpoint_io/py_pickle.cc trainer/checkpoint_io/dcp.cc trainer/checkpoint_io/dcp_checkpoint.cc
      trainer/checkpoint_io/safetensors.cc trainer/checkpoint_io/zip_writer.cc
      base/file_util.cc sharding/sharded_state.cc sharding/shard_layout.cc
      examples/llama/llama_config.cc examples/llama/hf_checkpoint.cc
      examples/llama/bpe_tokenizer.cc examples/llama/chat_template.cc examples/llama/jinja_lex.cc
      examples/llama/jinja_parse.cc examples/llama/jinja_eval.cc examples/llama/jinja_builtins.cc
      examples/llama/jinja_values.cc
      tests/fuzz/checkpoint_readers_fuzz.cc tests/fuzz/checkpoint_fuzzer_main.cc)
FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -D_GLIBCXX_USE_CXX11_ABI=$ABI -I"$ROOT" -isystem "$TORCH/include" -isystem "$TORCH/include/torch/csrc/api/include")
mkdir -p "$WORK/obj" "$WORK/corpus" "$WORK/artifacts"
cd "$ROOT"
t0=$SECONDS
objs=()
pids=()
# The flags an object was built with sit next to it: other flags (or ABI) rebuild it.
stamp="$(echo "$CXX ${FLAGS[*]}" | md5sum | cut -c1-12)"
for src in "${SRCS[@]}"; do
  obj="$WORK/obj/$(echo "$src" | tr / _).$stamp.o"
  objs+=("$obj")
  # Rebuild when the source or any header of this repository it includes changed (in parallel).
  if [[ ! -f "$obj" || -n "$(find "$src" trainer tests/fuzz base/errors.h -name '*.h' -newer "$obj" -o -path "$src" -newer "$obj" | head -1)" ]]; then
    echo "[fuzz] compiling $src"
    "$CXX" "${FLAGS[@]}" -c "$src" -o "$obj" &
    pids+=($!)
  fi
done
for pid in "${pids[@]+"${pids[@]}"}"; do wait "$pid"; done
"$CXX" "${FLAGS[@]}" "${objs[@]}" -L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -ltorch_cpu -lc10 -lisal \
  -lpcre2-8 -licuuc -o "$WORK/checkpoint_fuzzer"
echo "[fuzz] built $WORK/checkpoint_fuzzer in $((SECONDS - t0)) s"

# LibTorch keeps process-wide caches alive to the end: leak checks would name
# them, not the readers (see tools/ci/sanitizers/lsan.supp for the sanitizer runs).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export OMP_NUM_THREADS=1
t1=$SECONDS
set +e
"$WORK/checkpoint_fuzzer" "$WORK/corpus" "$ROOT/tests/fuzz/corpus" \
  -max_total_time="$SECONDS_TO_RUN" -max_len=65536 -timeout=10 -malloc_limit_mb="${SHARDTRAIN_FUZZ_MALLOC_LIMIT_MB:-256}" -rss_limit_mb=2048 \
  -artifact_prefix="$WORK/artifacts/" -print_final_stats=1 2>&1 | tee "$WORK/last_run.log" | grep -vE '^#[0-9]+.*(NEW|REDUCE)'
rc=${PIPESTATUS[0]}
set -e
execs="$(grep -E '^stat::number_of_executed_units' "$WORK/last_run.log" | awk '{print $2}')"
persec="$(grep -E '^stat::average_exec_per_sec' "$WORK/last_run.log" | awk '{print $2}')"
echo "[fuzz] ran $((SECONDS - t1)) s: ${execs:-?} inputs, ${persec:-?} execs/s, corpus $(ls "$WORK/corpus" | wc -l) files; exit $rc"
exit "$rc"
