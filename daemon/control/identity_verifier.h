// The daemon's side of shm/identity_proof.h: issues nonces and turns a presented nonce into the uid
// that owns its proof file. A nonce is good for one use and for kNonceLifetime.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace trainstream::daemon {

class IdentityVerifier {
 public:
  static constexpr auto kNonceLifetime = std::chrono::seconds(60);

  std::string IssueNonce();
  // The uid that created the nonce's proof file; removes nonce and file. kPermissionDenied when the
  // nonce is unknown, used or expired, or its file is missing or not a plain file.
  uint32_t Verify(const std::string& nonce);

 private:
  std::mutex mutex_;
  std::map<std::string, std::chrono::steady_clock::time_point> nonces_;  // nonce -> issued at
};

}  // namespace trainstream::daemon
