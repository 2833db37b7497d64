// The authenticated store's wire protocol: proofs, session keys, frames and
// message bodies (comm/auth_store/internal/protocol.h).
#include "comm/auth_store/internal/protocol.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

#include "base/errors.h"

namespace shardtrain::comm::auth_store {
namespace {

// The domain-separation labels of the proofs and the session key.
Bytes Label(const char* role) {
  const std::string text = std::string("shardtrain-store/1 ") + role;
  return Bytes(text.begin(), text.end());
}

void PutU32(uint32_t v, Bytes* out) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

uint32_t GetU32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

}  // namespace

[[gnu::noinline]] void Append(Bytes* out, const void* data, size_t n) {
  if (n == 0) return;
  const size_t at = out->size();
  out->resize(at + n);
  std::memcpy(out->data() + at, data, n);
}

Bytes RandomBytes(size_t n) {
  Bytes out(n);
  if (RAND_bytes(out.data(), static_cast<int>(n)) != 1) ST_THROW(CommError, "store: OpenSSL's RAND_bytes failed");
  return out;
}

Bytes Hmac(const std::string& key, std::initializer_list<const Bytes*> parts) {
  Bytes msg;
  for (const Bytes* p : parts) Append(&msg, *p);
  Bytes tag(EVP_MAX_MD_SIZE);
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), msg.data(), msg.size(), tag.data(), &len) ==
          nullptr ||
      len != kTagBytes) {
    ST_THROW(CommError, "store: computing an HMAC-SHA-256 failed");
  }
  tag.resize(kTagBytes);
  return tag;
}

bool TagsEqual(const Bytes& a, const uint8_t* b) { return a.size() == kTagBytes && CRYPTO_memcmp(a.data(), b, kTagBytes) == 0; }

Bytes ClientProof(const std::string& secret, const Bytes& ns, const Bytes& nc) {
  const Bytes label = Label("client proof");
  return Hmac(secret, {&label, &ns, &nc});
}

Bytes ServerProof(const std::string& secret, const Bytes& ns, const Bytes& nc, const Bytes& client_proof) {
  const Bytes label = Label("server proof");
  return Hmac(secret, {&label, &ns, &nc, &client_proof});
}

std::string SessionKey(const std::string& secret, const Bytes& ns, const Bytes& nc) {
  const Bytes label = Label("session key");
  const Bytes k = Hmac(secret, {&label, &ns, &nc});
  return std::string(k.begin(), k.end());
}

void AppendPlainFrame(const Bytes& body, Bytes* out) {
  PutU32(static_cast<uint32_t>(body.size()), out);
  Append(out, body);
}

Parse TakeFrame(Bytes* in, uint32_t max_body, size_t tag_bytes, Bytes* body, Bytes* tag, uint32_t* announced) {
  if (in->size() < 4) return Parse::kNeedMore;
  const uint32_t n = GetU32(in->data());
  *announced = n;
  if (n > max_body) return Parse::kTooLarge;
  const size_t total = 4 + static_cast<size_t>(n) + tag_bytes;
  if (in->size() < total) return Parse::kNeedMore;
  body->assign(in->begin() + 4, in->begin() + 4 + n);
  tag->assign(in->begin() + 4 + n, in->begin() + static_cast<std::ptrdiff_t>(total));
  in->erase(in->begin(), in->begin() + static_cast<std::ptrdiff_t>(total));
  return Parse::kFrame;
}

Bytes FrameSealer::Tag(uint8_t direction, uint64_t seq, const Bytes& body) const {
  Bytes head{direction};
  for (int i = 0; i < 8; ++i) head.push_back(static_cast<uint8_t>(seq >> (8 * i)));
  return Hmac(key_, {&head, &body});
}

void FrameSealer::Seal(const Bytes& body, Bytes* out) {
  const Bytes tag = Tag(is_server_ ? 'S' : 'C', send_seq_++, body);
  AppendPlainFrame(body, out);
  Append(out, tag);
}

bool FrameSealer::Open(const Bytes& body, const Bytes& tag) {
  if (tag.size() != kTagBytes) return false;
  if (!TagsEqual(Tag(is_server_ ? 'C' : 'S', recv_seq_, body), tag.data())) return false;
  ++recv_seq_;
  return true;
}

Writer& Writer::U8(uint8_t v) {
  out_.push_back(v);
  return *this;
}

Writer& Writer::U32(uint32_t v) {
  PutU32(v, &out_);
  return *this;
}

Writer& Writer::I64(int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out_.push_back(static_cast<uint8_t>(u >> (8 * i)));
  return *this;
}

Writer& Writer::Blob(const void* data, size_t n) {
  PutU32(static_cast<uint32_t>(n), &out_);
  Append(&out_, data, n);
  return *this;
}

Writer& Writer::Keys(const std::vector<std::string>& keys) {
  U32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) Str(k);
  return *this;
}

bool Reader::U8(uint8_t* v) {
  if (body_.size() - pos_ < 1) return false;
  *v = body_[pos_++];
  return true;
}

bool Reader::U32(uint32_t* v) {
  if (body_.size() - pos_ < 4) return false;
  *v = GetU32(body_.data() + pos_);
  pos_ += 4;
  return true;
}

bool Reader::I64(int64_t* v) {
  if (body_.size() - pos_ < 8) return false;
  uint64_t u = 0;
  for (int i = 0; i < 8; ++i) u |= static_cast<uint64_t>(body_[pos_ + i]) << (8 * i);
  *v = static_cast<int64_t>(u);
  pos_ += 8;
  return true;
}

bool Reader::Blob(size_t max, Bytes* v) {
  uint32_t n = 0;
  if (!U32(&n) || n > max || body_.size() - pos_ < n) return false;
  v->assign(body_.begin() + static_cast<std::ptrdiff_t>(pos_), body_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
  pos_ += n;
  return true;
}

bool Reader::Str(size_t max, std::string* s) {
  Bytes b;
  if (!Blob(max, &b)) return false;
  s->assign(b.begin(), b.end());
  return true;
}

bool Reader::Keys(std::vector<std::string>* keys) {
  uint32_t n = 0;
  // Each key takes at least its 4-byte length: a count the body cannot hold is malformed.
  if (!U32(&n) || n > kMaxKeysPerRequest || n > (body_.size() - pos_) / 4) return false;
  keys->resize(n);
  for (auto& k : *keys) {
    if (!Str(kMaxKeyBytes, &k)) return false;
  }
  return true;
}

}  // namespace shardtrain::comm::auth_store
