// trainer/checkpoint_io/safetensors.h: round trips of every dtype a Llama
// checkpoint uses (and the rest), element ranges, unaligned tensors, and a
// clear error naming the file, the tensor and the fault for each kind of
// malformed header.
#include "trainer/checkpoint_io/safetensors.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "base/errors.h"
#include "tests/testing/counting_allocator.h"
#include "trainer/checkpoint_io/archive.h"

namespace shardtrain::trainer {
namespace {

namespace fs = std::filesystem;

std::string Dir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  fs::path p = fs::path(t ? t : fs::temp_directory_path().string()) / ("safetensors_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

void Write(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata = {}) {
  std::vector<SafetensorsEntry> layout;
  for (const auto& [name, t] : tensors) {
    SafetensorsEntry e;
    e.name = name;
    e.dtype = t.scalar_type();
    e.shape = t.sizes().vec();
    layout.push_back(e);
  }
  WriteSafetensors(
      path, layout, [&](size_t i) { return tensors[i].second; }, metadata);
}

// A file of an 8-byte length, `header` and `data` bytes.
std::string RawFile(const std::string& name, const std::string& header, size_t data_bytes, int64_t length = -1) {
  const std::string path = Dir(name) + "/m.safetensors";
  std::ofstream out(path, std::ios::binary);
  uint64_t n = length < 0 ? header.size() : static_cast<uint64_t>(length);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << std::string(data_bytes, '\0');
  return path;
}

// Opening `path` throws a shardtrain::Error whose message holds each of `parts`.
void ExpectError(const std::string& path, std::initializer_list<std::string> parts) {
  try {
    SafetensorsFile f(path);
    ADD_FAILURE() << path << " opened";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
  }
}

TEST(SafetensorsTest, EveryDtypeRoundTripsAsViewsOfTheFile) {
  const std::string path = Dir("roundtrip") + "/model.safetensors";
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"model.embed_tokens.weight", at::randn({5, 3})},
      {"model.norm.weight", at::randn({3}).to(at::kBFloat16)},
      {"lm_head.weight", at::randn({2, 3}).to(at::kHalf)},
      {"f64", at::randn({2}, at::kDouble)},
      {"i64", at::arange(4, at::kLong)},
      {"i32", at::arange(3, at::kInt)},
      {"u8", at::arange(5, at::kByte)},
      {"mask", at::arange(5).remainder(2) == 0},
      {"scalar", at::tensor(2.5f)},
      {"empty", at::empty({0, 4})},
  };
  Write(path, tensors, {{"format", "pt"}});
  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  ASSERT_EQ(f.entries().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const at::Tensor got = f.Tensor(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), t.sizes()) << name;
    EXPECT_TRUE(at::equal(got, t)) << name;
  }
  // The 8-byte length + header is padded to 8, so every tensor here is
  // aligned and a view: writing into it leaves the file alone.
  at::Tensor w = f.Tensor("model.embed_tokens.weight");
  w.fill_(7);
  EXPECT_TRUE(at::equal(SafetensorsFile(path).Tensor("model.embed_tokens.weight"), tensors[0].second));
}

// Tensors and ranges are views of the mapping: reading 4 MiB allocates nothing like it.
TEST(SafetensorsTest, ReadingAllocatesNoCopy) {
  testing::InstallCountingCpuAllocator();
  const std::string path = Dir("nocopy") + "/big.safetensors";
  Write(path, {{"big", at::arange(1 << 20, at::kFloat)}});
  SafetensorsFile f(path);
  const int64_t base = testing::LiveCpuBytesOfThisThread();
  testing::ResetPeakCpuBytesOfThisThread();
  const float sum = f.Tensor("big").sum().item<float>() + f.Range("big", 10, 1000).sum().item<float>();
  EXPECT_GT(sum, 0);
  EXPECT_LE(testing::PeakCpuBytesOfThisThread() - base, 64 << 10);
}

