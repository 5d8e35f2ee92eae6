#include "daemon/control/identity_verifier.h"

#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "shm/error.h"
#include "shm/identity_proof.h"

namespace trainstream::daemon {

std::string IdentityVerifier::IssueNonce() {
  std::random_device device;
  std::string nonce;
  for (int i = 0; i < 4; ++i) nonce += fmt::format("{:08x}", device());
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(mutex_);
  std::erase_if(nonces_, [&](const auto& entry) { return now - entry.second > kNonceLifetime; });
  nonces_.emplace(nonce, now);
  return nonce;
}

uint32_t IdentityVerifier::Verify(const std::string& nonce) {
  {
    std::lock_guard lock(mutex_);
    auto it = nonces_.find(nonce);
    TS_CHECK(it != nonces_.end() && std::chrono::steady_clock::now() - it->second <= kNonceLifetime,
             Code::kPermissionDenied, "identity proof refused: unknown, used or expired nonce (call Challenge first)");
    nonces_.erase(it);
  }
  const std::string path = shm::ProofPath(nonce);
  struct stat info {};
  TS_CHECK(lstat(path.c_str(), &info) == 0, Code::kPermissionDenied, "identity proof refused: {} does not exist", path);
  unlink(path.c_str());
  TS_CHECK(S_ISREG(info.st_mode) && info.st_nlink == 1, Code::kPermissionDenied,
           "identity proof refused: {} is not a plain file", path);
  return static_cast<uint32_t>(info.st_uid);
}

}  // namespace trainstream::daemon
