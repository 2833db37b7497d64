// main() for test binaries that run where no debugger is (the GPU tests on a
// lent machine): a crashing test prints a symbolized stack trace (glog's
// failure signal handler) before the process dies, so one run says where.
#include <glog/logging.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  google::InstallFailureSignalHandler();
  return RUN_ALL_TESTS();
}
