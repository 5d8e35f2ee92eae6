// Tests of the metrics endpoint's HTTP (daemon/metrics/metrics_http.h): a scrape, with and without the
// bearer token; HEAD, other methods and paths; a head in pieces, and one that never ends.
#include "daemon/metrics/metrics_http.h"

#include <gtest/gtest.h>

#include <string>

namespace trainstream::daemon {
namespace {

constexpr char kToken[] = "a-metrics-token-0123456789";

std::string Answer(const std::string& request, const std::string& token = "", int* scrapes = nullptr) {
  RequestHead head;
  EXPECT_TRUE(head.Add(request));
  return Respond(head.head(), token, [&] {
    if (scrapes != nullptr) ++*scrapes;
    return std::string("trainstream_info 1\n");
  });
}

TEST(MetricsHttp, AScrapeGetsTheMetricsInPrometheusTextFormat) {
  const std::string response = Answer("GET /metrics HTTP/1.1\r\nHost: node0\r\n\r\n");
  EXPECT_EQ(response,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: 19\r\n"
            "Connection: close\r\n\r\ntrainstream_info 1\n");
}

TEST(MetricsHttp, WithATokenOnlyARequestCarryingItIsAnswered) {
  int scrapes = 0;
  EXPECT_TRUE(Answer("GET /metrics HTTP/1.1\r\n\r\n", kToken, &scrapes).starts_with("HTTP/1.1 401 "));
  const std::string wrong =
      Answer("GET /metrics HTTP/1.1\r\nAuthorization: Bearer a-metrics-token-012345678X\r\n\r\n", kToken, &scrapes);
  EXPECT_TRUE(wrong.starts_with("HTTP/1.1 401 ")) << wrong;
  EXPECT_NE(wrong.find("WWW-Authenticate: Bearer"), std::string::npos);
  EXPECT_TRUE(
      Answer("GET /metrics HTTP/1.1\r\nAuthorization: Basic a-metrics-token-0123456789\r\n\r\n", kToken, &scrapes)
          .starts_with("HTTP/1.1 401 "));
  EXPECT_EQ(scrapes, 0);  // nothing read for a refused request
  EXPECT_TRUE(
      Answer("GET /metrics HTTP/1.1\r\nauthorization:  bearer a-metrics-token-0123456789 \r\n\r\n", kToken, &scrapes)
          .starts_with("HTTP/1.1 200 "));
  EXPECT_EQ(scrapes, 1);
}

TEST(MetricsHttp, OtherMethodsPathsAndMalformedRequestsAreRefusedByName) {
  EXPECT_TRUE(Answer("POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
  EXPECT_TRUE(Answer("GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
  EXPECT_TRUE(Answer("GET /metrics?name[]=x HTTP/1.0\n\n").starts_with("HTTP/1.1 200 "));
  EXPECT_TRUE(Answer("GET /metrics SPDY/3\r\n\r\n").starts_with("HTTP/1.1 400 "));
  EXPECT_TRUE(Answer("\r\n\r\n").starts_with("HTTP/1.1 400 "));
  const std::string head = Answer("HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_TRUE(head.starts_with("HTTP/1.1 200 ") && head.ends_with("Content-Length: 19\r\nConnection: close\r\n\r\n"))
      << head;
}

TEST(MetricsHttp, AHeadArrivesInPiecesAndOneTooLongIsRefused) {
  RequestHead head;
  EXPECT_FALSE(head.Add("GET /metrics HTTP/1.1\r"));
  EXPECT_FALSE(head.Add("\nHost: x\r\n\r"));
  EXPECT_TRUE(head.Add("\nbody that is not kept"));
  EXPECT_EQ(head.head(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  RequestHead endless;
  EXPECT_FALSE(endless.Add("GET /metrics HTTP/1.1\r\nX: " + std::string(kMaxHead - 100, 'x')));
  EXPECT_TRUE(endless.Add(std::string(1000, 'x')));
  EXPECT_EQ(endless.head().size(), kMaxHead);
  EXPECT_TRUE(Respond(endless.head(), "", [] { return std::string(); }).starts_with("HTTP/1.1 431 "));
}

}  // namespace
}  // namespace trainstream::daemon
