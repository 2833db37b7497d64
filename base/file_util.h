// Small file-system helpers the writers share (plain C++, no torch):
// one atomic file writer (checkpoint metadata, hparams.yaml, metrics.csv) and
// the removal of what killed writers leave behind.
#ifndef SHARDTRAIN_BASE_FILE_UTIL_H_
#define SHARDTRAIN_BASE_FILE_UTIL_H_

#include <string>
#include <vector>

namespace shardtrain {

// The temporary name an atomic writer of `path` uses: ".NAME.tmp.<pid>"
// (".NAME.tmp.<pid>.<suffix>" with a suffix, for several writers in one
// process) in the directory of `path`: the form RemoveStaleTemporaries
// recognises once the process is gone.
std::string TemporaryBeside(const std::string& path, const std::string& suffix = "");

// Fsyncs the directory `dir`, so that a rename or a new file inside it is
// durable (best effort: an error is ignored).
void SyncDirectory(const std::string& dir);

// Writes `bytes` to `path` atomically: a temporary file ".NAME.tmp.<pid>" in
// the same directory, fsync, rename over `path`, fsync of the directory.
// Creates missing directories. Throws shardtrain::Error naming the file; the
// previous file at `path` is then intact and the temporary file removed.
void WriteFileAtomically(const std::string& path, const std::string& bytes);

// Makes `path` a hard link to the regular file `target` (same directory)
// atomically: link to ".NAME.tmp.<pid>", rename over `path`. Returns false,
// changing nothing, when that is not possible (target not a regular file,
// `path` a directory, link() refused); the caller then writes a copy.
bool LinkFileAtomically(const std::string& target, const std::string& path);

// Removes, directly inside `dir`, the temporary files and directories that a
// killed atomic save leaves: ".NAME.tmp.<pid>[.<suffix>]" whose process is
// gone (kill(pid, 0) says ESRCH), and ".NAME.tmp-sharded" directories.
// Returns what it removed (missing `dir`: nothing). Never throws.
std::vector<std::string> RemoveStaleTemporaries(const std::string& dir);

}  // namespace shardtrain

#endif  // SHARDTRAIN_BASE_FILE_UTIL_H_
