#include "comm/net_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "base/errors.h"

namespace shardtrain::comm {
namespace {

struct AddrInfoFree {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoFree>;

AddrInfoPtr Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* out = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out);
  ST_CHECK_ARG(rc == 0 && out, "cannot resolve the address '", host, "': ", gai_strerror(rc),
               "; valid: an IP address or a host name of this machine (or '*' for every interface)");
  return AddrInfoPtr(out);
}

bool LoopbackAddr(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
    return IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;
  }
  return false;
}

std::string Numeric(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {0};
  if (getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  return host;
}

}  // namespace

bool IsLoopback(const std::string& host) {
  if (host == "localhost") return true;
  AddrInfoPtr ai;
  try {
    ai = Resolve(host, 0, false);
  } catch (const InvalidArgumentError&) {
    return false;
  }
  for (const addrinfo* a = ai.get(); a; a = a->ai_next)
    if (!LoopbackAddr(a->ai_addr)) return false;
  return true;
}

std::string LocalAddressToward(const std::string& host) {
  if (IsLoopback(host)) return "127.0.0.1";
  AddrInfoPtr ai = Resolve(host, 9, false);
  for (const addrinfo* a = ai.get(); a; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    const bool ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&  // UDP: picks the route, sends nothing
                    getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    close(fd);
    if (ok) return Numeric(reinterpret_cast<const sockaddr*>(&local), len);
  }
  ST_THROW(InvalidArgumentError, "no local interface reaches '", host,
           "' (no route); set the listen address explicitly (GlooOptions.hostname or GLOO_SOCKET_IFNAME)");
}

int ListenOn(const std::string& address, int port) {
  ST_CHECK_ARG(port > 0 && port < 65536, "listen port must be in 1..65535, got ", port);
  const bool any = address == "*";
  AddrInfoPtr ai = Resolve(any ? "" : address, port, any);
  std::string errors;
  for (const addrinfo* a = ai.get(); a; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (any && a->ai_family == AF_INET6) {
      const int zero = 0;  // "*": IPv4 and IPv6 on one socket
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) return fd;
    const int err = errno;
    errors += internal::StrCat(errors.empty() ? "" : "; ", Numeric(a->ai_addr, a->ai_addrlen), ": ", std::strerror(err));
    close(fd);
    if (err == EADDRNOTAVAIL && !any) {
      ST_THROW(InvalidArgumentError, "cannot listen on '", address, "' port ", port, ": ", errors,
               " (not an address of this machine; valid: an address or host name of this machine, or '*' for every "
               "interface)");
    }
  }
  ST_THROW(CommError, "cannot listen on '", address, "' port ", port, ": ", errors.empty() ? "no usable address" : errors);
}

}  // namespace shardtrain::comm
