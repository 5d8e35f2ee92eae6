#include "shm/identity_proof.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shm/error.h"

namespace trainstream::shm {

std::string ProofPath(const std::string& nonce) {
  return "/dev/shm/trainstream-proof-" + nonce;
}

void CreateProof(const std::string& nonce) {
  const std::string path = ProofPath(nonce);
  const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0600);
  TS_CHECK(fd >= 0, Code::kPermissionDenied, "cannot create identity proof {}: {}", path, std::strerror(errno));
  close(fd);
}

}  // namespace trainstream::shm
