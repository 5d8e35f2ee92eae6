// libFuzzer harness: the metrics endpoint's HTTP (daemon/metrics/metrics_http.h). The bytes are what a
// client sends, arriving in up to four pieces where the fuzzer cuts them, collected as the server
// does (RequestHead) and answered with or without a token. Checks what every answer must be: a
// complete HTTP/1.1 response whose Content-Length is its body's (none for HEAD), metrics read only
// for a 200, and a 200 with a token only for a request that carried it.
#include <fuzzer/FuzzedDataProvider.h>

#include <charconv>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/metrics/metrics_http.h"

namespace {

constexpr char kToken[] = "fuzz-token-0123456789";

void Require(bool condition) {
  if (!condition) __builtin_trap();
}

void CheckResponse(std::string_view head, std::string_view response, bool with_token, int scrapes) {
  Require(response.starts_with("HTTP/1.1 "));
  const size_t end = response.find("\r\n\r\n");
  Require(end != std::string_view::npos);
  const std::string_view headers = response.substr(0, end), body = response.substr(end + 4);
  const size_t field = headers.find("\r\nContent-Length: ");
  Require(field != std::string_view::npos);
  const std::string_view digits = headers.substr(field + 18, headers.find("\r\n", field + 2) - field - 18);
  size_t length = 0;
  Require(std::from_chars(digits.data(), digits.data() + digits.size(), length).ec == std::errc());
  Require(body.size() == length || (body.empty() && head.starts_with("HEAD ")));
  const bool ok = response.starts_with("HTTP/1.1 200 ");
  Require(scrapes == (ok ? 1 : 0));
  if (ok && with_token) Require(head.find(kToken) != std::string_view::npos);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  const bool with_token = data.ConsumeBool();
  const size_t cuts = data.ConsumeIntegralInRange<size_t>(0, 3);
  std::vector<size_t> lengths;
  for (size_t i = 0; i < cuts; ++i) lengths.push_back(data.ConsumeIntegralInRange<size_t>(0, data.remaining_bytes()));
  std::vector<std::string> pieces;
  pieces.reserve(lengths.size() + 1);
  for (size_t length : lengths) pieces.push_back(data.ConsumeBytesAsString(length));
  pieces.push_back(data.ConsumeRemainingBytesAsString());

  trainstream::daemon::RequestHead request;
  bool complete = false;
  for (const std::string& piece : pieces) {
    if ((complete = request.Add(piece))) break;
  }
  if (!complete) return 0;  // the server waits for more, until the client's time is up
  int scrapes = 0;
  const std::string response = trainstream::daemon::Respond(request.head(), with_token ? kToken : "", [&] {
    ++scrapes;
    return std::string("# TYPE trainstream_info gauge\ntrainstream_info 1\n");
  });
  CheckResponse(request.head(), response, with_token, scrapes);
  return 0;
}
