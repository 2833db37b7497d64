// Python objects as a pickle holds them, for pickles that name Python classes
// LibTorch's unpickler cannot build (PyTorch DCP's .metadata: dataclasses of
// torch.distributed.checkpoint, torch.Size, torch.float32, enums).
//
// PyValue is a graph (the pickle's memo shares nodes, and may make cycles) of
// plain values, globals (a module attribute: a class, a function,
// torch.float32), and objects (what REDUCE or NEWOBJ made from a global and
// arguments, with the state BUILD gave them), every node owned by a PyArena:
// no recursion frees them, and a cycle leaks nothing. Nothing is imported or
// called: a reader checks the class names it expects. No torch header.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_PY_PICKLE_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_PY_PICKLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain::trainer::py {

struct PyValue;
using PyPtr = PyValue*;

struct PyValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kGlobal, kObject };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                                 // kStr, kBytes; kGlobal: the module
  std::string name;                              // kGlobal: the attribute ("Metadata", "float32")
  std::vector<PyPtr> items;                      // kTuple, kList
  std::vector<std::pair<PyPtr, PyPtr>> entries;  // kDict, in insertion order
  PyPtr callable = nullptr;                      // kObject: the global called (REDUCE) or instantiated (NEWOBJ)
  PyPtr args = nullptr;                          // kObject: the arguments (a kTuple)
  bool newobj = false;                           // kObject: cls.__new__(cls, *args) rather than callable(*args)
  PyPtr state = nullptr;                         // kObject: BUILD's argument (null: none)

  bool Is(Kind k) const { return kind == k; }
  // For kGlobal: "module.name"; for kObject: its callable's.
  std::string QualifiedName() const;
  // A short Python-like description for error messages ("str", "dict", "torch.Size(...)").
  std::string TypeName() const;
  // kDict: the value under the str key `key`, or null.
  PyPtr Find(const std::string& key) const;
};

// Owns the nodes it makes; they live as long as the arena.
class PyArena {
 public:
  PyPtr None();
  PyPtr Bool(bool v);
  PyPtr Int(int64_t v);
  PyPtr Float(double v);
  PyPtr Str(std::string v);
  PyPtr Bytes(std::string v);
  PyPtr Tuple(std::vector<PyPtr> items);
  PyPtr List(std::vector<PyPtr> items);
  PyPtr Dict(std::vector<std::pair<PyPtr, PyPtr>> entries);
  PyPtr Global(std::string module, std::string name);
  // callable(*args) (REDUCE) or, with `newobj`, cls.__new__(cls, *args)
  // (NEWOBJ); then BUILD(state) when state is set.
  PyPtr Object(PyPtr callable, PyPtr args, bool newobj, PyPtr state = nullptr);
  size_t size() const { return nodes_.size(); }

 private:
  PyPtr New(PyValue::Kind kind);
  std::vector<std::unique_ptr<PyValue>> nodes_;
};

// A protocol-2 pickle of `v` (Python's pickle.load reads it; globals are
// written with GLOBAL, objects with REDUCE / NEWOBJ and BUILD). Shared nodes
// are written once per reference (no memo); `v` must have no cycle.
std::string Dumps(const PyValue& v);

// Parses a pickle (protocols 2-5, as Python's pickle.dump writes plain
// values, dataclasses and reduce calls) after ScanPickle
// (trainer/checkpoint_io/pickle_scan.h). Opcodes for other constructs
// (persistent ids, extension registry, sets, out-of-band buffers, text
// protocol 0 values) throw shardtrain::Error naming `file`, the offset and
// the opcode, as does a stack or mark that does not match, or a pickle of
// more than `max_nodes` values. The nodes belong to `arena`.
PyPtr Loads(const char* data, size_t size, const std::string& file, PyArena* arena, size_t max_nodes = 1 << 24);

}  // namespace shardtrain::trainer::py

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_PY_PICKLE_H_
