#include "daemon/metrics/metrics_http.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>

namespace trainstream::daemon {

namespace {

constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";  // Prometheus' text format

struct Head {
  std::string_view method, target, version;
  std::optional<std::string_view> authorization;
};

bool EqualsIgnoringCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view Trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r')) text.remove_suffix(1);
  return text;
}

// The next line of `text` (without its "\n" or "\r\n"), which is advanced past it.
std::string_view NextLine(std::string_view& text) {
  const size_t end = text.find('\n');
  std::string_view line = text.substr(0, end);
  text.remove_prefix(end == std::string_view::npos ? text.size() : end + 1);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

// The request line and the Authorization header; nullopt if the request line is malformed.
std::optional<Head> Parse(std::string_view text) {
  const std::string_view line = NextLine(text);
  const size_t first = line.find(' '), second = line.rfind(' ');
  if (first == std::string_view::npos || second == first) return std::nullopt;
  Head head{line.substr(0, first), line.substr(first + 1, second - first - 1), line.substr(second + 1), {}};
  if (head.method.empty() || head.target.empty() || !head.version.starts_with("HTTP/1.")) return std::nullopt;
  while (!text.empty()) {
    const std::string_view header = NextLine(text);
    const size_t colon = header.find(':');
    if (colon == std::string_view::npos) continue;
    if (EqualsIgnoringCase(Trim(header.substr(0, colon)), "authorization")) {
      head.authorization = Trim(header.substr(colon + 1));
    }
  }
  return head;
}

std::string Message(std::string_view status, std::string_view body, std::string_view extra_headers = "",
                    bool head_only = false, std::string_view content_type = "text/plain; charset=utf-8") {
  return fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n{}", status,
                     content_type, body.size(), extra_headers, head_only ? std::string_view() : body);
}

bool Authorized(const Head& head, const std::string& token) {
  if (token.empty()) return true;
  if (!head.authorization) return false;
  const std::string_view value = *head.authorization;
  constexpr std::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() || !EqualsIgnoringCase(value.substr(0, kScheme.size()), kScheme)) return false;
  return TokensEqual(Trim(value.substr(kScheme.size())), token);
}

}  // namespace

bool TokensEqual(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;  // reveals the length only
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

size_t HeadLength(std::string_view received) {
  for (size_t i = 0; i < received.size(); ++i) {
    if (received[i] != '\n') continue;
    if (i + 1 < received.size() && received[i + 1] == '\n') return i + 2;
    if (i + 2 < received.size() && received[i + 1] == '\r' && received[i + 2] == '\n') return i + 3;
  }
  return 0;
}

bool RequestHead::Add(std::string_view bytes) {
  received_.append(bytes.substr(0, kMaxHead - std::min(kMaxHead, received_.size())));
  return HeadLength(received_) > 0 || received_.size() >= kMaxHead;
}

std::string_view RequestHead::head() const {
  const size_t length = HeadLength(received_);
  return std::string_view(received_).substr(0, length > 0 ? length : kMaxHead);
}

std::string Respond(std::string_view head_bytes, const std::string& token,
                    const std::function<std::string()>& metrics) {
  if (HeadLength(head_bytes) == 0 && head_bytes.size() >= kMaxHead) {
    return Message("431 Request Header Fields Too Large",
                   fmt::format("a request head is at most {} bytes\n", kMaxHead));
  }
  const std::optional<Head> head = Parse(head_bytes);
  if (!head) return Message("400 Bad Request", "expected a request line such as GET /metrics HTTP/1.1\n");
  const bool head_only = head->method == "HEAD";
  if (head->method != "GET" && !head_only) {
    return Message("405 Method Not Allowed", "only GET and HEAD are served\n", "Allow: GET, HEAD\r\n");
  }
  const std::string_view path = head->target.substr(0, head->target.find('?'));
  if (path != "/metrics") return Message("404 Not Found", "the metrics are at /metrics\n", "", head_only);
  if (!Authorized(*head, token)) {
    return Message("401 Unauthorized", "this endpoint needs Authorization: Bearer <the token of metrics_token_file>\n",
                   "WWW-Authenticate: Bearer realm=\"trainstreamd\"\r\n", head_only);
  }
  return Message("200 OK", metrics(), "", head_only, kContentType);
}

}  // namespace trainstream::daemon
