// The zip archives zip_writer_test reads back and archive_python_test hands
// to Python's zipfile (`archive_test zip <dir>`): five records of fixed
// content at chosen addresses (see zip_writer_test.cc).
#ifndef SHARDTRAIN_TESTS_TRAINER_ZIP_FIXTURE_H_
#define SHARDTRAIN_TESTS_TRAINER_ZIP_FIXTURE_H_

#include <memory>
#include <string>
#include <vector>

#include "trainer/checkpoint_io/internal/zip_writer.h"

namespace shardtrain::trainer {

class ZipFixture {
 public:
  struct Record {
    std::string name;
    const char* data;
    size_t size;
  };
  ZipFixture();
  const std::vector<Record>& records() const { return records_; }
  // A sink for `path` with or without O_DIRECT (SHARDTRAIN_CHECKPOINT_DIRECT_IO
  // set for its opening only).
  static std::unique_ptr<FileSink> OpenSink(const std::string& path, bool direct);
  // One archive of the records at the sink's position.
  void WriteArchive(FileSink* sink, bool zip64) const;
  // A file holding one archive, written with or without O_DIRECT.
  void WriteFile(const std::string& path, bool direct, bool zip64) const;

 private:
  static constexpr size_t kBytes = 6 << 20;
  std::unique_ptr<char, void (*)(void*)> buffer_;
  std::vector<Record> records_;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TESTS_TRAINER_ZIP_FIXTURE_H_
