// trainer/checkpoint_io/py_pickle.h and dcp.h: Python pickles of classes,
// DCP metadata and rank files, written and read back, and their errors.
//
// Also the fixture of dcp_python_test:
//   dcp_test write <dir> <expected.pt>  writes a DCP directory (two rank
//       files, chunks from flat ranges) and the full tensors and values it holds
//   dcp_test read <dir> <expected.pt>   reads a DCP directory Python wrote and
//       compares every tensor (assembled from its chunks) and value
#include "trainer/checkpoint_io/dcp.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "base/errors.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/py_pickle.h"

namespace shardtrain::trainer::dcp {
namespace {
namespace fs = std::filesystem;

std::string TempDir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  fs::path p = fs::path(t ? t : "/tmp") / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

TEST(PyPickleTest, RoundTripsValuesGlobalsAndObjects) {
  py::PyArena a;
  py::PyPtr obj = a.Object(a.Global("m.n", "Cls"), a.Tuple({}), true,
                           a.Dict({{a.Str("x"), a.Int(-5)}, {a.Str("big"), a.Int(int64_t{1} << 40)}}));
  py::PyPtr root = a.List({a.None(), a.Bool(true), a.Float(0.25), a.Str("s"), a.Tuple({a.Int(70000), a.Int(-1)}), obj,
                           a.Object(a.Global("torch", "Size"), a.Tuple({a.Tuple({a.Int(2)})}), false)});
  const std::string bytes = py::Dumps(*root);
  py::PyArena b;
  py::PyPtr back = py::Loads(bytes.data(), bytes.size(), "t", &b);
  ASSERT_TRUE(back->Is(py::PyValue::Kind::kList));
  ASSERT_EQ(back->items.size(), 7u);
  EXPECT_TRUE(back->items[1]->b);
  EXPECT_EQ(back->items[2]->f, 0.25);
  EXPECT_EQ(back->items[4]->items[0]->i, 70000);
  EXPECT_EQ(back->items[4]->items[1]->i, -1);
  const py::PyValue& o = *back->items[5];
  EXPECT_EQ(o.QualifiedName(), "m.n.Cls");
  EXPECT_TRUE(o.newobj);
  EXPECT_EQ(o.state->Find("x")->i, -5);
  EXPECT_EQ(o.state->Find("big")->i, int64_t{1} << 40);
  EXPECT_EQ(back->items[6]->args->items[0]->items[0]->i, 2);
}

TEST(PyPickleTest, MemoSharesNodesAndCyclesEnd) {
  // [l] where l = [] memoized, then l appended to itself: a cycle, freed with the arena.
  const std::string p(
      "\x80\x04]\x94h\x00"
      "a.",
      8);
  py::PyArena a;
  py::PyPtr v = py::Loads(p.data(), p.size(), "cycle", &a);
  ASSERT_EQ(v->items.size(), 1u);
  EXPECT_EQ(v->items[0], v);
}

TEST(PyPickleTest, RejectsWhatItCannotRead) {
  auto err = [](const std::string& p) {
    py::PyArena a;
    try {
      py::Loads(p.data(), p.size(), "f.pkl", &a);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(err("\x80\x02"
                "Q.")
                .find("opcode 0x51"),
            std::string::npos)
      << err("\x80\x02"
             "Q.");  // BINPERSID
  EXPECT_NE(err("\x80\x02"
                "a.")
                .find("APPEND"),
            std::string::npos);  // empty stack
  EXPECT_NE(err("\x80\x02"
                "K\x01K\x02.")
                .find("2 values"),
            std::string::npos);
  EXPECT_NE(err("\x80\x02"
                "h\x05.")
                .find("memo"),
            std::string::npos);  // found by the scan
  EXPECT_NE(err("\x80\x02"
                "K\x01)R.")
                .find("not a global"),
            std::string::npos);
}

TEST(DcpTest, BoxesOfRangeCoverExactlyTheRange) {
  const std::vector<std::vector<int64_t>> shapes = {{5, 7}, {2, 3, 4}, {13}, {}, {1, 1, 6}, {3, 1, 2, 5}};
  for (const auto& shape : shapes) {
    const int64_t n = c10::multiply_integers(shape);
    for (int64_t b = 0; b <= n; ++b) {
      for (int64_t e = b; e <= n; ++e) {
        at::Tensor mark = at::zeros(shape, at::kLong);
        const auto boxes = BoxesOfRange(shape, b, e);
        EXPECT_LE(boxes.size(), 2 * shape.size() + 1);
        for (const auto& box : boxes) {
          at::Tensor v = mark;
          for (size_t d = 0; d < shape.size(); ++d) v = v.narrow(d, box.offsets[d], box.sizes[d]);
          v.add_(1);
        }
        at::Tensor want = at::zeros({n}, at::kLong);
        want.narrow(0, b, e - b).fill_(1);
        ASSERT_TRUE(at::equal(mark.reshape({-1}), want)) << c10::IntArrayRef(shape) << " [" << b << ", " << e << ")";
      }
    }
  }
  EXPECT_THROW(BoxesOfRange({2, 3}, 4, 7), InvalidArgumentError);
}

TEST(DcpTest, RunsOfABoxAreItsElementsInOrder) {
  const std::vector<int64_t> shape = {4, 3, 5};
  const at::Tensor index = at::arange(60, at::kLong).reshape(shape);
  const std::vector<Box> boxes = {{{0, 0, 0}, {4, 3, 5}}, {{1, 0, 0}, {2, 3, 5}}, {{1, 1, 0}, {2, 2, 5}},
                                  {{0, 0, 2}, {4, 3, 2}}, {{3, 2, 4}, {1, 1, 1}}, {{0, 1, 1}, {1, 2, 3}}};
  for (const Box& box : boxes) {
    const at::Tensor want = index.narrow(0, box.offsets[0], box.sizes[0])
                                .narrow(1, box.offsets[1], box.sizes[1])
                                .narrow(2, box.offsets[2], box.sizes[2])
                                .reshape({-1});
    std::vector<int64_t> got;
    int64_t next = 0;
    ForEachRun(shape, box, [&](int64_t at, int64_t in_box, int64_t len) {
      EXPECT_EQ(in_box, next);
      next += len;
      for (int64_t i = 0; i < len; ++i) got.push_back(at + i);
    });
    EXPECT_TRUE(at::equal(at::tensor(got, at::kLong), want)) << c10::IntArrayRef(box.offsets);
  }
  int runs = 0;
  ForEachRun({}, Box{}, [&](int64_t at, int64_t in_box, int64_t len) { runs += at == 0 && in_box == 0 && len == 1; });
  EXPECT_EQ(runs, 1);  // a 0-d tensor: one element
}

// A small checkpoint: tensors chunked over two rank files, values, paths.
struct Written {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, c10::IValue> objects;
};

Written WriteSample(const std::string& dir) {
  Written w;
  w.tensors["model.w"] = at::arange(35, at::kFloat).reshape({5, 7});
  w.tensors["model.v"] = at::arange(24, at::kFloat).div(8).to(at::kBFloat16).reshape({2, 3, 4});
  w.tensors["model.s"] = at::full({}, 2.5, at::kFloat);
  w.tensors["optimizer_0.state.w.exp_avg"] = at::arange(35, at::kFloat).mul(-0.5).reshape({5, 7});
  w.tensors["optimizer_0.state.w.step"] = at::full({}, 16.0, at::kFloat);
  w.objects["optimizer_0.param_groups.0.lr"] = 0.01;
  c10::impl::GenericList params(c10::AnyType::get());
  params.push_back(std::string("w"));
  w.objects["optimizer_0.param_groups.0.params"] = params;
  w.objects["optimizer_0.param_groups.0.betas"] = c10::ivalue::Tuple::create({0.9, 0.999});
  // Flat ranges per rank file, as flat shards cross rows.
  const std::map<std::string, std::vector<int64_t>> cuts = {
      {"model.w", {0, 13, 35}}, {"model.v", {0, 5, 17, 24}}, {"optimizer_0.state.w.exp_avg", {0, 13, 35}}};
  Metadata md;
  RankFileWriter f0(dir, RankFileName(0)), f1(dir, RankFileName(1));
  for (const auto& [key, t] : w.tensors) {
    TensorEntry& e = md.tensors[key];
    e.dtype = t.scalar_type();
    e.shape = t.sizes().vec();
    auto it = cuts.find(key);
    const std::vector<int64_t> cut = it == cuts.end() ? std::vector<int64_t>{0, t.numel()} : it->second;
    for (size_t r = 0; r + 1 < cut.size(); ++r) {
      for (const Box& box : BoxesOfRange(e.shape, cut[r], cut[r + 1])) {
        at::Tensor part = t;
        for (size_t d = 0; d < e.shape.size(); ++d) part = part.narrow(d, box.offsets[d], box.sizes[d]);
        e.chunks.push_back({box, (r % 2 ? f1 : f0).AddTensor(part)});
      }
    }
  }
  for (const auto& [key, v] : w.objects) md.objects[key] = f0.AddObject(v);
  for (const auto& key : {"model.w", "model.v", "model.s"}) md.paths[key] = {{"model"}, {std::string(key).substr(6)}};
  md.paths["optimizer_0.state.w.exp_avg"] = {{"optimizer_0"}, {"state"}, {"w"}, {"exp_avg"}};
  md.paths["optimizer_0.state.w.step"] = {{"optimizer_0"}, {"state"}, {"w"}, {"step"}};
  for (const char* k : {"lr", "params", "betas"}) {
    md.paths[std::string("optimizer_0.param_groups.0.") + k] = {{"optimizer_0"}, {"param_groups"}, {"", 0}, {k}};
  }
  f0.Finish();
  f1.Finish();
  WriteMetadata(dir, md);
  return w;
}

// Every tensor of the directory assembled from its chunks.
std::map<std::string, at::Tensor> Assemble(const Reader& r) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, e] : r.metadata().tensors) {
    at::Tensor full = at::full(e.shape, -7, at::TensorOptions().dtype(e.dtype));
    for (const auto& c : e.chunks) {
      at::Tensor v = full;
      for (size_t d = 0; d < e.shape.size(); ++d) v = v.narrow(d, c.box.offsets[d], c.box.sizes[d]);
      v.copy_(r.ReadChunk(key, c));
    }
    out[key] = full;
  }
  return out;
}

TEST(DcpTest, WritesAndReadsBack) {
  const std::string dir = TempDir("dcp_round_trip");
  Written w = WriteSample(dir);
  Reader r(dir);
  EXPECT_EQ(r.metadata().version, kDcpVersion);
  const auto full = Assemble(r);
  ASSERT_EQ(full.size(), w.tensors.size());
  for (const auto& [k, t] : w.tensors) EXPECT_TRUE(at::equal(full.at(k), t)) << k;
  EXPECT_EQ(r.metadata().tensors.at("model.w").chunks.size(), 4u);  // [0,13): row 0, 6 of row 1; [13,35): 1 + 3 rows
  EXPECT_EQ(r.ReadObject("optimizer_0.param_groups.0.lr").toDouble(), 0.01);
  EXPECT_EQ(r.ReadObject("optimizer_0.param_groups.0.params").toListRef()[0].toStringRef(), "w");
  EXPECT_EQ(r.ReadObject("optimizer_0.param_groups.0.betas").toTupleRef().elements()[1].toDouble(), 0.999);
  const auto& path = r.metadata().paths.at("optimizer_0.param_groups.0.lr");
  EXPECT_EQ(FlatKey(path), "optimizer_0.param_groups.0.lr");
  EXPECT_EQ(path[2].index, 0);
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// The .metadata with one byte string replaced (same length: the pickle stays well-formed).
void Patch(const std::string& dir, const std::string& from, const std::string& to) {
  ASSERT_EQ(from.size(), to.size());
  const std::string path = dir + "/" + kMetadataFile;
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = s.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  s.replace(at, from.size(), to);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << s;
}

TEST(DcpTest, NamesWhatIsWrong) {
  const std::string dir = TempDir("dcp_errors");
  const std::string good = dir + "/good";  // never patched
  fs::create_directories(good);
  WriteSample(good);
  auto fresh = [&](const std::string& name) {
    const std::string d = dir + "/" + name;
    fs::create_directories(d);
    for (const auto& e : fs::directory_iterator(good)) fs::copy(e.path(), d + "/" + e.path().filename().string());
    return d;
  };
  std::string d = fresh("cls");
  Patch(d, "TensorStorageMetadata", "TensorStorageMetadatX");
  std::string e = ErrorOf([&] { Reader r(d); });
  EXPECT_NE(e.find("TensorStorageMetadatX"), std::string::npos) << e;
  EXPECT_NE(e.find(std::string("torch ") + kTorchVersion), std::string::npos) << e;

  d = fresh("field");
  Patch(d, "relative_path", "relative_pat_");
  e = ErrorOf([&] { Reader r(d); });
  EXPECT_NE(e.find("'relative_pat_'"), std::string::npos) << e;

  d = fresh("dtype");
  Patch(d, "bfloat16", "bfloat61");
  e = ErrorOf([&] { Reader r(d); });
  EXPECT_NE(e.find("torch.bfloat61"), std::string::npos) << e;
  EXPECT_NE(e.find("valid: torch.float32"), std::string::npos) << e;

  d = fresh("missing");
  fs::remove(d + "/" + RankFileName(1));
  e = ErrorOf([&] { Reader r(d); });
  EXPECT_NE(e.find("missing the file '" + d + "/" + RankFileName(1) + "'"), std::string::npos) << e;

  d = fresh("truncated");
  fs::resize_file(d + "/" + RankFileName(1), fs::file_size(d + "/" + RankFileName(1)) - 10);
  e = ErrorOf([&] { Reader r(d); });
  EXPECT_NE(e.find("(truncated?)"), std::string::npos) << e;

  d = fresh("nometa");
  fs::remove(d + "/" + kMetadataFile);
  e = ErrorOf([&] { Reader r(d); });
  EXPECT_NE(e.find(".metadata' cannot be opened"), std::string::npos) << e;

  // A chunk whose stored tensor is not the box it claims (bytes swapped between two items).
  d = fresh("mismatch");
  {
    Reader r(d);
    const auto& w = r.metadata().tensors.at("model.w");
    const auto& s = r.metadata().tensors.at("model.s").chunks[0];
    Metadata md = r.metadata();
    md.tensors["model.w"].chunks[0].where = s.where;
    WriteMetadata(d, md);
    (void)w;
  }
  e = ErrorOf([&] { Assemble(Reader(d)); });
  EXPECT_NE(e.find("the metadata says Float of shape [1, 7]"), std::string::npos) << e;
}

// ---- fixture modes for dcp_python_test ----

int WriteMode(const std::string& dir, const std::string& expected) {
  Written w = WriteSample(dir);
  ArchiveWriter out(expected);
  c10::impl::GenericDict tensors(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, t] : w.tensors) tensors.insert(k, out.Add(t));
  c10::impl::GenericDict objects(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, v] : w.objects) objects.insert(k, v);
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  root.insert("tensors", tensors);
  root.insert("objects", objects);
  out.Finish(root);
  return 0;
}

