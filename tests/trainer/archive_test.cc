// trainer/checkpoint_io/archive.h: ArchiveWriter and MapArchive.
//
// Also a fixture writer for archive_python_test:
//   archive_test write <path>   writes the nested archive Python checks.
//   archive_test zip <dir>      writes zip_fixture.h's archives: {direct,plain}{,_zip64}.zip
#include "trainer/checkpoint_io/archive.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "base/errors.h"
#include "tests/testing/counting_allocator.h"
#include "tests/trainer/zip_fixture.h"

namespace shardtrain::trainer {
namespace {
namespace fs = std::filesystem;

// Tensor k of the fixture: arange * (k + 1) in the given dtype and shape (bool:
// even positions). archive_check.py builds the same values.
struct Spec {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
const std::vector<Spec>& Specs() {
  static const std::vector<Spec> specs = {
      {at::kFloat, {3, 4}}, {at::kDouble, {5}},  {at::kBFloat16, {2, 3, 2}}, {at::kHalf, {7}},
      {at::kLong, {4, 2}},  {at::kByte, {9}},    {at::kBool, {6}},           {at::kInt, {0}},
      {at::kFloat, {1000}}, {at::kChar, {2, 2}}, {at::kFloat, {3000}},
  };
  return specs;
}
at::Tensor Value(size_t k) {
  const Spec& s = Specs()[k];
  const int64_t n = c10::multiply_integers(s.shape);
  at::Tensor base = at::arange(n, at::kDouble);
  if (s.dtype == at::kBool) return (base.remainder(2) == 0).reshape(s.shape);
  return base.mul(static_cast<double>(k + 1)).to(s.dtype).reshape(s.shape);
}

// {"tensors": [t0, t1, ...], "nested": {"a": [t2, {"b": t3}], "ints": [1,2,3]},
//  "tied": [t0, t0], "name": "archive", "pi": 3.5}, every tensor added once
// (a slice of a bigger tensor for t8: only its elements are written).
c10::IValue WriteFixture(const std::string& path) {
  ArchiveWriter w(path);
  std::vector<at::Tensor> ph;
  for (size_t k = 0; k < Specs().size(); ++k) {
    at::Tensor v = Value(k);
    if (k == 8) v = at::cat({at::zeros({500}), v, at::zeros({700})}).narrow(0, 500, 1000);  // a view
    ph.push_back(w.Add(v));
  }
  c10::impl::GenericList tensors(c10::AnyType::get());
  for (const auto& p : ph) tensors.push_back(p);
  c10::impl::GenericDict b(c10::StringType::get(), c10::AnyType::get());
  b.insert("b", ph[3]);
  c10::impl::GenericList a(c10::AnyType::get());
  a.push_back(ph[2]);
  a.push_back(b);
  c10::List<int64_t> ints({1, 2, 3});
  c10::impl::GenericDict nested(c10::StringType::get(), c10::AnyType::get());
  nested.insert("a", a);
  nested.insert("ints", ints);
  c10::List<at::Tensor> tied({ph[0], ph[0]});
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  root.insert("tensors", tensors);
  root.insert("nested", nested);
  root.insert("tied", tied);
  root.insert("name", std::string("archive"));
  root.insert("pi", 3.5);
  w.Finish(root);
  return root;
}

void ExpectFixture(const c10::IValue& v) {
  auto root = v.toGenericDict();
  auto tensors = root.at("tensors").toList();
  ASSERT_EQ(tensors.size(), Specs().size());
  for (size_t k = 0; k < Specs().size(); ++k) {
    at::Tensor t = tensors.get(k).toTensor();
    EXPECT_EQ(t.scalar_type(), Specs()[k].dtype) << k;
    EXPECT_TRUE(at::equal(t, Value(k))) << k;
  }
  auto nested = root.at("nested").toGenericDict();
  auto a = nested.at("a").toList();
  EXPECT_TRUE(at::equal(a.get(0).toTensor(), Value(2)));
  EXPECT_TRUE(at::equal(a.get(1).toGenericDict().at("b").toTensor(), Value(3)));
  auto ints = nested.at("ints").toList();
  ASSERT_EQ(ints.size(), 3u);
  EXPECT_EQ(ints.get(2).toInt(), 3);
  auto tied = root.at("tied").toList();
  EXPECT_TRUE(at::equal(tied.get(1).toTensor(), Value(0)));
  EXPECT_EQ(root.at("name").toStringRef(), "archive");
  EXPECT_EQ(root.at("pi").toDouble(), 3.5);
}

std::string TempDir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  fs::path p = fs::path(t ? t : fs::temp_directory_path().string()) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

TEST(ArchiveTest, RoundTripThroughMapArchiveAndPickleLoad) {
  const std::string path = TempDir("roundtrip") + "/a.pt";
  WriteFixture(path);
  ExpectFixture(MapArchive(path));
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ExpectFixture(torch::jit::pickle_load(bytes));
  // The tied entries share one record: the file holds each tensor once.
  auto root = MapArchive(path).toGenericDict();
  auto tied = root.at("tied").toList();
  EXPECT_EQ(tied.get(0).toTensor().data_ptr(), tied.get(1).toTensor().data_ptr());
}

TEST(ArchiveTest, MappedTensorsAreWritableWithoutChangingTheFile) {
  const std::string path = TempDir("cow") + "/a.pt";
  WriteFixture(path);
  {
    auto root = MapArchive(path).toGenericDict();
    root.at("tensors").toList().get(0).toTensor().fill_(-1);
  }
  ExpectFixture(MapArchive(path));
}

TEST(ArchiveTest, WriterDestroyedWithoutFinishLeavesNoFile) {
  const std::string dir = TempDir("abandon");
  {
    ArchiveWriter w(dir + "/a.pt");
    w.Add(at::ones({100}));
    EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);  // the temporary file
  }
  EXPECT_TRUE(fs::is_empty(dir)) << "the temporary file was left behind";
  // A previous file stays untouched when a new save is abandoned.
  {
    ArchiveWriter w(dir + "/a.pt");
    w.Finish(c10::IValue(w.Add(at::arange(4))));
  }
  { ArchiveWriter w(dir + "/a.pt"); w.Add(at::ones({3})); }
  EXPECT_TRUE(at::equal(MapArchive(dir + "/a.pt").toTensor(), at::arange(4)));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
}

TEST(ArchiveTest, ForeignTensorInRootIsAClearErrorAndWritesNothing) {
  const std::string dir = TempDir("foreign");
  try {
    ArchiveWriter w(dir + "/a.pt");
    c10::List<at::Tensor> l({w.Add(at::ones({2})), at::zeros({3})});
    w.Finish(l);
    FAIL() << "no error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("that Add() did not return"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(ArchiveTest, MapArchiveNamesAMissingOrCorruptFile) {
  const std::string dir = TempDir("corrupt");
  try {
    MapArchive(dir + "/missing.pt");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/missing.pt"), std::string::npos) << e.what();
  }
  WriteFixture(dir + "/a.pt");
  fs::resize_file(dir + "/a.pt", fs::file_size(dir + "/a.pt") / 2);
  try {
    MapArchive(dir + "/a.pt");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated or corrupt"), std::string::npos) << e.what();
  }
}

// Writing N tensors one at a time holds about one tensor: the writer keeps
// no copy of what it wrote.
TEST(ArchiveTest, WriterPeakIsAboutOneTensor) {
  testing::InstallCountingCpuAllocator();
  const std::string path = TempDir("peak") + "/a.pt";
  constexpr int kTensors = 24;
  constexpr int64_t kNumel = 1 << 18;  // 1 MiB of float32
  const int64_t kBytes = kNumel * 4;
  const int64_t base = testing::LiveCpuBytesOfThisThread();
  testing::ResetPeakCpuBytesOfThisThread();
  {
    ArchiveWriter w(path);
    c10::impl::GenericList l(c10::AnyType::get());
    for (int i = 0; i < kTensors; ++i) l.push_back(w.Add(at::full({kNumel}, static_cast<float>(i))));
    w.Finish(l);
  }
  const int64_t peak = testing::PeakCpuBytesOfThisThread() - base;
  std::printf("writer: %d tensors of %lld bytes, peak live %lld bytes\n", kTensors, static_cast<long long>(kBytes),
              static_cast<long long>(peak));
  EXPECT_LE(peak, kBytes + (64 << 10));
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(path)) / kBytes, kTensors);
}

// Mapping a large archive allocates nothing like its size; reading a slice
// touches only that slice.
TEST(ArchiveTest, MapArchiveDoesNotAllocateTheFile) {
  testing::InstallCountingCpuAllocator();
  const std::string path = TempDir("map") + "/a.pt";
  constexpr int kTensors = 16;
  constexpr int64_t kNumel = 1 << 20;  // 4 MiB each, 64 MiB in all
  {
    ArchiveWriter w(path);
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    for (int i = 0; i < kTensors; ++i) d.insert("t" + std::to_string(i), w.Add(at::full({kNumel}, float(i))));
    w.Finish(d);
  }
  const int64_t base = testing::LiveCpuBytesOfThisThread();
  testing::ResetPeakCpuBytesOfThisThread();
  c10::IValue v = MapArchive(path);
  auto d = v.toGenericDict();
  double sum = 0;
  for (int i = 0; i < kTensors; ++i) sum += d.at("t" + std::to_string(i)).toTensor().narrow(0, 7, 1).item<float>();
  const int64_t peak = testing::PeakCpuBytesOfThisThread() - base;
  std::printf("map: %lld-byte file, peak live %lld bytes\n", static_cast<long long>(fs::file_size(path)),
              static_cast<long long>(peak));
  EXPECT_EQ(sum, kTensors * (kTensors - 1) / 2);
  EXPECT_LE(peak, 1 << 20);
}

// This process's resident pages of file mappings (RssFile), in KiB.
int64_t RssFileKb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("RssFile:", 0) == 0) return std::stoll(line.substr(8));
  }
  return -1;
}

