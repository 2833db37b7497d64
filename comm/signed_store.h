// Authenticated store values: a decorator over any c10d::Store (TCPStore,
// FileStore, HashStore) that signs every value it writes with an
// HMAC-SHA-256 of (key, value) under the job's shared secret and checks the
// signature of every value it reads. A client without the secret (a
// stranger that connects to the TCPStore and knows c10d's protocol) can
// still write keys, but a rank never accepts what it wrote: the read fails
// with CommError naming the key ("... was not written by a rank of this
// job ..."), so forged Gloo addresses, heartbeats or shared-memory tokens
// end the job with that error instead of being used.
//
// What it does not protect (c10d's TCPStore has no authentication hook):
// - confidentiality: anyone who can reach the store reads the values;
// - add() counters (atomic on the server, so unsigned): a stranger can
//   change them; deleteKey, check, wait and getNumKeys see any key;
// - replay of a value this job itself wrote earlier under the same key;
// - availability: a stranger can delete or overwrite keys (the job then
//   fails with the error above or times out, naming what it waited for).
//
// The secret: RendezvousOptions::secret, which launch/ fills from
// SHARDTRAIN_SECRET or a file named by SHARDTRAIN_SECRET_FILE (mode 0600 or
// stricter); the local launcher generates one for its own ranks.
#ifndef SHARDTRAIN_COMM_SIGNED_STORE_H_
#define SHARDTRAIN_COMM_SIGNED_STORE_H_

#include <cstddef>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace shardtrain::comm {

// Environment variables that carry the job's secret.
inline constexpr const char* kSecretEnvVar = "SHARDTRAIN_SECRET";
inline constexpr const char* kSecretFileEnvVar = "SHARDTRAIN_SECRET_FILE";
// The shortest secret SignStore, StoreSecretFromEnvironment and the authenticated
// store (auth_store.h) accept, in bytes.
inline constexpr size_t kMinSecretBytes = 16;

// Wraps `inner` so that every value is signed and checked with `secret`
// (InvalidArgumentError if it is shorter than 16 bytes).
c10::intrusive_ptr<c10d::Store> SignStore(c10::intrusive_ptr<c10d::Store> inner, const std::string& secret);

// The store a SignStore wraps, or null when `store` is not one.
c10::intrusive_ptr<c10d::Store> SignedStoreInner(const c10d::Store& store);

// The secret from SHARDTRAIN_SECRET, else from the file SHARDTRAIN_SECRET_FILE
// names (InvalidArgumentError if it cannot be read, is readable by group or
// others, or holds fewer than 16 bytes), else "" (no authentication).
std::string StoreSecretFromEnvironment();

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_COMM_SIGNED_STORE_H_
