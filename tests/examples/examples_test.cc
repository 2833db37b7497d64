// The example programs' pieces: the IDX reader (gzip and plain, malformed
// files), Fashion-MNIST loading and its missing-data message, and the shared
// helpers (key=value lists, --ckpt_path=last, user paths).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/errors.h"
#include "examples/common/example_util.h"
#include "examples/fashion_mnist/fashion_mnist.h"
#include "examples/fashion_mnist/idx.h"

namespace shardtrain::examples {
namespace {
namespace fs = std::filesystem;

std::string TmpDir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  fs::path p = fs::path(t ? t : "/tmp") / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string IdxBytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data, uint8_t type = 0x08) {
  std::string s = {0, 0, static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  s.append(data.begin(), data.end());
  return s;
}

void WritePlain(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void WriteGz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(f);
}

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "";
}

TEST(Idx, ReadsGzipAndPlainFiles) {
  const std::string dir = TmpDir("idx");
  std::vector<uint8_t> data(2 * 3 * 4);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7);
  const std::string bytes = IdxBytes({2, 3, 4}, data);
  WritePlain(dir + "/a", bytes);
  WriteGz(dir + "/a.gz", bytes);
  for (const std::string name : {"a", "a.gz"}) {
    SCOPED_TRACE(name);
    at::Tensor t = ReadIdxFile(dir + "/" + name, 3);
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, 3, 4}));
    EXPECT_EQ(t.scalar_type(), at::kByte);
    EXPECT_EQ(t[1][2][3].item<int64_t>(), static_cast<int64_t>(data[23]));
  }
}

TEST(Idx, MalformedFilesNameThePathAndTheProblem) {
  const std::string dir = TmpDir("idx_bad");
  const std::string good = IdxBytes({4}, {1, 2, 3, 4});
  WriteGz(dir + "/truncated.gz", good.substr(0, good.size() - 1));
  WritePlain(dir + "/trailing", good + "x");
  WritePlain(dir + "/magic", "\x01\x02\x08\x01");
  WritePlain(dir + "/float", IdxBytes({1}, {0, 0, 0, 0}, 0x0D));
  WritePlain(dir + "/empty", "");
  EXPECT_NE(ErrorOf([&] { ReadIdxFile(dir + "/truncated.gz"); }).find("truncated"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { ReadIdxFile(dir + "/trailing"); }).find("trailing data"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { ReadIdxFile(dir + "/magic"); }).find("not an IDX file"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { ReadIdxFile(dir + "/float"); }).find("only unsigned bytes"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { ReadIdxFile(dir + "/empty"); }).find("empty or truncated"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { ReadIdxFile(dir + "/trailing", 3); }).find("expected 3"), std::string::npos);
  const std::string missing = ErrorOf([&] { ReadIdxFile(dir + "/nope"); });
  EXPECT_NE(missing.find(dir + "/nope"), std::string::npos) << missing;
}

TEST(FashionMnist, LoadsADirectoryAndNormalizesBatches) {
  const std::string dir = TmpDir("fmnist");
  std::vector<uint8_t> pixels(3 * 28 * 28, 0);
  pixels[28 * 28] = 255;  // image 1, pixel (0, 0)
  WriteGz(dir + "/t10k-images-idx3-ubyte.gz", IdxBytes({3, 28, 28}, pixels));
  WritePlain(dir + "/t10k-labels-idx1-ubyte", IdxBytes({3}, {9, 0, 4}));
  FashionMnist test = FashionMnist::Load(dir, "test");
  EXPECT_EQ(test.size(), 3);
  trainer::Batch b = test.get_batch({2, 1});
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{2, 1, 28, 28}));
  EXPECT_EQ(b.inputs.scalar_type(), at::kFloat);
  EXPECT_EQ(b.targets.scalar_type(), at::kLong);
  EXPECT_EQ(b.targets[0].item<int64_t>(), 4);
  EXPECT_EQ(b.targets[1].item<int64_t>(), 0);
  EXPECT_NEAR(b.inputs[1][0][0][0].item<double>(), (1.0 - FashionMnist::kMean) / FashionMnist::kStd, 1e-5);
  EXPECT_NEAR(b.inputs[0][0][0][0].item<double>(), -FashionMnist::kMean / FashionMnist::kStd, 1e-5);
  // Labels that do not match the images in number.
  WritePlain(dir + "/t10k-labels-idx1-ubyte", IdxBytes({2}, {1, 2}));
  EXPECT_NE(ErrorOf([&] { FashionMnist::Load(dir, "test"); }).find("3 images"), std::string::npos);
}

