// Proof of a client's uid without trusting what it says: the daemon hands out a random single-use
// nonce; the client creates a regular file named after it in /dev/shm (world-writable, sticky); the
// kernel records the creator as the file's owner, which the daemon reads. Nobody else learns the
// nonce, and a file of another uid proves only that uid, so no client can claim another's uid.
#pragma once

#include <string>

namespace trainstream::shm {

// /dev/shm/trainstream-proof-<nonce>
std::string ProofPath(const std::string& nonce);

// Client side: creates the proof file for `nonce` (fails if it exists). The daemon removes it.
void CreateProof(const std::string& nonce);

}  // namespace trainstream::shm
