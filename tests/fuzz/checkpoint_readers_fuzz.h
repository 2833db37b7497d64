// One fuzz entry point for ShardTrain's checkpoint readers, shared by the
// libFuzzer target (checkpoint_fuzzer_main.cc, built with clang by
// tools/fuzz/run_checkpoint_fuzzer.sh) and the gcc-built corpus replay test
// (checkpoint_corpus_test.cc, part of //...).
//
// An input's first byte picks the reader, the rest are the bytes of a file:
//   0  MapArchive (trainer/checkpoint_io/archive.h): any torch.save-format zip archive
//   1  LoadCheckpoint (trainer/checkpoint_io/checkpoint.h): a full checkpoint
//   2  LoadShardedCheckpoint: the bytes are <dir>/metadata.pt, next to a
//      valid rank_0.pt and COMPLETE
//   3  LoadShardedCheckpoint + ConsolidateShardedCheckpoint: the bytes are
//      <dir>/rank_0.pt, next to valid metadata.pt and COMPLETE
//   4  MapArchive, 5 LoadCheckpoint: the bytes are the pickle (data.pkl) of
//      a full checkpoint whose tensor records are kept, zipped with valid
//      CRCs (a random change to a zip's data.pkl only fails its CRC check;
//      this reaches the unpickler and the checks after it)
//   6  OpenDcpCheckpoint + ConsolidateDcpCheckpoint (trainer/checkpoint_io/
//      dcp_checkpoint.h): the bytes are <dir>/.metadata (PyTorch DCP's
//      pickle, read by trainer/checkpoint_io/py_pickle.h), next to a valid
//      __0_0.distcp and meta.pt
//   7  the same: the bytes are <dir>/__0_0.distcp (torch.save archives back
//      to back), next to a valid .metadata and meta.pt
//   8  SafetensorsFile (trainer/checkpoint_io/safetensors.h): a Hugging Face
//      safetensors file, every tensor read
//   9  ParseLlamaConfig (examples/llama/llama_config.h): a config.json, its
//      parameter count and exported text read back
//  10  HfWeights (examples/llama/hf_checkpoint.h): the bytes are
//      model.safetensors.index.json beside two valid weight files, every
//      tensor it names read
//  11  LoadByteLevelBpe (examples/llama/tokenizer.h): the bytes are a byte-level
//      BPE tokenizer.json; a fixed text (special tokens, multilingual) is
//      encoded and decoded with it
//  12  ChatTemplate (examples/llama/chat_template.h): the bytes are a Jinja chat
//      template, parsed and applied to a fixed four-turn conversation
// Every tensor a reader returns is read in full (as a caller would), so a
// tensor that claims more bytes than its record holds is found. A reader may
// only succeed or throw shardtrain::Error; any other exception escapes.
#ifndef SHARDTRAIN_TESTS_FUZZ_CHECKPOINT_READERS_FUZZ_H_
#define SHARDTRAIN_TESTS_FUZZ_CHECKPOINT_READERS_FUZZ_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::fuzz {

inline constexpr int kNumReaders = 13;

// Runs the reader `data[0] % kNumReaders` on data[1..]. Returns true when the
// reader accepted the input, false when it threw shardtrain::Error.
bool FuzzCheckpointReaders(const uint8_t* data, size_t size);

// The seed inputs: for each reader a valid file written by the real writers
// (SaveCheckpoint, SaveShardedCheckpoint, the DCP writers), with the
// selector byte in front.
struct Seed {
  std::string name;
  std::vector<uint8_t> bytes;
};
std::vector<Seed> ValidSeeds();

}  // namespace shardtrain::fuzz

#endif  // SHARDTRAIN_TESTS_FUZZ_CHECKPOINT_READERS_FUZZ_H_