// A record read in full is resident in this process until ReleaseMappedPages
// drops its pages; its values read the same afterwards (paged in again from
// the file); a tensor not from a mapping is left alone.
TEST(ArchiveTest, ReleaseMappedPagesDropsAReadRecordFromThisProcess) {
  const std::string path = TempDir("release") + "/a.pt";
  constexpr int64_t kNumel = 8 << 20;  // 32 MiB of float32
  {
    ArchiveWriter w(path);
    w.Finish(w.Add(at::arange(kNumel, at::kFloat)));
  }
  c10::IValue v = MapArchive(path);
  at::Tensor t = v.toTensor();
  // Read and release once first: the code doing it is file-mapped too, and
  // its first run pages in MiBs of text (more in an ASan build).
  (void)t.sum(at::kDouble).item<double>();
  ReleaseMappedPages(t);
  const int64_t before = RssFileKb();
  const double sum = t.sum(at::kDouble).item<double>();  // pages in the whole record
  const int64_t read = RssFileKb();
  ReleaseMappedPages(t.reshape({-1, 1024}));  // any view of the record
  const int64_t released = RssFileKb();
  std::printf("RssFile: %lld KiB before reading, %lld after, %lld after release\n", static_cast<long long>(before),
              static_cast<long long>(read), static_cast<long long>(released));
  EXPECT_GE(read - before, 30 << 10) << "reading the record pages it in";
  EXPECT_LE(released, before + (1 << 10)) << "ReleaseMappedPages left the record resident";
  EXPECT_EQ(t.sum(at::kDouble).item<double>(), sum) << "values changed after release";
  at::Tensor plain = at::ones({1024});
  ReleaseMappedPages(plain);
  EXPECT_EQ(plain.sum().item<float>(), 1024.f);
}

}  // namespace
}  // namespace shardtrain::trainer

namespace shardtrain::trainer {
// safetensors_test.cc: the modes of tests/trainer/safetensors_python_test.sh.
int SafetensorsWriteFixture(const std::string& st, const std::string& pt);
int SafetensorsCompare(const std::string& st, const std::string& pt);
}  // namespace shardtrain::trainer

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "safetensors-write") == 0) {
    return shardtrain::trainer::SafetensorsWriteFixture(argv[2], argv[3]);
  }
  if (argc == 4 && std::strcmp(argv[1], "safetensors-compare") == 0) {
    return shardtrain::trainer::SafetensorsCompare(argv[2], argv[3]);
  }
  if (argc == 3 && std::strcmp(argv[1], "write") == 0) {
    shardtrain::trainer::WriteFixture(argv[2]);
    return 0;
  }
  if (argc == 3 && std::strcmp(argv[1], "zip") == 0) {
    const shardtrain::trainer::ZipFixture zips;
    for (bool direct : {true, false}) {
      for (bool zip64 : {false, true}) {
        zips.WriteFile(std::string(argv[2]) + (direct ? "/direct" : "/plain") + (zip64 ? "_zip64" : "") + ".zip",
                       direct, zip64);
      }
    }
    return 0;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
