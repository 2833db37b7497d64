#include "comm/heartbeat_store.h"

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "base/errors.h"
#include "comm/rendezvous.h"

namespace shardtrain::comm {
namespace {

// Runs `f`, rethrowing its error as std::runtime_error with the first line of its text.
template <typename F>
auto OneLineErrors(F f) {
  try {
    return f();
  } catch (const std::exception& e) {
    const auto* ce = dynamic_cast<const c10::Error*>(&e);
    std::string text = ce ? ce->what_without_backtrace() : e.what();
    throw std::runtime_error(text.substr(0, text.find('\n')));
  }
}

}  // namespace

gloo_internal::HeartbeatStore MakeHeartbeatStore(const c10::intrusive_ptr<c10d::Store>& store) {
  gloo_internal::HeartbeatStore h;
  h.set = [store](const std::string& key, const std::string& value) {
    OneLineErrors([&] { store->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  };
  h.check = [store](const std::vector<std::string>& keys) { return OneLineErrors([&] { return store->check(keys); }); };
  h.multi_get = [store](const std::vector<std::string>& keys) {
    return OneLineErrors([&] {
      std::vector<std::string> out;
      for (const auto& v : store->multiGet(keys)) out.emplace_back(v.begin(), v.end());
      return out;
    });
  };
  h.get = [store](const std::string& key) {
    return OneLineErrors([&] {
      const std::vector<uint8_t> v = store->get(key);
      return std::string(v.begin(), v.end());
    });
  };
  // Which process serves the store, for when it cannot be read.
  if (auto server = TcpStoreAddress(store)) {
    h.unreachable_note = internal::StrCat(": the store at ", server->host, ":", server->port,
                                          " is served by a single process (rank 0, or torchrun's agent), which has "
                                          "probably died");
  }
  return h;
}

}  // namespace shardtrain::comm
