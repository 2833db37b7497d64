// Skipping a test for what the machine lacks, honestly: a developer's machine
// without a privilege, a tool or an address skips the test and says why; under
// CI=true (.ci/run exports it and --config=ci hands it to the tests) the same
// condition fails the test, because CI's machine is set up for every test and
// a green CI must mean that every test ran. Skips by design (no GPU on a CPU
// build, a sanitizer's allocator) use GTEST_SKIP directly.
#ifndef SHARDTRAIN_TESTS_TESTING_SKIP_H_
#define SHARDTRAIN_TESTS_TESTING_SKIP_H_

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace shardtrain::testing {

inline bool UnderCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::strcmp(ci, "true") == 0;
}

}  // namespace shardtrain::testing

// Use as a statement with the reason: ST_SKIP_UNLESS_CI() << "no tool X";
// Returns from the test (like GTEST_SKIP): skipped here, a fatal failure under CI.
#define ST_SKIP_UNLESS_CI()                                                                                  \
  return ::testing::internal::AssertHelper(::shardtrain::testing::UnderCi()                                  \
                                               ? ::testing::TestPartResult::kFatalFailure                    \
                                               : ::testing::TestPartResult::kSkip,                           \
                                           __FILE__, __LINE__,                                               \
                                           ::shardtrain::testing::UnderCi()                                  \
                                               ? "CI=true: this test would be skipped, and CI counts a skip " \
                                                 "as a failure (its machine is set up for every test)"       \
                                               : "skipped") = ::testing::Message()

#endif  // SHARDTRAIN_TESTS_TESTING_SKIP_H_
