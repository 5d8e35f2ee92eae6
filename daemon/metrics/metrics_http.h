// The HTTP of the metrics endpoint, as functions of the bytes a client sent: where a request's head
// ends, and the whole response to it. Only `GET /metrics` (and HEAD) is served, one request per
// connection (every response says `Connection: close`; Prometheus and curl reconnect for the next).
// With a token, a request must carry `Authorization: Bearer <token>` (Prometheus' `authorization:
// credentials_file:`); the comparison takes the same time wherever the tokens differ.
//
// Invariants: every response is a complete HTTP/1.1 message whose Content-Length is its body's; the
// metrics are read (`metrics()` called) only for a request that may see them. A head is at most
// kMaxHead bytes; the body of a request, if any, is never read.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace trainstream::daemon {

inline constexpr size_t kMaxHead = 8192;

// The length of the request head at the start of `received` (through the blank line that ends it,
// "\r\n\r\n" or "\n\n"), or 0 while it is incomplete.
size_t HeadLength(std::string_view received);

// Collects a request's head from what arrives, in pieces of any size.
class RequestHead {
 public:
  // Takes bytes that arrived; true once the head is complete or has reached kMaxHead (then Respond
  // answers 431). Bytes after the head are not kept.
  bool Add(std::string_view bytes);
  [[nodiscard]] std::string_view head() const;

 private:
  std::string received_;
};

// The response to the request head `head` (as HeadLength delimits it, or a head cut at kMaxHead:
// answered 431). `token` empty: no authorization asked. `metrics` gives the body of a scrape.
std::string Respond(std::string_view head, const std::string& token, const std::function<std::string()>& metrics);

// Whether a and b are equal, in time independent of where equally long strings differ.
bool TokensEqual(std::string_view a, std::string_view b);

}  // namespace trainstream::daemon
