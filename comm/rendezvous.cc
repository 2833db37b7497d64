#include "comm/rendezvous.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "base/errors.h"
#include "comm/auth_store.h"
#include "comm/net_address.h"
#include "comm/signed_store.h"

namespace shardtrain::comm {

c10::intrusive_ptr<c10d::Store> CreateHashStore() { return c10::make_intrusive<c10d::HashStore>(); }

c10::intrusive_ptr<c10d::Store> CreateStore(const RendezvousOptions& o) {
  ST_CHECK_ARG(o.world_size >= 1, "rendezvous: world_size must be >= 1, got ", o.world_size);
  ST_CHECK_ARG(o.rank >= 0 && o.rank < o.world_size, "rendezvous: rank must be in [0, ", o.world_size, "), got ", o.rank);
  ST_CHECK_ARG(o.kind != "tcp" || (o.master_port > 0 && o.master_port < 65536),
               "rendezvous: master_port must be in 1..65535, got ", o.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  // With a secret, rank 0 serves the authenticated store (comm/auth_store.h)
  // and every client proves the secret; its values need no signature.
  // torchrun's agent store is c10d's: there the values are signed instead.
  const bool authenticated = o.kind == "tcp" && !o.secret.empty() && !o.agent_store;
  try {
    if (authenticated) {
      AuthStoreOptions a;
      a.host = o.master_addr;
      a.port = o.master_port;
      a.secret = o.secret;
      a.serve = o.rank == 0;
      a.bind_address = o.bind_address;
      a.timeout = o.timeout;
      store = CreateAuthStore(a);
    } else if (o.kind == "hash") {
      store = CreateHashStore();
    } else if (o.kind == "file") {
      ST_CHECK_ARG(!o.file_path.empty(), "rendezvous kind 'file' needs a file path");
      store = c10::make_intrusive<c10d::FileStore>(o.file_path, o.world_size);
    } else if (o.kind == "tcp") {
      c10d::TCPStoreOptions opts;
      opts.port = static_cast<uint16_t>(o.master_port);
      opts.isServer = !o.agent_store && o.rank == 0;
      opts.numWorkers = o.agent_store ? std::nullopt : std::optional<std::size_t>(o.world_size);
      opts.waitWorkers = false;
      opts.timeout = o.timeout;
      if (opts.isServer) {  // listen only where asked (not c10d's every interface)
        opts.masterListenFd = ListenOn(o.bind_address.empty() ? o.master_addr : o.bind_address, o.master_port);
      }
      store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, opts);
      if (o.agent_store) {
        store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(o.restart_count), store);
      }
    } else {
      ST_THROW(InvalidArgumentError, "unknown rendezvous kind '", o.kind, "'; valid: tcp, file, hash");
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    ST_THROW(CommError, "rendezvous (", o.kind, " ", o.kind == "tcp" ? o.master_addr + ":" + std::to_string(o.master_port) : o.file_path,
             ", rank ", o.rank, "/", o.world_size, ") failed: ", e.what());
  }
  store->setTimeout(o.timeout);
  if (!o.secret.empty() && !authenticated) store = SignStore(store, o.secret);
  return store;
}

std::optional<StoreServerAddress> TcpStoreAddress(const c10::intrusive_ptr<c10d::Store>& store) {
  c10::intrusive_ptr<c10d::Store> base = store;
  for (;;) {  // see through prefixes and signatures
    if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(base.get())) {
      base = prefixed->getUnderlyingNonPrefixStore();
    } else if (auto inner = SignedStoreInner(*base)) {
      base = inner;
    } else {
      break;
    }
  }
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(base.get())) return StoreServerAddress{tcp->getHost(), tcp->getPort()};
  return AuthStoreServerAddress(*base);
}

}  // namespace shardtrain::comm
