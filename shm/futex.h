// Process-shared futex wait/wake on a 32-bit word that lives in a shared-memory segment.
//
// Used for ring wake-ups: no lock is ever shared between processes, so a peer that dies while
// "holding" a futex word cannot deadlock anyone; waiters always use a timeout and re-check.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace trainstream::shm {

// Blocks while *word == expected, at most `timeout`. Returns on wake-up, timeout, signal or mismatch;
// callers re-check their condition.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout);

// Wakes every waiter on *word.
void FutexWakeAll(std::atomic<uint32_t>* word);

}  // namespace trainstream::shm
