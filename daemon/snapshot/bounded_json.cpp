#include "daemon/snapshot/bounded_json.h"

#include <fmt/format.h>

#include <algorithm>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

constexpr size_t kDescribedChars = 60;

// A string cut inside a UTF-8 sequence is still printed (the cut character replaced).
std::string Dumped(const nlohmann::json& scalar) {
  return scalar.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// The deepest nesting of arrays and objects in `text`, counted in one pass without recursion. Exact for
// valid JSON; for invalid JSON at least as deep as whatever the parser builds before it finds the error
// (up to there, the text is a prefix of valid JSON, whose strings this reads as the parser does).
int NestingDepth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace

nlohmann::json ParseBoundedJson(std::string_view text, const char* what) {
  // Before the parser: its callback, which could stop it at a depth, looks through the enclosing object
  // at every object's end (245k entries took minutes).
  TS_CHECK(NestingDepth(text) <= kMaxJsonDepth, Code::kInvalidArgument, "its {} is nested deeper than {} levels", what,
           kMaxJsonDepth);
  nlohmann::json json = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  TS_CHECK(!json.is_discarded(), Code::kInvalidArgument, "its {} is not valid JSON", what);
  return json;
}

std::string Excerpt(std::string_view text) {
  if (text.size() <= kDescribedChars) return std::string(text);
  return fmt::format("{}... ({} bytes)", text.substr(0, kDescribedChars), text.size());
}

std::string Describe(const nlohmann::json& value) {
  switch (value.type()) {
    case nlohmann::json::value_t::array: return fmt::format("an array of {} items", value.size());
    case nlohmann::json::value_t::object: return fmt::format("an object of {} entries", value.size());
    case nlohmann::json::value_t::string: {
      const auto& text = value.get_ref<const std::string&>();
      if (text.size() <= kDescribedChars) return Dumped(value);
      return Dumped(nlohmann::json(text.substr(0, kDescribedChars))) + fmt::format("... ({} bytes)", text.size());
    }
    default: return Dumped(value);  // a scalar: short, and never recursive
  }
}

}  // namespace trainstream::daemon
