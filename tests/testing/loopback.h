// Sockets for tests that play a stranger to a server on this machine: a free
// port to serve on, and a raw TCP connection to one.
#ifndef SHARDTRAIN_TESTS_TESTING_LOOPBACK_H_
#define SHARDTRAIN_TESTS_TESTING_LOOPBACK_H_

#include <string>

namespace shardtrain::testing {

// A TCP port that is free on 127.0.0.1 now (the kernel's choice).
int FreeLoopbackPort();

// A connected TCP socket to `ip`:`port` (IPv4), or -1 if the connection is refused.
int ConnectTcp(const std::string& ip, int port);

}  // namespace shardtrain::testing

#endif  // SHARDTRAIN_TESTS_TESTING_LOOPBACK_H_
