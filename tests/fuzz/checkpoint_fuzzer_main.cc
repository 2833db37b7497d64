// libFuzzer entry point (clang -fsanitize=fuzzer; tools/fuzz/run_checkpoint_fuzzer.sh).
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/checkpoint_readers_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardtrain::fuzz::FuzzCheckpointReaders(data, size);
  return 0;
}