TEST(FashionMnist, MissingDataSaysWhichPackageAndFlag) {
  const std::string empty = TmpDir("fmnist_empty");
  for (const std::string& dir : {empty, empty + "/does-not-exist"}) {
    const std::string msg = ErrorOf([&] { FashionMnist::Load(dir, "train", "--data_dir"); });
    EXPECT_NE(msg.find("dataset-fashion-mnist"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--data_dir"), std::string::npos) << msg;
    EXPECT_NE(msg.find(dir), std::string::npos) << msg;
  }
  EXPECT_NE(ErrorOf([&] { FashionMnist::Load(empty, "validation"); }).find("valid: train, test"), std::string::npos);
}

TEST(ExampleUtil, KeyValueLists) {
  EXPECT_TRUE(ParseKeyValueList("", "--x").empty());
  auto m = ParseKeyValueList(" sharding_strategy=SHARD_GRAD_OP, cpu_offload = true,,auto_wrap_policy=type:A,B=1", "--x");
  // "B=1" is its own entry: values cannot contain commas.
  EXPECT_EQ(m.size(), 4u);
  EXPECT_EQ(m.at("sharding_strategy"), "SHARD_GRAD_OP");
  EXPECT_EQ(m.at("cpu_offload"), "true");
  EXPECT_EQ(m.at("auto_wrap_policy"), "type:A");
  EXPECT_NE(ErrorOf([] { ParseKeyValueList("a=1,oops", "--strategy_options"); }).find("--strategy_options: 'oops'"),
            std::string::npos);
  EXPECT_NE(ErrorOf([] { ParseKeyValueList("=1", "--x"); }).find("not key=value"), std::string::npos);
}

TEST(ExampleUtil, CheckpointPathLastPicksTheNewestVersionWithACheckpoint) {
  const std::string root = TmpDir("ckpt_last");
  EXPECT_NE(ErrorOf([&] { ResolveCheckpointPath("last", root); }).find("no "), std::string::npos);
  for (const std::string v : {"version_2", "version_10"}) {
    fs::create_directories(fs::path(root) / "lightning_logs" / v / "checkpoints");
    WritePlain((fs::path(root) / "lightning_logs" / v / "checkpoints" / "last.ckpt").string(), "x");
  }
  fs::create_directories(fs::path(root) / "lightning_logs" / "version_11");  // a run without checkpoint yet
  fs::create_directories(fs::path(root) / "lightning_logs" / "version_x");
  EXPECT_EQ(ResolveCheckpointPath("last", root),
            (fs::path(root) / "lightning_logs" / "version_10" / "checkpoints" / "last.ckpt").string());
  EXPECT_EQ(ResolveCheckpointPath("", root), "");
  EXPECT_NE(ErrorOf([&] { ResolveCheckpointPath(root + "/missing.ckpt", root); }).find("no such checkpoint"),
            std::string::npos);
}

TEST(ExampleUtil, UserPathsAreAbsolute) {
  EXPECT_EQ(UserPath(""), "");
  EXPECT_EQ(UserPath("/a/b/../c/"), "/a/c");
  ::setenv("BUILD_WORKING_DIRECTORY", "/work/here", 1);
  EXPECT_EQ(UserPath("data/x.txt"), "/work/here/data/x.txt");
  EXPECT_EQ(UserPath("."), "/work/here");
  ::unsetenv("BUILD_WORKING_DIRECTORY");
  EXPECT_EQ(UserPath("rel"), (fs::current_path() / "rel").string());
}

}  // namespace
}  // namespace shardtrain::examples
