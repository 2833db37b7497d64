// ScanPickle (trainer/checkpoint_io/pickle_scan.h), the pass over data.pkl's opcodes that
// MapArchive runs before LibTorch's Unpickler: the fuzzer's 940-byte input
// (a valid data.pkl whose first BINUNICODE declares 2^31 bytes) is refused
// with an error naming the file, offset, opcode and lengths, and no single
// allocation of the process exceeds a few MB on the way (counted by the
// operator new below; the Unpickler reserved the declared length before);
// hand-made pickles with each kind of bad length, memo index or opcode are
// refused naming it; files written by Python's torch.save load as before
// (protocol 2 with its values; 4 and 5 refused by LibTorch, not the pass).
#include <gtest/gtest.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <new>
#include <string>
#include <vector>

#include "base/errors.h"
#include "tests/fuzz/checkpoint_readers_fuzz.h"
#include "trainer/checkpoint_io/archive.h"
#include "trainer/checkpoint_io/pickle_scan.h"

namespace {
std::atomic<size_t> g_largest_new{0};  // the largest operator new request since the last reset
}  // namespace

void* operator new(size_t n) {
  size_t seen = g_largest_new.load(std::memory_order_relaxed);
  while (n > seen && !g_largest_new.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace shardtrain::trainer {
namespace {

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The error ScanPickle throws for `pickle` ("" when it accepts it).
std::string ScanError(const std::string& pickle) {
  try {
    ScanPickle(pickle.data(), pickle.size(), "test.pkl");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(PickleScan, HugeDeclaredLengthIsRefusedWithoutAllocatingIt) {
  // Reader 4 of the fuzz entry point: MapArchive on this data.pkl, zipped with its records.
  std::vector<uint8_t> input = ReadFile("tests/fuzz/corpus/archive_pickle");
  ASSERT_GT(input.size(), 100u);
  const size_t n = input.size() - 1;  // the pickle, less the reader byte
  EXPECT_TRUE(fuzz::FuzzCheckpointReaders(input.data(), input.size())) << "the valid seed must load";
  const std::string key = std::string("X\x0a\x00\x00\x00state_dict", 15);
  const auto at = std::search(input.begin(), input.end(), key.begin(), key.end());
  ASSERT_NE(at, input.end()) << "no BINUNICODE 'state_dict' in the seed";
  const size_t op = static_cast<size_t>(at - input.begin());
  input[op + 1] = 0;
  input[op + 2] = 0;
  input[op + 3] = 0;
  input[op + 4] = 0x80;  // 2^31
  g_largest_new = 0;
  EXPECT_FALSE(fuzz::FuzzCheckpointReaders(input.data(), input.size())) << "must be refused";
  EXPECT_LT(g_largest_new.load(), size_t{8} << 20) << "an allocation of " << g_largest_new.load() << " bytes";

  const std::string pickle(input.begin() + 1, input.end());
  const std::string what = ScanError(pickle);
  for (const std::string& part :
       {std::string("test.pkl is corrupt: at byte ") + std::to_string(op - 1) + " of " + std::to_string(n) +
            ", opcode BINUNICODE (0x58)",
        std::string("declares 2147483648 bytes but only ") + std::to_string(n - (op - 1) - 5) + " of the pickle's " +
            std::to_string(n) + " bytes follow it"}) {
    EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
  }
}

TEST(PickleScan, EveryKindOfBadLengthIndexOrOpcodeIsNamed) {
  using S = std::string;
  // "\x80\x02" PROTO 2, "}" EMPTY_DICT, "q\x00" BINPUT 0, ... "." STOP
  const S ok = S("\x80\x02}q\x00X\x01\x00\x00\x00" "aq\x01K\x01s.", 17);
  EXPECT_EQ(ScanError(ok), "");
  EXPECT_EQ(ScanError(S("\x80\x02]q\x05.", 6)), "");  // a memo index out of order: LibTorch ignores it
  EXPECT_EQ(ScanError(S("\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01" "a\x94.", 16)), "");  // FRAME, MEMOIZE
  struct Case {
    S pickle;
    S expected;
  };
  const std::vector<Case> cases = {
      {S("\x80\x02X\x00\x00\x00\x80.", 8), "opcode BINUNICODE (0x58) declares 2147483648 bytes but only 1 of"},
      {S("\x80\x04\x8d\x00\x00\x00\x00\x00\x00\x00\x80.", 12), "opcode BINUNICODE8 (0x8d) declares 9223372036854775808"},
      {S("\x80\x04\x8e\xff\xff\xff\xff\x00\x00\x00\x00.", 12), "opcode BINBYTES8 (0x8e) declares 4294967295"},
      {S("\x80\x05\x96\x10\x00\x00\x00\x00\x00\x00\x00.", 12), "opcode BYTEARRAY8 (0x96) declares 16 bytes"},
      {S("\x80\x03\x42\x10\x00\x00\x00.", 8), "opcode BINBYTES (0x42) declares 16 bytes"},
      {S("\x80\x03\x43\x10.", 5), "opcode SHORT_BINBYTES (0x43) declares 16 bytes"},
      {S("\x80\x04\x8c\x10.", 5), "opcode SHORT_BINUNICODE (0x8c) declares 16 bytes"},
      {S("T\xff\xff\xff\xff.", 6), "opcode BINSTRING (0x54) declares a negative length (-1)"},
      {S("U\x05" "ab.", 5), "opcode SHORT_BINSTRING (0x55) declares 5 bytes"},
      {S("\x80\x02\x8a\x09\x01.", 6), "opcode LONG1 (0x8a) declares 9 bytes"},
      {S("\x80\x02\x8b\x00\x00\x00\x40.", 8), "opcode LONG4 (0x8b) declares 1073741824 bytes"},
      {S("\x80\x04\x95\x00\x00\x00\x00\x01\x00\x00\x00.", 12), "opcode FRAME (0x95) declares 4294967296 bytes"},
      {S("\x80\x02]r\xff\xff\xff\xff.", 9), "opcode LONG_BINPUT (0x72) stores memo entry 4294967295, more entries than a pickle of 9 bytes"},
      {S("\x80\x02]q\x00h\x07.", 7), "opcode BINGET (0x68) reads memo entry 7 but only 1 entries"},
      {S("\x80\x02\xff.", 4), "at byte 2 of 4, opcode (unknown) (0xff) is not an opcode of pickle protocols 0-5"},
      {S("\x80\x02}", 3), "at byte 3 of 3: the pickle ends without STOP"},
      {S("\x80\x02J\x01\x00.", 6), "opcode BININT (0x4a) needs 4 bytes for its argument but only 3"},
      {S("ctorch\nFloatStorage", 19), "opcode GLOBAL (0x63) has no end of line"},
  };
  for (const Case& c : cases) {
    const std::string what = ScanError(c.pickle);
    EXPECT_NE(what.find(c.expected), std::string::npos) << "expected '" << c.expected << "', got: '" << what << "'";
    if (!what.empty()) {
      EXPECT_NE(what.find("test.pkl is corrupt"), std::string::npos) << what;
    }
  }
}

// Python's torch.save (torch 2.11; tests/fuzz/testdata) is read as before the
// pre-pass. Protocol 2 (torch.save's default), written by
//   torch.save({'w': torch.arange(6.).reshape(2, 3), 'step': 3, 'name': 'x' * 300,
//               'nested': {'l': [1, 2.5, None, True], 't': (1, 'a')},
//               'many': {f'k{i}': i for i in range(300)},   # memo indices > 255: LONG_BINPUT
//               'h': torch.ones(3, dtype=torch.bfloat16)}, f)
// loads with its values. Protocols 4 and 5 (the same plus 'big': 2**70 and
// 'b': b'bytes'; FRAME, MEMOIZE, SHORT_BINUNICODE, SHORT_BINBYTES, LONG1,
// STACK_GLOBAL) pass the pre-pass and are then refused by LibTorch's
// Unpickler, which reads protocol 2 only, as they were before.
TEST(PickleScan, PythonTorchSaveFilesStillLoad) {
  for (int protocol : {2, 4, 5}) {
    const std::string path = "tests/fuzz/testdata/python_torch_save_protocol" + std::to_string(protocol) + ".pt";
    const std::vector<uint8_t> raw = ReadFile(path);
    ASSERT_GT(raw.size(), 1000u) << path;
    EXPECT_NO_THROW(ScanPickleArchive(std::vector<char>(raw.begin(), raw.end()), path)) << path;
    if (protocol != 2) {
      try {
        MapArchive(path);
        ADD_FAILURE() << path << ": LibTorch's Unpickler read protocol " << protocol;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("Only Pickle protocol 2 is supported"), std::string::npos) << e.what();
      }
      continue;
    }
    c10::IValue v;
    try {
      v = MapArchive(path);
    } catch (const std::exception& e) {
      ADD_FAILURE() << path << ": " << e.what();
      continue;
    }
    ASSERT_TRUE(v.isGenericDict()) << path;
    const auto d = v.toGenericDict();
    EXPECT_TRUE(at::equal(d.at("w").toTensor(), at::arange(6.0).reshape({2, 3}))) << path;
    EXPECT_TRUE(at::equal(d.at("h").toTensor(), at::ones({3}, at::kBFloat16))) << path;
    EXPECT_EQ(d.at("step").toInt(), 3) << path;
    EXPECT_EQ(d.at("name").toStringRef(), std::string(300, 'x')) << path;
    EXPECT_EQ(d.at("many").toGenericDict().at("k299").toInt(), 299) << path;
  }
}

}  // namespace
}  // namespace shardtrain::trainer
