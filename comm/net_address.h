// Which local address to listen on: the rendezvous store and Gloo listen on
// the address the cluster environment gives (MASTER_ADDR, or the local
// address that reaches it), never on every interface unless asked for.
// Plain C++ (sockets only, no torch header).
#ifndef SHARDTRAIN_COMM_NET_ADDRESS_H_
#define SHARDTRAIN_COMM_NET_ADDRESS_H_

#include <string>

namespace shardtrain::comm {

// True for "localhost", 127.0.0.0/8 and ::1 (and names resolving only to those).
bool IsLoopback(const std::string& host);

// The address of this host's interface that reaches `host` (the route's
// source address; no packet is sent). Loopback hosts give "127.0.0.1".
// Throws InvalidArgumentError when `host` cannot be resolved.
std::string LocalAddressToward(const std::string& host);

// A listening TCP socket (close-on-exec) on `address`:`port`; "*" = every
// interface. Returns its file descriptor. Throws InvalidArgumentError for an
// unresolvable or non-local address and CommError when the bind fails (e.g.
// the port is in use), naming the address.
int ListenOn(const std::string& address, int port);

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_NET_ADDRESS_H_
