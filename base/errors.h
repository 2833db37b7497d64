// Typed exceptions of ShardTrain's public API.
//
// Every error a user can cause is an InvalidArgumentError whose message says
// what was wrong and what is valid. Communication failures (a dead or missing
// peer, a timeout, an engine error) are CommError and name the operation, the
// group and, where known, the peer. ST_THROW attaches file:line.
#ifndef SHARDTRAIN_BASE_ERRORS_H_
#define SHARDTRAIN_BASE_ERRORS_H_

#include <sstream>
#include <stdexcept>
#include <string>

namespace shardtrain {

// Base of all ShardTrain exceptions.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input from the caller: a wrong option, name, shape, size or dtype.
class InvalidArgumentError : public Error {
 public:
  using Error::Error;
};

// A collective failed: engine error, dead peer or timeout.
class CommError : public Error {
 public:
  using Error::Error;
};

// A collective did not complete within its timeout.
class CommTimeoutError : public CommError {
 public:
  using CommError::CommError;
};

namespace internal {
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace internal
}  // namespace shardtrain

// ST_THROW(InvalidArgumentError, "bad ", x, "; valid: ...") -> throws with file:line.
#define ST_THROW(type, ...) \
  throw ::shardtrain::type(::shardtrain::internal::StrCat(__VA_ARGS__, " (", __FILE__, ":", __LINE__, ")"))

// ST_CHECK_ARG(cond, msg...) throws InvalidArgumentError when cond is false.
#define ST_CHECK_ARG(cond, ...)                       \
  do {                                                \
    if (!(cond)) ST_THROW(InvalidArgumentError, __VA_ARGS__); \
  } while (0)

#endif  // SHARDTRAIN_BASE_ERRORS_H_
