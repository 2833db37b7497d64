#include "base/file_util.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/errors.h"

namespace shardtrain {
namespace fs = std::filesystem;

void SyncDirectory(const std::string& dir) {
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string TemporaryBeside(const std::string& path, const std::string& suffix) {
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  return (dir / ("." + p.filename().string() + ".tmp." + std::to_string(::getpid()) +
                 (suffix.empty() ? "" : "." + suffix)))
      .string();
}

void WriteFileAtomically(const std::string& path, const std::string& bytes) {
  fs::path p(path);
  fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  const std::string tmp = TemporaryBeside(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) ST_THROW(Error, "cannot create '", tmp, "': ", std::strerror(errno));
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      ST_THROW(Error, "failed writing '", tmp, "': ", std::strerror(err));
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ST_THROW(Error, "failed flushing '", tmp, "': ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ST_THROW(Error, "cannot rename '", tmp, "' to '", path, "': ", std::strerror(err));
  }
  SyncDirectory(dir);
}

bool LinkFileAtomically(const std::string& target, const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(target, ec) || fs::is_directory(path, ec)) return false;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  const std::string tmp = TemporaryBeside(path);
  ::unlink(tmp.c_str());
  if (::link(target.c_str(), tmp.c_str()) != 0) return false;
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return false;
  }
  SyncDirectory(dir);
  return true;
}

namespace {
// The pid in ".NAME.tmp.<pid>[.<suffix>]", or -1.
long TempFilePid(const std::string& name) {
  if (name.empty() || name[0] != '.') return -1;
  const size_t at = name.rfind(".tmp.");
  if (at == std::string::npos || at == 0) return -1;
  const char* start = name.c_str() + at + 5;
  char* end = nullptr;
  const long pid = std::strtol(start, &end, 10);
  if (end == start || pid <= 0 || (*end != '\0' && *end != '.')) return -1;
  return pid;
}

bool ProcessGone(long pid) { return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }
}  // namespace

std::vector<std::string> RemoveStaleTemporaries(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return removed;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool sharded_tmp = name.size() > 13 && name[0] == '.' &&
                             name.compare(name.size() - 12, 12, ".tmp-sharded") == 0;
    const long pid = TempFilePid(name);
    if (!sharded_tmp && !(pid > 0 && ProcessGone(pid))) continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    if (!rm) removed.push_back(e.path().string());
  }
  return removed;
}

}  // namespace shardtrain
