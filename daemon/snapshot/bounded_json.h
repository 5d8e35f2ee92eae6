// JSON from a file a client controls (the layout and hyperparameters inside a snapshot's metadata):
// refused past a nesting depth before it is parsed, and described in error messages without being
// printed. nlohmann's parser keeps its own stack, but dump() recurses once per level: 100k levels in a
// 200 KB header (issue 46) overflowed a daemon thread's stack from an error message that printed the
// value. Errors are kInvalidArgument, naming `what` was parsed. (The header itself is read event by
// event into its fixed structure: daemon/snapshot/safetensors.cpp.)
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace trainstream::daemon {

// The deepest nesting of arrays and objects accepted. A snapshot's layout metadata needs 4 (object,
// params, a parameter, its shape), its hparams 2; the rest is margin.
inline constexpr int kMaxJsonDepth = 8;

// Parses `text` as JSON; kInvalidArgument if it is not, or nests deeper than kMaxJsonDepth.
nlohmann::json ParseBoundedJson(std::string_view text, const char* what);

// A short description of a value for an error message, at most about 80 characters: a scalar as
// written (a long string cut), an array or object by its size ("an array of 3 items").
std::string Describe(const nlohmann::json& value);
// `text` for an error message: whole up to about 60 bytes, else its start and its length.
std::string Excerpt(std::string_view text);

}  // namespace trainstream::daemon
