// ScanPickle: a pass over a pickle's opcodes (protocols 0-5) before it is
// unpickled. LibTorch's Unpickler reserves what a length field declares
// before reading it (a 940-byte data.pkl declaring a 2 GB string made it
// allocate 687 MB), and a memo index makes it reserve a table of that many
// entries; this pass refuses such an input, so a corrupt or hostile
// checkpoint costs no memory beyond its own size. No torch header.
#ifndef SHARDTRAIN_TRAINER_CHECKPOINT_IO_PICKLE_SCAN_H_
#define SHARDTRAIN_TRAINER_CHECKPOINT_IO_PICKLE_SCAN_H_

#include <cstddef>
#include <string>
#include <vector>

namespace shardtrain::trainer {

// Checks every opcode of the pickle at `data` (`size` bytes) up to STOP:
// a known opcode; its argument within the pickle; every declared length
// (BINUNICODE, BINUNICODE8, SHORT_BINUNICODE, BINSTRING, SHORT_BINSTRING,
// BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8, LONG1, LONG4, FRAME) no
// larger than the bytes that follow it; a memo index to store at (PUT,
// BINPUT, LONG_BINPUT) below the pickle's size, one to read (BINGET,
// LONG_BINGET) below the number of entries stored so far; a STOP before the
// end. Throws shardtrain::Error naming `file` (e.g. "checkpoint 'a.ckpt',
// data.pkl"), the offset, the opcode and the declared vs available length.
void ScanPickle(const char* data, size_t size, const std::string& file);

// ScanPickle, then a copy of the pickle that LibTorch's Unpickler reads as
// Python does, or "" when the pickle needs none: Python's torch.save writes a
// state dict as collections.OrderedDict() (a class LibTorch reads as None)
// with BUILD for its "_metadata" attribute; the copy makes each such
// OrderedDict() a plain dict and leaves out BUILD and the opcodes of the state
// it applies (LibTorch has no POP; found by following the stack). Byte offsets
// change, so a protocol-4 FRAME's length would be wrong: torch.save writes
// protocol 2, which has none.
std::string PlainDictsForLibTorch(const char* data, size_t size, const std::string& file);

// ScanPickle on the data.pkl of a torch.save-format zip archive held in
// memory (what torch::jit::pickle_load reads). Throws shardtrain::Error as
// above, or when the zip holds no data.pkl.
void ScanPickleArchive(const std::vector<char>& zip, const std::string& file);

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_CHECKPOINT_IO_PICKLE_SCAN_H_
