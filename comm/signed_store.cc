// SignStore: HMAC-SHA-256 over (key, value) appended to every value.
#include "comm/signed_store.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "base/errors.h"

namespace shardtrain::comm {
namespace {

constexpr size_t kTagBytes = 32;  // SHA-256

class SignedStore : public c10d::Store {
 public:
  SignedStore(c10::intrusive_ptr<c10d::Store> inner, std::string secret)
      : c10d::Store(inner->getTimeout()), inner_(std::move(inner)), secret_(std::move(secret)) {}

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<SignedStore>(inner_->clone(), secret_);
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override { inner_->set(key, Sign(key, value)); }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    // An empty `expected` means "the key does not exist yet" to c10d: keep it empty.
    const std::vector<uint8_t> result =
        inner_->compareSet(key, expected.empty() ? expected : Sign(key, expected), Sign(key, desired));
    return Verify(key, result);
  }
  std::vector<uint8_t> get(const std::string& key) override { return Verify(key, inner_->get(key)); }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout);
  }
  const std::chrono::milliseconds& getTimeout() const noexcept override { return inner_->getTimeout(); }
  void setTimeout(const std::chrono::milliseconds& timeout) override {
    c10d::Store::setTimeout(timeout);
    inner_->setTimeout(timeout);
  }
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override {
    std::vector<std::vector<uint8_t>> values = inner_->multiGet(keys);
    for (size_t i = 0; i < values.size(); ++i) values[i] = Verify(keys[i], values[i]);
    return values;
  }
  void multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) override {
    std::vector<std::vector<uint8_t>> signed_values;
    for (size_t i = 0; i < keys.size() && i < values.size(); ++i) signed_values.push_back(Sign(keys[i], values[i]));
    inner_->multiSet(keys, signed_values);
  }
  // append() would concatenate signed values: not offered (Gloo then uses set/get).
  bool hasExtendedApi() const override { return false; }
  const c10::intrusive_ptr<c10d::Store>& inner() const { return inner_; }

 private:
  std::vector<uint8_t> Tag(const std::string& key, const uint8_t* value, size_t n) const {
    std::vector<uint8_t> msg;
    const uint64_t klen = key.size();
    msg.resize(sizeof klen + key.size() + n);
    std::memcpy(msg.data(), &klen, sizeof klen);
    std::memcpy(msg.data() + sizeof klen, key.data(), key.size());
    if (n > 0) std::memcpy(msg.data() + sizeof klen + key.size(), value, n);
    std::vector<uint8_t> tag(EVP_MAX_MD_SIZE);
    unsigned int len = 0;
    if (HMAC(EVP_sha256(), secret_.data(), static_cast<int>(secret_.size()), msg.data(), msg.size(), tag.data(),
             &len) == nullptr ||
        len != kTagBytes) {
      ST_THROW(CommError, "store: computing the HMAC-SHA-256 of key '", key, "' failed");
    }
    tag.resize(kTagBytes);
    return tag;
  }
  std::vector<uint8_t> Sign(const std::string& key, const std::vector<uint8_t>& value) const {
    std::vector<uint8_t> out = value;
    const std::vector<uint8_t> tag = Tag(key, value.data(), value.size());
    out.insert(out.end(), tag.begin(), tag.end());
    return out;
  }
  std::vector<uint8_t> Verify(const std::string& key, const std::vector<uint8_t>& stored) const {
    const bool ok = stored.size() >= kTagBytes && [&] {
      const size_t n = stored.size() - kTagBytes;
      const std::vector<uint8_t> tag = Tag(key, stored.data(), n);
      return CRYPTO_memcmp(tag.data(), stored.data() + n, kTagBytes) == 0;
    }();
    if (!ok) {
      ST_THROW(CommError, "store key '", key, "' (", stored.size(),
               " bytes) was not written by a rank of this job: its HMAC-SHA-256 signature does not match the "
               "job's secret (SHARDTRAIN_SECRET / SHARDTRAIN_SECRET_FILE). Another client of the rendezvous store "
               "wrote it, or the ranks were given different secrets; refusing to use it");
    }
    return std::vector<uint8_t>(stored.begin(), stored.end() - kTagBytes);
  }

  c10::intrusive_ptr<c10d::Store> inner_;
  std::string secret_;
};

}  // namespace

c10::intrusive_ptr<c10d::Store> SignStore(c10::intrusive_ptr<c10d::Store> inner, const std::string& secret) {
  ST_CHECK_ARG(inner, "SignStore: no store");
  ST_CHECK_ARG(secret.size() >= kMinSecretBytes, "the store secret must be at least ", kMinSecretBytes,
               " bytes, got ", secret.size());
  return c10::make_intrusive<SignedStore>(std::move(inner), secret);
}

c10::intrusive_ptr<c10d::Store> SignedStoreInner(const c10d::Store& store) {
  const auto* s = dynamic_cast<const SignedStore*>(&store);
  return s != nullptr ? s->inner() : c10::intrusive_ptr<c10d::Store>();
}

std::string StoreSecretFromEnvironment() {
  if (const char* s = std::getenv(kSecretEnvVar); s != nullptr && *s != '\0') {
    ST_CHECK_ARG(std::strlen(s) >= kMinSecretBytes, kSecretEnvVar, " must hold at least ", kMinSecretBytes,
                 " bytes, got ", std::strlen(s));
    return s;
  }
  const char* path = std::getenv(kSecretFileEnvVar);
  if (path == nullptr || *path == '\0') return "";
  struct stat st {};
  ST_CHECK_ARG(::stat(path, &st) == 0, kSecretFileEnvVar, "='", path, "': cannot stat: ", std::strerror(errno));
  char mode[8];
  std::snprintf(mode, sizeof mode, "0%03o", static_cast<unsigned>(st.st_mode & 0777));
  ST_CHECK_ARG((st.st_mode & 077) == 0, kSecretFileEnvVar, "='", path, "' has mode ", mode,
               ": group or others may read it; valid: mode 0600 or 0400 (chmod 600)");
  std::ifstream in(path, std::ios::binary);
  ST_CHECK_ARG(in.good(), kSecretFileEnvVar, "='", path, "': cannot open it for reading");
  std::ostringstream os;
  os << in.rdbuf();
  std::string secret = os.str();
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  ST_CHECK_ARG(secret.size() >= kMinSecretBytes, kSecretFileEnvVar, "='", path, "' must hold at least ",
               kMinSecretBytes, " bytes, got ", secret.size());
  return secret;
}

}  // namespace shardtrain::comm
