// The wire protocol of the authenticated rendezvous store (comm/auth_store.h),
// shared by its server and its client connections. Plain C++ and OpenSSL's
// libcrypto; no torch header.
//
// Handshake (every message a frame: u32 little-endian length, then the body;
// at most kMaxHandshakeBytes before the client is authenticated):
//   server -> client  hello:   kMagic, server nonce Ns (32 random bytes)
//   client -> server  proof:   kMagic, client nonce Nc,
//                              Pc = HMAC(secret, "client" label || Ns || Nc)
//   server -> client  verdict: 0, Ps = HMAC(secret, "server" label || Ns || Nc || Pc)
//                          or  1, the reason (then the server closes)
// Both sides prove that they hold the secret over the other's fresh nonce;
// the labels differ, so a proof reflected to its sender fails, and Ps covers
// the whole transcript. After it both derive a session key
// Ks = HMAC(secret, "session" label || Ns || Nc) and every frame carries
// HMAC(Ks, direction || sequence number || body): a frame injected into the
// stream, replayed, reordered or moved to another connection is refused.
// Values travel unencrypted (authentication, not confidentiality).
#ifndef SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_PROTOCOL_H_
#define SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain::comm::auth_store {

using Bytes = std::vector<uint8_t>;

inline constexpr char kMagic[] = "STSTORE1";  // 8 bytes on the wire (no NUL)
inline constexpr size_t kMagicBytes = 8;
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kTagBytes = 32;  // HMAC-SHA-256
inline constexpr uint32_t kMaxHandshakeBytes = 256;
// Limits of an authenticated client's requests (a larger one is refused by
// the client before it is sent, and closes the connection on the server).
inline constexpr uint32_t kMaxFrameBytes = 64u << 20;
inline constexpr size_t kMaxKeyBytes = 4096;
inline constexpr size_t kMaxValueBytes = 32u << 20;
inline constexpr uint32_t kMaxKeysPerRequest = 1u << 16;

// Requests (first byte of a request body).
enum class Op : uint8_t {
  kSet = 1, kGet, kAdd, kCompareSet, kDelete, kCheck, kWait, kNumKeys, kMultiGet, kMultiSet, kAppend,
};
// Responses (first byte of a response body).
enum class Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

// Appends `n` bytes to `out` (one out-of-line copy: GCC 12's -Warray-bounds
// misreads vector::insert of a range into a small vector).
void Append(Bytes* out, const void* data, size_t n);
inline void Append(Bytes* out, const Bytes& more) { Append(out, more.data(), more.size()); }

// `n` random bytes from OpenSSL's CSPRNG (throws CommError if it fails).
Bytes RandomBytes(size_t n);

// HMAC-SHA-256 of the concatenation of `parts` under `key`.
Bytes Hmac(const std::string& key, std::initializer_list<const Bytes*> parts);
// Constant-time equality of two tags.
bool TagsEqual(const Bytes& a, const uint8_t* b);

Bytes ClientProof(const std::string& secret, const Bytes& ns, const Bytes& nc);
Bytes ServerProof(const std::string& secret, const Bytes& ns, const Bytes& nc, const Bytes& client_proof);
std::string SessionKey(const std::string& secret, const Bytes& ns, const Bytes& nc);

// Appends a handshake frame (length prefix and body) to `out`.
void AppendPlainFrame(const Bytes& body, Bytes* out);

// Where a frame stands in the bytes received so far.
enum class Parse { kNeedMore, kFrame, kTooLarge };
// Takes one frame from the front of `in` (its body, then `tag_bytes` of tag)
// when complete; kTooLarge when it announces more than `max_body` bytes
// (`*announced` says how many), before anything of that size is allocated.
Parse TakeFrame(Bytes* in, uint32_t max_body, size_t tag_bytes, Bytes* body, Bytes* tag, uint32_t* announced);

// One side of an authenticated connection: seals outgoing frames and opens
// incoming ones with the session key and per-direction sequence numbers.
class FrameSealer {
 public:
  FrameSealer(std::string session_key, bool is_server) : key_(std::move(session_key)), is_server_(is_server) {}
  // Appends the wire form of `body` (length, body, tag) to `out`.
  void Seal(const Bytes& body, Bytes* out);
  // True when `tag` is the next expected frame's tag for `body`.
  bool Open(const Bytes& body, const Bytes& tag);
  uint64_t received() const { return recv_seq_; }

 private:
  Bytes Tag(uint8_t direction, uint64_t seq, const Bytes& body) const;
  std::string key_;
  bool is_server_;
  uint64_t send_seq_ = 0;
  uint64_t recv_seq_ = 0;
};

// Builds a request or response body.
class Writer {
 public:
  explicit Writer(uint8_t first) { out_.push_back(first); }
  Writer& U8(uint8_t v);
  Writer& U32(uint32_t v);
  Writer& I64(int64_t v);
  Writer& Blob(const void* data, size_t n);  // u32 length, then the bytes
  Writer& Str(const std::string& s) { return Blob(s.data(), s.size()); }
  Writer& Vec(const Bytes& v) { return Blob(v.data(), v.size()); }
  Writer& Keys(const std::vector<std::string>& keys);
  Bytes Take() { return std::move(out_); }

 private:
  Bytes out_;
};

// Reads a body written by Writer; every getter returns false when the body
// is too short or a length exceeds its limit (a malformed message).
class Reader {
 public:
  explicit Reader(const Bytes& body) : body_(body) {}
  bool U8(uint8_t* v);
  bool U32(uint32_t* v);
  bool I64(int64_t* v);
  bool Blob(size_t max, Bytes* v);
  bool Str(size_t max, std::string* s);
  bool Keys(std::vector<std::string>* keys);
  bool AtEnd() const { return pos_ == body_.size(); }

 private:
  const Bytes& body_;
  size_t pos_ = 0;
};

}  // namespace shardtrain::comm::auth_store

#endif  // SHARDTRAIN_COMM_AUTH_STORE_INTERNAL_PROTOCOL_H_
