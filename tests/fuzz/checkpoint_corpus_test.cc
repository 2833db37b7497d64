// The checkpoint readers against the fuzz seed corpus (tests/fuzz/corpus, the
// inputs libFuzzer starts from and what it found worth keeping) and against
// truncations and byte flips of valid files made here: each input is either
// read or rejected with shardtrain::Error, never a crash or another exception
// (built with gcc as part of //...; tools/fuzz/run_checkpoint_fuzzer.sh runs
// the same entry point under libFuzzer + ASan).
//
// SHARDTRAIN_WRITE_CORPUS=DIR writes the valid seeds and their variants into
// DIR instead (how tests/fuzz/corpus was made).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include "tests/fuzz/checkpoint_readers_fuzz.h"
#include "trainer/checkpoint_io/checkpoint.h"

namespace shardtrain::fuzz {
namespace {
namespace fs = std::filesystem;

// Variants of a valid input: truncations and single-byte changes spread over the file.
std::vector<std::pair<std::string, std::vector<uint8_t>>> Variants(const Seed& seed, size_t count) {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> out;
  const size_t n = seed.bytes.size();
  for (size_t i = 0; i < count; ++i) {
    const size_t cut = 1 + (n - 1) * i / count;
    out.push_back({seed.name + "_truncated_" + std::to_string(cut),
                   std::vector<uint8_t>(seed.bytes.begin(), seed.bytes.begin() + static_cast<long>(cut))});
    std::vector<uint8_t> flipped = seed.bytes;
    const size_t at = 1 + (n - 2) * i / count;
    flipped[at] ^= static_cast<uint8_t>(0x5a + i);
    out.push_back({seed.name + "_flipped_" + std::to_string(at), std::move(flipped)});
  }
  return out;
}

TEST(CheckpointCorpus, ValidSeedsAreRead) {
  const auto seeds = ValidSeeds();
  ASSERT_EQ(seeds.size(), static_cast<size_t>(kNumReaders));
  for (const auto& s : seeds) EXPECT_TRUE(FuzzCheckpointReaders(s.bytes.data(), s.bytes.size())) << s.name;
}

// Each corpus file is read or rejected as recorded in tests/fuzz/corpus_outcomes.txt
// ("<file> read|rejected", recorded before the pickle pre-pass came in, so
// that it changes no file's fate). SHARDTRAIN_WRITE_OUTCOMES=PATH writes the
// outcomes seen to PATH instead of comparing.
TEST(CheckpointCorpus, CheckedInCorpusIsReadOrRejectedAsRecorded) {
  const fs::path dir = "tests/fuzz/corpus";
  ASSERT_TRUE(fs::is_directory(dir)) << "no " << dir << " in the runfiles";
  std::map<std::string, std::string> recorded;
  std::ifstream table("tests/fuzz/corpus_outcomes.txt");
  for (std::string name, outcome; table >> name >> outcome;) recorded[name] = outcome;
  const char* write = std::getenv("SHARDTRAIN_WRITE_OUTCOMES");
  std::ofstream out;
  if (write) out.open(write);
  std::vector<fs::path> paths;
  for (const auto& e : fs::directory_iterator(dir)) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  for (const auto& path : paths) {
    std::ifstream in(path, std::ios::binary);
    std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const std::string name = path.filename().string();
    std::string outcome = "threw";
    try {
      outcome = FuzzCheckpointReaders(bytes.data(), bytes.size()) ? "read" : "rejected";
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": a reader threw something other than shardtrain::Error: " << e.what();
    }
    if (write) {
      out << name << " " << outcome << "\n";
    } else {
      EXPECT_EQ(outcome, recorded.count(name) ? recorded[name] : "(not recorded)") << name;
    }
  }
  EXPECT_GE(paths.size(), 8u);
}

// A full checkpoint of format 1 (an earlier release's layout: "hparams" as
// strings, "optimizer_full" by name) still loads, its values typed.
TEST(CheckpointCorpus, FormatOneFullCheckpointLoads) {
  std::ifstream in("tests/fuzz/corpus/v1_full_checkpoint", std::ios::binary);
  std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  ASSERT_GT(bytes.size(), 1u);
  const fs::path file = fs::path(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") / "v1.ckpt";
  std::ofstream(file, std::ios::binary).write(bytes.data() + 1, static_cast<std::streamsize>(bytes.size() - 1));
  const trainer::CheckpointData d = trainer::LoadCheckpoint(file.string());  // the seed less its reader byte
  EXPECT_TRUE(d.legacy_layout);
  EXPECT_EQ(d.global_step, 12);
  EXPECT_EQ(d.batch_in_epoch, 2);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.strategy, "fsdp_native");
  EXPECT_TRUE(d.hparams.at("lr") == trainer::StateValue(0.001));
  EXPECT_TRUE(d.hparams.at("model") == trainer::StateValue("mlp"));
  EXPECT_EQ(d.optimizer_full.kind, "Adam");
  EXPECT_EQ(d.optimizer_full.step.at("fc.weight"), 12);
  EXPECT_TRUE(d.optimizer_full.state.at("fc.weight").at("exp_avg_sq").equal(at::ones({2, 3})));
  EXPECT_TRUE(d.callbacks.at("ModelCheckpoint").at("best_model_path") == trainer::StateValue("x.ckpt"));
}

TEST(CheckpointCorpus, TruncatedAndFlippedFilesAreReadOrRejected) {
  int rejected = 0, total = 0;
  for (const auto& seed : ValidSeeds()) {
    for (const auto& [name, bytes] : Variants(seed, 40)) {
      ++total;
      try {
        rejected += FuzzCheckpointReaders(bytes.data(), bytes.size()) ? 0 : 1;
      } catch (const std::exception& e) {
        ADD_FAILURE() << name << ": a reader threw something other than shardtrain::Error: " << e.what();
      }
    }
  }
  // Every truncation breaks the zip directory at the end: at least those are rejected.
  EXPECT_GE(rejected, total / 2) << rejected << " of " << total << " variants rejected";
}

}  // namespace
}  // namespace shardtrain::fuzz

int main(int argc, char** argv) {
  if (const char* out = std::getenv("SHARDTRAIN_WRITE_CORPUS")) {
    namespace fs = std::filesystem;
    fs::create_directories(out);
    for (const auto& seed : shardtrain::fuzz::ValidSeeds()) {
      std::vector<std::pair<std::string, std::vector<uint8_t>>> files = {{seed.name, seed.bytes}};
      for (auto& v : shardtrain::fuzz::Variants(seed, 3)) files.push_back(std::move(v));
      for (const auto& [name, bytes] : files) {
        std::ofstream(fs::path(out) / name, std::ios::binary)
            .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
      }
    }
    return 0;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