int ReadMode(const std::string& dir, const std::string& expected) {
  const auto want = MapArchive(expected).toGenericDict();
  Reader r(dir);
  const auto full = Assemble(r);
  int bad = 0;
  const auto wt = want.at("tensors").toGenericDict();
  if (wt.size() != full.size()) {
    std::cerr << "tensors: " << full.size() << " read, " << wt.size() << " expected\n";
    ++bad;
  }
  for (const auto& e : wt) {
    const std::string k = e.key().toStringRef();
    auto it = full.find(k);
    if (it == full.end() || !at::equal(it->second, e.value().toTensor())) {
      std::cerr << "tensor '" << k << "' differs or is missing\n";
      ++bad;
    }
  }
  for (const auto& e : want.at("objects").toGenericDict()) {
    const std::string k = e.key().toStringRef();
    const std::string got = c10::str(r.ReadObject(k)), exp = c10::str(e.value());
    if (got != exp) {
      std::cerr << "value '" << k << "': read " << got << ", expected " << exp << "\n";
      ++bad;
    }
  }
  std::cout << (bad ? "FAIL" : "PASS") << ": read " << full.size() << " tensors and " << r.metadata().objects.size()
            << " values of the DCP checkpoint Python wrote\n";
  return bad ? 1 : 0;
}

}  // namespace
}  // namespace shardtrain::trainer::dcp

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "write") == 0) return shardtrain::trainer::dcp::WriteMode(argv[2], argv[3]);
  if (argc == 4 && std::strcmp(argv[1], "read") == 0) return shardtrain::trainer::dcp::ReadMode(argv[2], argv[3]);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