TEST(SafetensorsTest, RangesReadElementsInRowMajorOrder) {
  const std::string path = Dir("range") + "/r.safetensors";
  const at::Tensor w = at::arange(24, at::kFloat).view({4, 6});
  Write(path, {{"w", w}});
  SafetensorsFile f(path);
  EXPECT_TRUE(at::equal(f.Range("w", 5, 8), at::arange(5, 13, at::kFloat)));
  EXPECT_EQ(f.Range("w", 24, 0).numel(), 0);
  EXPECT_THROW(f.Range("w", 20, 5), InvalidArgumentError);
  EXPECT_THROW(f.Range("w", -1, 2), InvalidArgumentError);
  try {
    f.Tensor("v");
    ADD_FAILURE() << "no error for a missing tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no tensor 'v'"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsTest, UnalignedTensorsAreCopied) {
  // 3 bytes of U8 first: the F32 that follows starts at an odd offset.
  const std::string path = Dir("unaligned") + "/u.safetensors";
  const at::Tensor f32 = at::randn({7});
  Write(path, {{"a", at::arange(3, at::kByte)}, {"b", f32}});
  SafetensorsFile f(path);
  const at::Tensor b = f.Tensor("b");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data_ptr()) % alignof(float), 0u) << "an unaligned view was handed out";
  EXPECT_TRUE(at::equal(b, f32));
  EXPECT_TRUE(at::equal(f.Range("b", 2, 3), f32.narrow(0, 2, 3)));
}

TEST(SafetensorsTest, MalformedHeadersNameTheFileTheTensorAndTheFault) {
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  {
    const std::string path = Dir("short") + "/s.safetensors";
    std::ofstream(path, std::ios::binary) << "abc";
    ExpectError(path, {"3 bytes", "too short"});
  }
  ExpectError(RawFile("beyond", ok, 8, 1 << 20), {"header length says 1048576", "truncated"});
  ExpectError(RawFile("json", "{\"w\": [", 0), {"not valid JSON"});
  ExpectError(RawFile("array", "[1, 2]", 0), {"array, not an object"});
  ExpectError(RawFile("dtype", R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,8]}})", 8),
              {"tensor 'w'", "dtype 'F4' is not supported", "BF16"});
  ExpectError(RawFile("shape", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
              {"tensor 'w'", "not a list of sizes"});
  ExpectError(RawFile("bytes", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
              {"tensor 'w'", "needs 12 bytes", "hold 8"});
  ExpectError(RawFile("offsets", R"({"w":{"dtype":"F32","shape":[2]}})", 8), {"tensor 'w'", "data_offsets"});
  ExpectError(RawFile("reversed", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
              {"tensor 'w'", "end before they begin"});
  ExpectError(RawFile("truncated", ok, 5), {"tensor 'w'", "data section has 5 bytes", "truncated"});
  ExpectError(RawFile("overlap",
                      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      8),
              {"tensor 'b'", "overlaps tensor 'a'"});
  ExpectError(RawFile("gap", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
              {"before tensor 'w'", "gap"});
  ExpectError(RawFile("trailing", ok, 12), {"has 12 bytes", "cover 8"});
  ExpectError(RawFile("metadata", R"({"__metadata__":{"format":1}})", 0), {"__metadata__", "format"});
  ExpectError(Dir("missing") + "/none.safetensors", {"cannot open"});
}

TEST(SafetensorsTest, TheWriterChecksWhatItIsGivenAndLeavesNoFileOnError) {
  const std::string path = Dir("writer") + "/w.safetensors";
  SafetensorsEntry e;
  e.name = "w";
  e.dtype = at::kFloat;
  e.shape = {2, 2};
  EXPECT_THROW(WriteSafetensors(path, {e}, [](size_t) { return at::zeros({3}); }), InvalidArgumentError);
  EXPECT_THROW(WriteSafetensors(path, {e, e}, [](size_t) { return at::zeros({2, 2}); }), InvalidArgumentError);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(fs::path(path).parent_path())) << "a temporary file was left";
  e.dtype = at::kComplexFloat;
  EXPECT_THROW(WriteSafetensors(path, {e},
                                [](size_t) {
                                  return at::zeros({2, 2}, at::kComplexFloat);
                                }),
               InvalidArgumentError);
}

// SafetensorsWriter: tensors in any order land where the header says (the
// file equals WriteSafetensors' of the same tensors, byte for byte); a tensor
// missing at Commit, written twice or of another shape is an error, and a
// writer dropped uncommitted leaves neither the file nor a temporary.
TEST(SafetensorsTest, TheOutOfOrderWriterPlacesEachTensorAtItsOffset) {
  const std::string dir = Dir("out_of_order");
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"a", at::randn({3, 5})}, {"b", at::arange(7, at::kLong)}, {"c", at::randn({4}).to(at::kBFloat16)}};
  Write(dir + "/in_order.safetensors", tensors, {{"format", "pt"}});
  std::vector<SafetensorsEntry> layout;
  for (const auto& [name, t] : tensors) {
    SafetensorsEntry e;
    e.name = name;
    e.dtype = t.scalar_type();
    e.shape = t.sizes().vec();
    layout.push_back(e);
  }
  {
    SafetensorsWriter w(dir + "/any_order.safetensors", layout, {{"format", "pt"}});
    w.Write("c", tensors[2].second.to(at::kFloat));  // converted to the entry's dtype
    w.Write("a", tensors[0].second);
    EXPECT_THROW(w.Write("a", tensors[0].second), InvalidArgumentError);
    EXPECT_THROW(w.Write("b", at::arange(6, at::kLong)), InvalidArgumentError);
    EXPECT_THROW(w.Write("d", tensors[0].second), InvalidArgumentError);
    EXPECT_THROW(w.Commit(), InvalidArgumentError);  // "b" never written
    w.Write("b", tensors[1].second);
    w.Commit();
  }
  auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes(dir + "/any_order.safetensors"), bytes(dir + "/in_order.safetensors"));
  {
    SafetensorsWriter dropped(dir + "/dropped.safetensors", layout);
    dropped.Write("a", tensors[0].second);
  }
  EXPECT_FALSE(fs::exists(dir + "/dropped.safetensors"));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 2u) << "a temporary file was left";
}

}  // namespace

// archive_test's modes for tests/trainer/safetensors_python_test.sh (Python's
// safetensors is the oracle). Writes the same tensors as a safetensors file
// and as a torch.save archive.
int SafetensorsWriteFixture(const std::string& st, const std::string& pt) {
  at::manual_seed(5);
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"model.embed_tokens.weight", at::randn({11, 8})},
      {"model.layers.0.self_attn.q_proj.weight", at::randn({8, 8}).to(at::kBFloat16)},
      {"model.layers.0.self_attn.k_proj.bias", at::randn({4}).to(at::kHalf)},
      {"model.norm.weight", at::randn({8}, at::kDouble)},
      {"ids", at::arange(-3, 6, at::kLong).reshape({3, 3})},
      {"i32", at::arange(5, at::kInt)},
      {"bytes", at::arange(7, at::kByte)},
      {"mask", at::rand({5}) > 0.5},
      {"scalar", at::tensor(1.25f)},
      {"empty", at::empty({0, 3})},
  };
  Write(st, tensors, {{"format", "pt"}, {"producer", "shardtrain"}});
  ArchiveWriter w(pt);
  c10::Dict<std::string, at::Tensor> root;
  for (const auto& [name, t] : tensors) root.insert(name, w.Add(t));
  w.Finish(root);
  return 0;
}

// Every tensor of the torch.save archive `pt` (a dict) is in the safetensors
// file `st` with the same dtype, shape and bytes, and nothing else is.
int SafetensorsCompare(const std::string& st, const std::string& pt) {
  SafetensorsFile f(st);
  const c10::Dict<c10::IValue, c10::IValue> expected = MapArchive(pt).toGenericDict();
  int bad = 0;
  for (const auto& item : expected) {
    const std::string name = item.key().toStringRef();
    const at::Tensor want = item.value().toTensor();
    if (!f.Has(name)) {
      std::fprintf(stderr, "%s: no tensor '%s'\n", st.c_str(), name.c_str());
      ++bad;
      continue;
    }
    const at::Tensor got = f.Tensor(name);
    if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes() || !at::equal(got, want)) {
      std::fprintf(stderr, "%s: tensor '%s' differs (%s %s vs %s %s)\n", st.c_str(), name.c_str(),
                   c10::toString(got.scalar_type()), c10::str(got.sizes()).c_str(), c10::toString(want.scalar_type()),
                   c10::str(want.sizes()).c_str());
      ++bad;
    }
  }
  if (f.entries().size() != expected.size()) {
    std::fprintf(stderr, "%s: %zu tensors, expected %zu\n", st.c_str(), f.entries().size(), expected.size());
    ++bad;
  }
  std::printf("%s: %zu tensors compared, %d differ; metadata:", st.c_str(), expected.size(), bad);
  for (const auto& [k, v] : f.metadata()) std::printf(" %s=%s", k.c_str(), v.c_str());
  std::printf("\n");
  return bad == 0 ? 0 : 1;
}

}  // namespace shardtrain::trainer
